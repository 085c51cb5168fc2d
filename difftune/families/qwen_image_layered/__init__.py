"""Qwen-Image-Layered: Qwen-Image's transformer taught to split an image into transparent layers
(`QwenImageLayeredPipeline`), trained on an RGBA image, its caption and its layers. Everything else is Qwen-Image's
(qwen_image.py): the language model and its template, the objective, the files.

- Data (musubi-tuner's layout): `cat.png` with its layers `cat_1.png`, `cat_2.png`... beside it (or from `_0`), all
  RGBA and of one size; a `metadata.jsonl` lists the layers as `control_files`. The layers are held as the
  example's controls (cut, flipped and cached as the image is), and the images keep their alpha
  (`data_settings`: `data.keep_alpha`), which the RGBA autoencoder (`AutoencoderKLQwenImage` with `input_channels`
  4) reads.
- What trains (`trained_latents`): the image's latents and each layer's, a stack (B, C, 1 + layers, h, w) noised
  as one, the image first (the pipeline draws it again, first, and drops it); the image's clean latents follow as
  the condition, as `QwenImageLayeredPipeline` places the image it splits: every image of the stack and the
  condition by its own `img_shapes` entry (its layer-3D rope puts the condition at layer -1), the transformer's
  `additional_t_cond` 0 (what the pipeline passes for RGBA input). musubi-tuner conditions on the image's trained
  latents too (the pipeline encodes its argmax: the same up to the posterior's spread).
- Noise levels: the pipeline's shift is exp(mu) with mu = sqrt(image tokens / 256), counted on the image alone
  (`image_tokens`), not on the stack, under its scheduler's exponential time shift.
- Samples: each sample prompt names the image to split (`{prompt = "...", controls = ["image.png"]}`); it is drawn
  as its layers side by side (RGBA), `model.family_options.layers` of them. The pipeline sizes its input to
  640 px or 1024 px squared (its `resolution`) whatever size it is asked to draw; `draw` sizes it to the drawn
  size instead, as the edit families do.
"""

from __future__ import annotations

import math

import diffusers.pipelines.qwenimage.pipeline_qwenimage_layered as layered_pipeline_module
import torch
from diffusers import QwenImageLayeredPipeline
from pydantic import Field
from transformers import Qwen2VLProcessor

from difftune.config import Config, DataConfig
from difftune.errors import DifftuneError
from difftune.families.common.drawing import one_image_each, side_by_side
from difftune.families.common.flow import FlowDrawing, FlowMatching, FlowOptions
from difftune.families.common.tokens import unpack
from difftune.families.qwen_image import QwenImage, QwenImageConditioning
from difftune.families.qwen_image_edit import dimensions_for_the_call
from difftune.models.components import Components
from difftune.models.processors import load_without_video_processor

load_without_video_processor(Qwen2VLProcessor)

BASE_TOKENS = 256 * 256 / 16 / 16  # the pipeline's `base_seqlen`: mu = sqrt(tokens / BASE_TOKENS)
PIPELINE_RESOLUTION = 640  # one of the two input sizes the pipeline accepts; `draw` sizes the input itself


def layered_shift(components: Components, image_tokens: int) -> float:
    """exp(mu), mu = sqrt(image tokens / 256): the shift `QwenImageLayeredPipeline` asks its scheduler for (its
    exponential time shift at `mu` is SD3's shift by exp(mu))."""
    return math.exp(math.sqrt(image_tokens / BASE_TOKENS))


class LayeredOptions(FlowOptions):
    layers: int = Field(
        4, ge=1, le=16, description="The layers each sample splits its image into (the pipeline's `layers`)."
    )


class QwenImageLayeredDrawing(FlowDrawing):
    needs_controls_to_draw = True

    def prompt_control_problems(self, prompts: list) -> list[str]:
        """Every sample prompt names the one image it splits."""
        return one_image_each(prompts, f"{self.family.description} pipelines split one", "image.png")

    def draw(self, pipeline, options: LayeredOptions, prompt, controls, height, width, **arguments) -> list:
        """Each prompt's layers side by side, as one RGBA image."""
        with dimensions_for_the_call(layered_pipeline_module, height * width if height else 0):
            drawn = pipeline(
                image=controls[0].convert("RGBA"),
                prompt=prompt,
                layers=options.layers,
                resolution=PIPELINE_RESOLUTION,
                **arguments,
            ).images
        return [side_by_side(layers, keep_alpha=True) for layers in drawn]


class QwenImageLayeredConditioning(QwenImageConditioning):
    trains_layers = True

    def encoder_tokenizers(self) -> list[tuple[str, str]]:
        return [("text_encoder", "tokenizer")]

    def data_settings(self, data: DataConfig) -> DataConfig:
        return data.model_copy(update={"keep_alpha": True})  # its layers are transparent, its autoencoder RGBA

    def check_controls(self, examples: list, key: str) -> None:
        """Every example has its layers (a folder's are found by the scan; a `metadata.jsonl` or a stored record
        lists them)."""
        bare = next((example for example in examples if not example.control_paths), None)
        if bare is not None:
            raise DifftuneError(
                f"{key}: {bare.path} has no layers; {self.family.description} trains an image with its layers, "
                f"{bare.path.stem}_1.png, {bare.path.stem}_2.png... beside it (or `control_files` in metadata.jsonl)"
            )

    def planned_controls(self, components: Components, latents: torch.Tensor) -> list[torch.Tensor]:
        return [latents] * components.family_options.layers  # as many layers as its samples split into

    def trained_latents(self, latents: torch.Tensor, conditioning: dict) -> torch.Tensor:
        layers = conditioning.pop("control_latents")
        conditioning["image_latents"] = latents
        return torch.stack([latents, *layers], dim=2)


class QwenImageLayered(QwenImage):
    name = "qwen_image_layered"
    description = "Qwen-Image-Layered"
    pipeline_class = QwenImageLayeredPipeline
    controlnet = None  # QwenImageControlNetPipeline draws text-to-image: no ControlNet reads layers
    pipeline_classes = ("QwenImageLayeredPipeline",)
    tokenizer_names = ("tokenizer", "processor")  # the pipeline captions an uncaptioned image with the processor
    options_model = LayeredOptions
    objective = FlowMatching(layered_shift)
    conditioning = QwenImageLayeredConditioning()
    drawing = QwenImageLayeredDrawing()
    max_controls = 1  # a sample prompt names the one image it splits
    edit_base = True

    def unsupported_settings(self, config: Config) -> list[str]:
        problems = super().unsupported_settings(config)
        if config.prior.enabled:
            problems.append("prior: Qwen-Image-Layered splits images into layers; it has no class images to keep")
        return problems

    def image_tokens(self, latents: torch.Tensor) -> int:
        return latents[0, 0, 0].numel() // self.patch_size**2  # the image's alone: (B, C, layers + 1, h, w)

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """The stack's prediction (B, C, 1 + layers, h, w); the condition's is dropped."""
        frames = noisy.unbind(2)
        h, w = noisy.shape[-2:]
        prediction = self.predict_tokens(
            components,
            [*frames, conditioning["image_latents"]],
            timesteps,
            conditioning,
            additional_t_cond=torch.zeros(len(noisy), dtype=torch.long, device=noisy.device),  # RGBA input
        )
        tokens = (h // 2) * (w // 2)
        parts = prediction[:, : tokens * len(frames)].split(tokens, dim=1)
        return torch.stack([unpack(part, h, w) for part in parts], dim=2)


FAMILY = QwenImageLayered()
