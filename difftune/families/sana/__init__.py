"""Sana and Sana 1.5 (NVIDIA's, `SanaPipeline`): a linear-attention DiT (`SanaTransformer2DModel`: self-attention in
linear form, cross-attention to the text, a convolutional GLU feed-forward) over the deep-compression autoencoder
(`AutoencoderDC`: 32 channels at 32x, autoencoders.py), conditioned on Gemma 2 (`Gemma2Model`). Trained by flow
matching (flow.py).

- Text, exactly as `SanaPipeline.encode_prompt`: the caption lowercased and stripped (the pipeline's cleaning with
  `clean_caption` off), after the pipeline's complex human instruction (its default `complex_human_instruction`,
  which NVlabs' own training configs read too as `chi_prompt`), padded on the right to the instruction's tokens plus
  `TEXT_TOKENS` - 2; Gemma 2's last states, of which the transformer reads the first and the last `TEXT_TOKENS` - 1
  (the pipeline's `select_index`), with their mask. The kept positions hold the caption's tokens first, then padding,
  so the text cache keeps those alone (exact: the transformer's cross-attention masks the padding). diffusers' Sana
  script reads captions without the instruction unless told (`--complex_human_instruction`); difftune trains them as
  the pipeline draws them.
- Time: the transformer reads the timestep times its `timestep_scale` (1 for Sana and Sana 1.5), and predicts the
  flow velocity (noise minus image), as the pipeline's DPM-Solver reads it (`flow_prediction`). Noise levels: the
  pipeline's sampler shifts every size by one `flow_shift` (3 for the 512 to 2K px bases, 6 for 4K), which training
  draws with (`loss.flow_shift_by_resolution`) through an Euler flow scheduler of that shift, which also samples.
- Guidance: classifier-free, with the pipeline's `guidance_scale` and negative prompt (read without the instruction,
  as the pipeline reads it). Samples are drawn at the size asked (`use_resolution_binning` off: the pipeline would
  otherwise draw at its nearest 1024 px bucket and resize).
- Files: diffusers' layout (`transformer.`, which `SanaPipeline.load_lora_weights` reads: transformer adapters alone)
  with both attentions' q, k, v and output layers (diffusers' Sana script adapts q, k and v); the kohya layout names
  diffusers' modules after `lora_unet_` (ComfyUI has no Sana model to map them to). No single-file layout: NVlabs'
  checkpoints are read by diffusers' converter, not written.
- Not trained: Sana Sprint (`SanaSprintPipeline`, a consistency-distilled few-step model sampled by `SCMScheduler`),
  refused by its pipeline class.
"""

from __future__ import annotations

import inspect
from functools import cache

import torch
from diffusers import SanaPipeline, SanaTransformer2DModel

from difftune.families.common.conditioning import Conditioning, valid_token_states
from difftune.families.common.flow import FlowDrawing, FlowMatchingFamily, SamplerShiftFlowMatching
from difftune.families.common.layouts import KOHYA_DENOISER_PREFIX, Layout
from difftune.families.common.loading import FamilyOptions
from difftune.families.common.targets import AdapterTargets
from difftune.models.components import Components

TEXT_TOKENS = 300  # the pipeline's default `max_sequence_length`: the text positions the transformer reads
ATTENTION_TARGETS = [f"{attention}.{layer}" for attention in ("attn1", "attn2") for layer in ("to_q", "to_k", "to_v")]
TRANSFORMER_TARGETS = ATTENTION_TARGETS + ["attn1.to_out.0", "attn2.to_out.0"]


def instruction_lines(pipeline_class: type) -> list[str]:
    """A Sana pipeline's default complex human instruction (Sana's and Sana-Video's differ), read from its own
    signature."""
    return inspect.signature(pipeline_class.__call__).parameters["complex_human_instruction"].default


@cache
def pipeline_instruction(pipeline_class: type) -> str:
    """The instruction as the pipeline puts it before a caption: its lines joined."""
    return "\n".join(instruction_lines(pipeline_class))


class SanaLayout(Layout):
    """Sana's files in other tools' layouts."""

    kohya_prefixes = {"transformer": KOHYA_DENOISER_PREFIX}

    kohya_text_model_parts = ()

    kohya_model_version = "sana"


class SanaTargets(AdapterTargets):
    default_targets = {"transformer": TRANSFORMER_TARGETS}
    lora_text_encoders = ()  # SanaPipeline's LoRA loader reads the transformer's adapters alone


class SanaDrawing(FlowDrawing):
    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """Classifier-free guidance above a scale of 1 (the pipeline's own), drawn at the size asked."""
        return {
            "guidance_scale": guidance_scale,
            "negative_prompt": negative_prompt,
            "max_sequence_length": TEXT_TOKENS,
            "use_resolution_binning": False,
        }


class SanaConditioning(Conditioning):
    padded_text_tokens = TEXT_TOKENS

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        """Each caption, cleaned as the pipeline cleans it, after the instruction, right-padded to the instruction's
        tokens plus `TEXT_TOKENS` - 2."""
        tokenizer, instruction = tokenizers["tokenizer"], pipeline_instruction(self.family.pipeline_class)
        length = len(tokenizer(instruction)["input_ids"]) + TEXT_TOKENS - 2  # as the pipeline counts (`encode`)
        ids = tokenizer(
            [instruction + caption.lower().strip() for caption in captions],
            padding="max_length",
            padding_side="right",
            max_length=length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        ).input_ids
        return {"text_encoder": ids}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Gemma 2's last states at the first position and the last `TEXT_TOKENS` - 1, the caption's tokens kept."""
        ids = token_ids["text_encoder"]
        mask = ids != components.tokenizers["tokenizer"].pad_token_id
        states = components.text_encoders["text_encoder"](ids, attention_mask=mask.long())[0]
        read = [0, *range(ids.shape[1] - TEXT_TOKENS + 1, ids.shape[1])]
        return valid_token_states(states[:, read], mask[:, read], 0, TEXT_TOKENS)


class Sana(FlowMatchingFamily):
    name = "sana"
    layout = SanaLayout()
    conditioning = SanaConditioning()
    drawing = SanaDrawing()
    targets = SanaTargets()
    objective = SamplerShiftFlowMatching()
    description = "Sana"
    pipeline_class = SanaPipeline
    pipeline_classes = ("SanaPipeline",)
    denoiser_class = SanaTransformer2DModel
    denoiser_name = "transformer"
    patch_size = 1  # a token is one latent pixel
    block_lists = ("transformer_blocks",)
    options_model = FamilyOptions  # no guidance embedding: classifier-free guidance

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        states = conditioning["encoder_hidden_states"]
        denoiser = components.denoiser
        return denoiser(
            hidden_states=noisy.to(states.dtype),
            encoder_hidden_states=states,
            encoder_attention_mask=conditioning["text_mask"],
            timestep=timesteps.float() * denoiser.config.get("timestep_scale", 1.0),  # Sana-Video's has none
            return_dict=False,
        )[0]


FAMILY = Sana()
