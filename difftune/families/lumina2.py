"""Lumina 2 (Alpha-VLLM's Lumina-Image 2.0, `Lumina2Pipeline`): a single-stream DiT (`Lumina2Transformer2DModel`,
caption and image refiner blocks, then joint blocks) over FLUX.1's 16-channel autoencoder, conditioned on a Gemma 2
language model. Trained by flow matching (flow.py).

- Text, exactly as `Lumina2Pipeline.encode_prompt`: the pipeline's system prompt, " <Prompt Start> " and the caption,
  padded to 256 tokens; Gemma 2's second-to-last hidden states with the padding mask. The transformer reads only the
  caption's valid tokens (it packs them before the image's), so the text cache keeps those alone (exact).
- Time runs the other way: the transformer's t is the clean fraction (1 at the image), and it predicts image minus
  noise. `denoise` turns both round, as the pipeline does (`1 - t / 1000`, `-noise_pred`), so the loss is the shared
  flow-matching one and diffusers' Lumina 2 script's (tested). That script draws its noise levels reflected (the
  scheduler's shifted sigmas used as the clean fraction); difftune draws them as the pipeline samples them.
- Guidance: true classifier-free guidance with the pipeline's own `guidance_scale` (neg + w (pos - neg)) and its
  renormalisation to the conditional prediction's norm (`cfg_normalization`, on by default); the negative prompt is
  read without the system prompt, as the pipeline reads it.
- Files: diffusers' layout (`transformer.`, which `Lumina2Pipeline.load_lora_weights` reads: transformer adapters
  alone) with the script's default targets (attention q, k, v, out); the kohya layout is diffusers' module names
  after `lora_unet_` (the reference trainers' Lumina 2 files), read back by the same table. Single files are not
  read yet.
"""

from __future__ import annotations

import re

import torch
from diffusers import Lumina2Pipeline, Lumina2Transformer2DModel

from difftune.errors import DifftuneError
from difftune.families.flow import FlowMatchingFamily
from difftune.families.qwen_image import padded, trimmed, valid_token_states
from difftune.models import Components

TEXT_TOKENS = 256  # Lumina2Pipeline's default `max_sequence_length`
# The pipeline's `system_prompt` and what joins it to the caption (tests/test_families.py checks them against it).
SYSTEM_PROMPT = ("You are an assistant designed to generate superior images with the superior degree of image-text "
                 "alignment based on textual prompts or user prompts.")
PROMPT_START = " <Prompt Start> "
TRANSFORMER_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]  # diffusers' Lumina 2 script's
BLOCK_LISTS = ("noise_refiner", "context_refiner", "layers")


class Lumina2(FlowMatchingFamily):
    name = "lumina2"
    description = "Lumina 2"
    pipeline_class = Lumina2Pipeline
    pipeline_classes = ("Lumina2Pipeline", "Lumina2Text2ImgPipeline")  # and its earlier name, in folders saved then
    denoiser_class = Lumina2Transformer2DModel
    denoiser_name = "transformer"
    kohya_prefixes = {"transformer": "lora_unet_"}
    kohya_text_model_parts = ()
    kohya_model_version = "lumina2"
    default_targets = {"transformer": TRANSFORMER_TARGETS}

    def adapted_text_encoders(self) -> tuple[str, ...]:
        return ()  # Lumina2Pipeline's LoRA loader reads the transformer's adapters alone

    def fine_tuned_text_encoders(self) -> tuple[str, ...]:
        return self.text_encoder_names  # a full fine-tune's pipeline folder holds the text encoder

    # Prompts and the transformer.

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        ids = tokenizers["tokenizer"]([SYSTEM_PROMPT + PROMPT_START + caption for caption in captions],
                                      padding="max_length", max_length=TEXT_TOKENS, truncation=True, return_tensors="pt")
        return {"text_encoder": ids.input_ids}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = token_ids["text_encoder"]
        mask = ids != components.tokenizers["tokenizer"].pad_token_id
        states = components.text_encoders["text_encoder"](
            ids, attention_mask=mask.long(), output_hidden_states=True
        ).hidden_states[-2]
        return valid_token_states(states, mask, 0, TEXT_TOKENS)

    def cached_conditioning(self, conditioning):
        return trimmed(conditioning)

    def uncached_conditioning(self, stored):
        return padded(stored, TEXT_TOKENS)

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_channels  # the transformer patches the latents itself

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        states = conditioning["encoder_hidden_states"]
        prediction = components.denoiser(
            hidden_states=noisy.to(states.dtype), timestep=((1000 - timesteps) / 1000).to(states.dtype),
            encoder_hidden_states=states, encoder_attention_mask=conditioning["text_mask"].bool(), return_dict=False,
        )[0]
        return -prediction

    def monitored_blocks(self, denoiser: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """The refiners' blocks and the joint ones, in the order the transformer runs them."""
        blocks = {}
        for blocks_name in BLOCK_LISTS:
            blocks |= {match.group(1): module for name, module in denoiser.named_modules()
                       if (match := re.search(rf"(?:^|\.)({blocks_name}\.\d+)$", name))}
        return blocks

    # Sampling.

    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """The pipeline's `guidance_scale` is neg + w (pos - neg) already; at 1 or less, one pass without it."""
        return {"max_sequence_length": TEXT_TOKENS, "guidance_scale": max(guidance_scale, 1.0),
                "negative_prompt": negative_prompt or None}

    def max_sequence_length(self, components: Components) -> int:
        return TEXT_TOKENS

    # Files.

    def to_single_file(self, components: Components) -> dict[str, torch.Tensor]:
        raise DifftuneError("merge --single-file: not written for Lumina 2 yet (diffusers' reader of its files assumes "
                            "Lumina-Image 2.0's widths); the merged diffusers folder loads in diffusers")
