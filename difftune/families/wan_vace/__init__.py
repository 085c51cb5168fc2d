"""Wan VACE (`WanVACEPipeline`: Wan 2.1 VACE 1.3B and 14B, Wan 2.2 VACE-Fun A14B's two experts): Wan's transformer
with VACE blocks beside its own (`WanVACETransformer3DModel`), which read control latents and add what they make of
them to the blocks at `vace_layers`. Everything else is Wan's (wan.py): text, files, experts.

- The control latents, exactly as the pipeline's `prepare_video_latents` and `prepare_masks` make them for a clip with
  no control video: the "inactive" and "reactive" clips (video x (1 - mask), video x mask) are both a clip of zeros,
  encoded to its posterior's mode and normalised per channel, and the mask, all ones (every pixel is drawn), folded to
  the latents' size (the autoencoder's spatial factor squared channels). In training the zeros clip is the training
  window's size, encoded with the frozen autoencoder beside the clip (`pixel_conditioning`, cached with it).
- Reference images (VACE's reference-to-video), an edit pair's controls (`max_controls` of them): as in VACE's own
  code and the pipeline, each reference's latents are a frame of their own before the clip's, in the latents being
  denoised and in the control latents (the reference's latents and zeros, the mask 0 there); the pipeline puts each
  further reference before the earlier ones. Training noises the reference frames with the clip's and its loss covers
  them, as the pipeline denoises them with the clip before cutting them off. A reference is cut and flipped with its
  clip at the clip's size; the pipeline fits a sample's reference inside the size asked, centred on white.
- Adapters go on the Wan blocks alone (`blocks.N`, musubi-tuner's and Wan's targets), not the VACE blocks: the file is
  a Wan LoRA that diffusers' and ComfyUI's Wan readers take, and that applies to the Wan base the VACE model was
  built on. `adapter.target_modules` may name the VACE blocks' layers too (`vace_blocks.0.attn1.to_q`); the kohya
  layout names them as the original model does (`vace_blocks.0.self_attn.q`, `before_proj`, `after_proj`).
- Samples: `{prompt = "..."}` draws text-to-video; `{prompt = "...", controls = ["reference.png"]}` draws with
  references. The pipeline draws one clip at a time (its control latents are one clip's), so each prompt is a call.
"""

from __future__ import annotations

import re

import torch
from diffusers import WanVACEPipeline, WanVACETransformer3DModel

from difftune.families.common.drawing import one_call_each
from difftune.families.common.targets import targets_in_blocks
from difftune.families.wan import (
    ORIGINAL_IN_BLOCK,
    TRANSFORMER_TARGETS,
    VACE_FILE_KEY,
    Wan,
    WanConditioning,
    WanDrawing,
    WanLayout,
    WanTargets,
    original_weight_name,
)
from difftune.models.autoencoders import encode_posterior
from difftune.models.components import Components

VACE_BLOCK = re.compile(r"^vace_blocks\.(\d+)\.(.+)$")
VACE_PROJECTIONS = re.compile(r"^(vace_blocks\.\d+\.)proj_(in|out)\.")
# A VACE block's own layers: diffusers' name -> the original model's (diffusers' single-file reader maps them back)
ORIGINAL_IN_VACE_BLOCK = ORIGINAL_IN_BLOCK | {"proj_in": "before_proj", "proj_out": "after_proj"}


def reference_frames(references: list[torch.Tensor]) -> torch.Tensor:
    """An edit pair's reference latents (each (B, C, h, w)) as the frames before a clip's (B, C, R, h, w): the last
    reference first, as the pipeline's `prepare_video_latents` puts them."""
    return torch.stack(list(reversed(references)), dim=2)


def _original_projection(match: re.Match) -> str:
    return f"{match.group(1)}{'before' if match.group(2) == 'in' else 'after'}_proj."


class WanVACELayout(WanLayout):
    denoiser_file_key = VACE_FILE_KEY

    other_models_file_keys = ()

    def original_name(self, module: str) -> str | None:
        if match := VACE_BLOCK.match(module):
            member = ORIGINAL_IN_VACE_BLOCK.get(match.group(2))
            return f"vace_blocks.{match.group(1)}.{member}" if member else None
        return super().original_name(module)

    def to_single_file(self, components: Components) -> dict[str, torch.Tensor]:
        """Wan's original names, a VACE block's input and output layers as the original model's
        (`before_proj`, `after_proj`)."""
        return {
            original_weight_name(VACE_PROJECTIONS.sub(_original_projection, key)): value.contiguous()
            for key, value in components.denoiser.state_dict().items()
        }


class WanVACETargets(WanTargets):
    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        """Wan's targets in the Wan blocks alone (the VACE blocks hold layers of the same names)."""
        return targets_in_blocks(model, {"blocks": TRANSFORMER_TARGETS})


class WanVACEDrawing(WanDrawing):
    def draw_clips(self, pipeline, prompt, controls, height, width, frames, **arguments) -> list[list]:
        """Each prompt's clip in a call of its own, with its generator (the pipeline draws one video a call); the
        controls are every clip's reference images."""
        references = {"reference_images": controls} if controls else {}
        clips = []
        for text, call in one_call_each(prompt, arguments | references):
            clips += super().draw_clips(pipeline, text, [], height, width, frames, **call)
        return clips


class WanVACEConditioning(WanConditioning):
    def pixel_conditioning(self, components: Components, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """A clip of zeros the clip's size (an image's: a one-frame clip) encoded to its posterior's mode, unnormalised
        as the cache keeps posteriors (B, C, t, h, w): the inactive and reactive clips of a sample with no control
        video. One is encoded for the batch: its clips are one size."""
        clip = pixels if pixels.dim() == 5 else pixels[:, :, None]
        zeros = encode_posterior(components.vae, torch.zeros_like(clip[:1]))[0]
        return {"vace_zeros_latents": zeros.expand(len(clip), *zeros.shape[1:])}

    def trained_latents(self, latents: torch.Tensor, conditioning: dict) -> torch.Tensor:
        """The reference frames, the last reference first as the pipeline puts them, then the clip's."""
        references = conditioning.get("control_latents", [])
        if not references:
            return latents
        clip = latents if latents.dim() == 5 else latents[:, :, None]
        return torch.cat([reference_frames(references), clip], dim=2)


class WanVACE(Wan):
    name = "wan_vace"
    layout = WanVACELayout()
    conditioning = WanVACEConditioning()
    drawing = WanVACEDrawing()
    targets = WanVACETargets()
    page_family = "wan"
    description = "Wan VACE"
    pipeline_class = WanVACEPipeline
    pipeline_classes = ("WanVACEPipeline",)
    denoiser_class = WanVACETransformer3DModel
    block_lists = ("blocks", "vace_blocks")
    max_controls = 3  # reference images

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """The control latents beside the noisy ones: a reference frame's (its latents, zeros, the mask 0) for each
        frame before the clip's, then the clip's (the zeros clip's latents twice, the mask 1)."""
        clip = noisy if noisy.dim() == 5 else noisy[:, :, None]
        zeros = components.latent_normalization.apply(conditioning["vace_zeros_latents"].float()).to(clip.dtype)
        mask_channels = components.denoiser.config.vace_in_channels - 2 * clip.shape[1]
        control = torch.cat([zeros, zeros, clip.new_ones(clip.shape[0], mask_channels, *zeros.shape[2:])], dim=1)
        if references := conditioning.get("control_latents"):
            frames = reference_frames(references).to(clip.dtype)
            padding = clip.new_zeros(frames.shape[0], control.shape[1] - frames.shape[1], *frames.shape[2:])
            control = torch.cat([torch.cat([frames, padding], dim=1), control], dim=2)
        prediction = super().denoise(
            components, clip, timesteps, conditioning | {"control_hidden_states": control}, geometry
        )
        return prediction if noisy.dim() == 5 else prediction[:, :, 0]


FAMILY = WanVACE()
