"""Stable Diffusion 1.x / 2.x: a UNet conditioned on one CLIP text encoder's last hidden state."""

from __future__ import annotations

import torch
from diffusers import StableDiffusionPipeline

from difftune import single_file
from difftune.families.family import Family
from difftune.models import Components

ATTENTION_PROJECTIONS = ["to_q", "to_k", "to_v", "to_out.0"]
CLIP_ATTENTION = ["q_proj", "k_proj", "v_proj", "out_proj"]


class StableDiffusion(Family):
    name = "sd"
    description = "Stable Diffusion 1.x / 2.x"
    pipeline_class = StableDiffusionPipeline
    pipeline_classes = ("StableDiffusionPipeline",)
    kohya_prefixes = {"unet": "lora_unet_", "text_encoder": "lora_te_"}
    kohya_model_version = "sd_v1"
    default_targets = {"unet": ATTENTION_PROJECTIONS, "text_encoder": CLIP_ATTENTION}
    fixed_pipeline_arguments = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}

    def reads_single_file(self, keys: set[str]) -> bool:
        has_unet = any(key.startswith(single_file.UNET_PREFIX) for key in keys)
        return has_unet and not any(key.startswith(single_file.SDXL_CONDITIONER_PREFIX) for key in keys)

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # CLIP's last hidden state (B, L, D), as SD 1.x uses it.
        return {"encoder_hidden_states": components.text_encoders["text_encoder"](token_ids["text_encoder"], return_dict=False)[0]}

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        return components.denoiser(noisy, timesteps, conditioning["encoder_hidden_states"], return_dict=False)[0]

    def to_single_file(self, components: Components) -> dict[str, torch.Tensor]:
        return {
            **single_file.unet_to_ldm(components.denoiser),
            **single_file.vae_to_ldm(components.vae),
            **single_file.clip_to_ldm(components.text_encoders["text_encoder"], single_file.TEXT_ENCODER_PREFIX),
        }
