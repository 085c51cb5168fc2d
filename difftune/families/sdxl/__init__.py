"""Stable Diffusion XL (and models built on it: Pony, Illustrious, ...): a UNet conditioned on two CLIP text
encoders and on each image's size and crop.

- Text: both encoders' penultimate hidden states, concatenated along the features (B, L, D1 + D2), and the
  second encoder's projected pooled output (B, P), as `StableDiffusionXLPipeline.encode_prompt` makes them.
- Micro-conditioning ("time ids", Podell et al. 2023 sec. 2.2): per sample, the original image size before
  resizing, the crop's top-left corner in resized pixels and the target size, each (height, width). What
  each sample's values are under buckets, crops and flips is `data.image_geometry`'s job (kohya's rules).
"""

from __future__ import annotations

import torch
from diffusers import StableDiffusionXLControlNetPipeline, StableDiffusionXLPipeline

from difftune.families.common.conditioning import Conditioning
from difftune.families.common.control import UNetControlNet
from difftune.families.common.family import Family
from difftune.families.common.layouts import Layout
from difftune.families.common.targets import AdapterTargets
from difftune.families.sd import ATTENTION_PROJECTIONS, CLIP_ATTENTION
from difftune.memory.transfer import to_device
from difftune.models import single_file
from difftune.models.components import Components

# diffusers' own marker of the second (OpenCLIP) encoder in SDXL single files.
OPEN_CLIP_KEY = f"{single_file.SDXL_TEXT_ENCODER_2_PREFIX}positional_embedding"


class StableDiffusionXLLayout(Layout):
    """StableDiffusionXL's files in other tools' layouts."""

    single_file_layout = "whole checkpoint (SGM layout)"
    input_file_key = "input_blocks.0.0.weight"

    kohya_prefixes = {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}

    kohya_text_model_parts = ("text_encoder", "text_encoder_2")

    kohya_model_version = "sdxl_base_v1-0"

    embedding_keys = ("clip_l", "clip_g")

    def reads_single_file(self, keys: set[str]) -> bool:
        return OPEN_CLIP_KEY in keys

    def to_single_file(self, components: Components) -> dict[str, torch.Tensor]:
        return {
            **single_file.unet_to_ldm(components.denoiser),
            **single_file.vae_to_ldm(components.vae),
            **single_file.clip_to_ldm(components.text_encoders["text_encoder"], single_file.SDXL_TEXT_ENCODER_PREFIX),
            **single_file.open_clip_to_ldm(
                components.text_encoders["text_encoder_2"], single_file.SDXL_TEXT_ENCODER_2_PREFIX
            ),
        }


class StableDiffusionXLTargets(AdapterTargets):
    trains_embeddings = True
    default_targets = {"unet": ATTENTION_PROJECTIONS, "text_encoder": CLIP_ATTENTION, "text_encoder_2": CLIP_ATTENTION}


class StableDiffusionXLConditioning(Conditioning):
    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        states = []
        for name in self.family.text_encoder_names:
            output = components.text_encoders[name](token_ids[name], output_hidden_states=True)
            states.append(output.hidden_states[-2])
        # `output` is the second encoder's: its text_embeds are the pooled conditioning.
        return {"encoder_hidden_states": torch.cat(states, dim=-1), "pooled_prompt_embeds": output.text_embeds}


class StableDiffusionXL(Family):
    name = "sdxl"
    layout = StableDiffusionXLLayout()
    conditioning = StableDiffusionXLConditioning()
    targets = StableDiffusionXLTargets()
    description = "Stable Diffusion XL"
    pipeline_class = StableDiffusionXLPipeline
    pipeline_classes = ("StableDiffusionXLPipeline",)
    text_encoder_names = ("text_encoder", "text_encoder_2")
    tokenizer_names = ("tokenizer", "tokenizer_2")
    # Whether an empty negative prompt is zeros (SDXL base) or the encoded "" (a model trained with
    # empty-caption dropout, like the tiny base): a reassembled pipeline must keep what the model says.
    pipeline_options = ("force_zeros_for_empty_prompt",)
    fixed_pipeline_arguments = {"add_watermarker": False}  # the watermark is for published images, not samples
    controlnet = UNetControlNet(StableDiffusionXLControlNetPipeline)
    file_inputs = (4,)

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        states = conditioning["encoder_hidden_states"]
        added = {
            "text_embeds": conditioning["pooled_prompt_embeds"],
            "time_ids": to_device(geometry, states.device, states.dtype),
        }
        control = self.control_residuals(
            components, conditioning, noisy, timesteps, encoder_hidden_states=states, added_cond_kwargs=added
        )
        return components.denoiser(noisy, timesteps, states, added_cond_kwargs=added, **control, return_dict=False)[0]


FAMILY = StableDiffusionXL()
