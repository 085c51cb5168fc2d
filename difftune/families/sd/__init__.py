"""Stable Diffusion 1.x / 2.x: a UNet conditioned on one CLIP text encoder's last hidden state."""

from __future__ import annotations

import torch
from diffusers import DDPMScheduler, StableDiffusionControlNetPipeline, StableDiffusionPipeline, UNet2DConditionModel
from safetensors import safe_open

from difftune.config import ModelConfig
from difftune.families.common.conditioning import Conditioning
from difftune.families.common.control import UNetControlNet
from difftune.families.common.family import Family
from difftune.families.common.layouts import Layout
from difftune.families.common.targets import AdapterTargets
from difftune.models import single_file
from difftune.models.components import SINGLE_FILE_SUFFIXES, Components

ATTENTION_PROJECTIONS = ["to_q", "to_k", "to_v", "to_out.0"]
CLIP_ATTENTION = ["q_proj", "k_proj", "v_proj", "out_proj"]


class StableDiffusionLayout(Layout):
    """StableDiffusion's files in other tools' layouts."""

    single_file_layout = "whole checkpoint (LDM layout)"
    input_file_key = "input_blocks.0.0.weight"

    kohya_prefixes = {"unet": "lora_unet_", "text_encoder": "lora_te_"}

    def base_model_version(self, model: ModelConfig | None) -> str | None:
        """`sd_v1` or `sd_v2` by the width of the text states the UNet reads (SD 2.x's OpenCLIP-H: 1024; diffusers'
        single-file reader and ComfyUI tell 2.x apart the same way), `_v` added for a v-prediction schedule, as
        kohya's scripts write it. A single file carries no schedule: its version has no `_v` (kohya's default too).
        None where the base cannot be read."""
        try:
            if model.base.endswith(SINGLE_FILE_SUFFIXES):
                with safe_open(model.base, framework="pt") as handle:
                    key = next(
                        key
                        for key in handle.keys()
                        if key.startswith(single_file.UNET_PREFIX) and key.endswith("attn2.to_k.weight")
                    )
                    width, prediction = handle.get_slice(key).get_shape()[-1], "epsilon"
            else:
                revision = model.revision or None
                unet = UNet2DConditionModel.load_config(model.base, subfolder="unet", revision=revision)
                width = unet["cross_attention_dim"]
                scheduler = DDPMScheduler.load_config(model.base, subfolder="scheduler", revision=revision)
                prediction = scheduler.get("prediction_type", "epsilon")
        except Exception:  # noqa: BLE001 - no base (None), a hub id offline, a pickle or a file without a UNet: unknown
            return None
        return ("sd_v2" if width == 1024 else "sd_v1") + ("_v" if prediction == "v_prediction" else "")

    def reads_single_file(self, keys: set[str]) -> bool:
        # A UNet's input blocks, under the LDM prefix that ComfyUI's transformer files share
        has_unet = any(key.startswith(single_file.UNET_PREFIX + "input_blocks.") for key in keys)
        return has_unet and not any(key.startswith(single_file.SDXL_CONDITIONER_PREFIX) for key in keys)

    def to_single_file(self, components: Components) -> dict[str, torch.Tensor]:
        return {
            **single_file.unet_to_ldm(components.denoiser),
            **single_file.vae_to_ldm(components.vae),
            **single_file.clip_to_ldm(components.text_encoders["text_encoder"], single_file.TEXT_ENCODER_PREFIX),
        }


class StableDiffusionTargets(AdapterTargets):
    trains_embeddings = True
    default_targets = {"unet": ATTENTION_PROJECTIONS, "text_encoder": CLIP_ATTENTION}


class StableDiffusionConditioning(Conditioning):
    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # CLIP's last hidden state (B, L, D), as SD 1.x uses it.
        return {
            "encoder_hidden_states": components.text_encoders["text_encoder"](
                token_ids["text_encoder"], return_dict=False
            )[0]
        }


class StableDiffusion(Family):
    name = "sd"
    layout = StableDiffusionLayout()
    conditioning = StableDiffusionConditioning()
    targets = StableDiffusionTargets()
    description = "Stable Diffusion 1.x / 2.x"
    pipeline_class = StableDiffusionPipeline
    pipeline_classes = ("StableDiffusionPipeline",)
    fixed_pipeline_arguments = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
    controlnet = UNetControlNet(StableDiffusionControlNetPipeline)
    file_inputs = (4,)

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        states = conditioning["encoder_hidden_states"]
        control = self.control_residuals(components, conditioning, noisy, timesteps, encoder_hidden_states=states)
        return components.denoiser(noisy, timesteps, states, **control, return_dict=False)[0]


FAMILY = StableDiffusion()
