"""Chroma (lodestones' Chroma1, `ChromaPipeline`): FLUX.1-schnell's transformer pruned of its per-block modulation
(one small "distilled guidance" network makes every block's modulation from the time) and conditioned on T5 alone.
Everything else is Flux.1's (flux.py): the 16-channel autoencoder, 2x2-packed latents, the objective, and the
kohya / ComfyUI layout of the original (BFL-style) module names with fused q, k, v.

- Text: T5 reads each caption with its padding mask (Flux.1's pipeline reads it unmasked), exactly as
  `ChromaPipeline.encode_prompt`; there is no CLIP and no pooled embedding.
- The transformer attends to the caption's tokens and the first padding token, never the rest: the mask Chroma
  was trained with and its pipeline samples with.
- No guidance embedding: samples use true classifier-free guidance (the pipeline's `guidance_scale`, above 1).
- Only the transformer is adapted: the pipeline's LoRA loader (Flux's) would put `text_encoder` adapters into T5,
  which Chroma's trainers leave frozen.
- Single files (`Chroma1-HD.safetensors`, the transformer alone): Flux.1's original layout without the blocks'
  modulation, plus the approximator under its own names (`distilled_guidance_layer.layers.0.in_layer`).
"""

from __future__ import annotations

import torch
from diffusers import ChromaPipeline, ChromaTransformer2DModel

from difftune.families.common.flow import FlowDrawing
from difftune.families.common.loading import FamilyOptions
from difftune.families.common.tokens import pack, unpack
from difftune.families.flux import (
    ORIGINAL_GLOBALS,
    TRANSFORMER_TARGETS,
    Flux,
    FluxConditioning,
    FluxLayout,
    FluxTargets,
    image_position_ids,
)
from difftune.models.components import Components

APPROXIMATOR = "distilled_guidance_layer."  # the network that makes every block's modulation from the time
APPROXIMATOR_LAYERS = ((".linear_1.", ".in_layer."), (".linear_2.", ".out_layer."))  # diffusers' -> the original's


def approximator_key(key: str, to_original: bool) -> str:
    """An approximator weight's name in the other layout: its layers' `linear_1` are `in_layer`, its norms' `weight`
    a `scale` (`in_proj` and `out_proj` keep their names)."""
    for diffusers_name, original in APPROXIMATOR_LAYERS:
        key = key.replace(*((diffusers_name, original) if to_original else (original, diffusers_name)))
    if ".norms." in key:
        key = f"{key.rsplit('.', 1)[0]}.{'scale' if to_original else 'weight'}"
    return key


class ChromaLayout(FluxLayout):
    """Chroma's files in other tools' layouts."""

    denoiser_file_key = "distilled_guidance_layer.layers.0.in_layer.weight"  # the original layout's name alone

    original_globals = {
        module: original
        for module, original in ORIGINAL_GLOBALS.items()
        if not module.startswith(("time_text_embed.", "norm_out."))
    }

    swapped_halves = ()

    kohya_prefixes = {"transformer": "lora_unet_"}

    kohya_text_model_parts = ()

    kohya_model_version = "chroma"

    kohya_layout_name = "Chroma"

    embedding_keys = ("t5",)

    def original_state_dict(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        approximator = {key: value for key, value in weights.items() if key.startswith(APPROXIMATOR)}
        rest = super().original_state_dict({key: value for key, value in weights.items() if key not in approximator})
        return rest | {
            approximator_key(key, to_original=True): value.contiguous() for key, value in approximator.items()
        }

    def diffusers_state_dict(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        approximator = {key: value for key, value in weights.items() if key.startswith(APPROXIMATOR)}
        rest = super().diffusers_state_dict({key: value for key, value in weights.items() if key not in approximator})
        return rest | {approximator_key(key, to_original=False): value for key, value in approximator.items()}


class ChromaTargets(FluxTargets):
    default_targets = {"transformer": TRANSFORMER_TARGETS}
    lora_text_encoders = ()  # ChromaPipeline's LoRA loader reads the transformer's adapters alone


class ChromaDrawing(FlowDrawing):
    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """True classifier-free guidance above 1, in the pipeline's own `guidance_scale` (neg + w (pos - neg))."""
        return {
            "max_sequence_length": self.family.max_sequence_length(components),
            "guidance_scale": guidance_scale,
            "negative_prompt": negative_prompt or None,
        }


class ChromaConditioning(FluxConditioning):
    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = token_ids["text_encoder"]
        mask = ids != components.tokenizers["tokenizer"].pad_token_id
        states = components.text_encoders["text_encoder"](ids, output_hidden_states=False, attention_mask=mask.long())[
            0
        ]
        return {"encoder_hidden_states": states, "text_mask": mask}


class Chroma(Flux):
    name = "chroma"
    layout = ChromaLayout()
    conditioning = ChromaConditioning()
    drawing = ChromaDrawing()
    targets = ChromaTargets()
    description = "Chroma"
    options_model = FamilyOptions  # no guidance embedding, and the padding mask is Chroma's own
    pipeline_class = ChromaPipeline
    controlnet = None  # diffusers' Flux ControlNets are Flux.1 [dev]'s; none reads Chroma's transformer
    input_control = None  # FluxControlPipeline draws Flux.1 [dev]'s widened transformer alone
    pipeline_classes = ("ChromaPipeline",)
    denoiser_class = ChromaTransformer2DModel
    text_encoder_names = ("text_encoder",)
    tokenizer_names = ("tokenizer",)

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        states = conditioning["encoder_hidden_states"]
        b, _, h, w = noisy.shape
        lengths = conditioning["text_mask"].bool().sum(dim=1, keepdim=True)
        # The caption's tokens and the first padding token, then every image token (ChromaPipeline's mask).
        text_keep = torch.arange(states.shape[1], device=noisy.device)[None] <= lengths
        keep = torch.cat([text_keep, torch.ones(b, (h // 2) * (w // 2), dtype=torch.bool, device=noisy.device)], dim=1)
        prediction = components.denoiser(
            hidden_states=pack(noisy).to(states.dtype),
            timestep=(timesteps / 1000).to(states.dtype),
            encoder_hidden_states=states,
            txt_ids=torch.zeros(states.shape[1], 3, device=noisy.device, dtype=states.dtype),
            img_ids=image_position_ids(h, w, noisy.device, states.dtype),
            attention_mask=keep.to(states.dtype),
            return_dict=False,
        )[0]
        return unpack(prediction, h, w)

    def max_sequence_length(self, components: Components) -> int:
        return components.tokenizers["tokenizer"].model_max_length


FAMILY = Chroma()
