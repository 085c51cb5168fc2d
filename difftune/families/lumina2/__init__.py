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
  alone) with the script's default targets (attention q, k, v, out); the kohya layout is the one ComfyUI maps, the
  original names with q, k and v fused (`lora_unet_layers_0_attention_qkv`), and files naming diffusers' modules
  after `lora_unet_` (the reference trainers') are read too. A single file is the transformer alone in the original
  layout (`ORIGINAL_NAMES`).
"""

from __future__ import annotations

import re

import torch
from diffusers import Lumina2Pipeline, Lumina2Transformer2DModel

from difftune.families.common.conditioning import Conditioning, valid_token_states
from difftune.families.common.flow import FlowDrawing, FlowMatchingFamily
from difftune.families.common.layouts import FusedLayout
from difftune.families.common.loading import Loading
from difftune.families.common.targets import AdapterTargets
from difftune.families.z_image import BLOCK_LISTS, fused_qkv, lumina_kohya_blocks
from difftune.models.components import Components

TEXT_TOKENS = 256  # Lumina2Pipeline's default `max_sequence_length`
# The pipeline's `system_prompt` and what joins it to the caption (tests/test_families.py checks them against it).
SYSTEM_PROMPT = (
    "You are an assistant designed to generate superior images with the superior degree of image-text "
    "alignment based on textual prompts or user prompts."
)
PROMPT_START = " <Prompt Start> "
TRANSFORMER_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]  # diffusers' Lumina 2 script's
# Single files: diffusers' weight names <-> the original model's (Alpha-VLLM's and ComfyUI's), the first rule that
# matches; `{i}` and `{n}` are numbers, `{blocks}` a block list. q, k and v are one `attention.qkv` there. A caption
# refiner's norms are plain, a modulated block's first norm sits beside its modulation.
ORIGINAL_NAMES = [
    ("time_caption_embed.caption_embedder.", "cap_embedder."),
    ("time_caption_embed.timestep_embedder.linear_1.", "t_embedder.mlp.0."),
    ("time_caption_embed.timestep_embedder.linear_2.", "t_embedder.mlp.2."),
    ("norm_out.linear_1.", "final_layer.adaLN_modulation.1."),
    ("norm_out.linear_2.", "final_layer.linear."),
    ("context_refiner.{i}.norm1.", "context_refiner.{i}.attention_norm1."),
    ("context_refiner.{i}.norm2.", "context_refiner.{i}.attention_norm2."),
    ("{blocks}.{i}.norm1.norm.", "{blocks}.{i}.attention_norm1."),
    ("{blocks}.{i}.norm2.", "{blocks}.{i}.attention_norm2."),
    ("{blocks}.{i}.norm1.linear.", "{blocks}.{i}.adaLN_modulation.1."),
    ("{blocks}.{i}.attn.to_out.0.", "{blocks}.{i}.attention.out."),
    ("{blocks}.{i}.attn.norm_q.", "{blocks}.{i}.attention.q_norm."),
    ("{blocks}.{i}.attn.norm_k.", "{blocks}.{i}.attention.k_norm."),
    ("{blocks}.{i}.feed_forward.linear_{n}.", "{blocks}.{i}.feed_forward.w{n}."),
    ("{blocks}.{i}.attn.qkv.", "{blocks}.{i}.attention.qkv."),
]


def _pattern(template: str) -> re.Pattern:
    """A name template as a regular expression of its start: `{blocks}` a word, any other `{x}` a number."""
    escaped = re.escape(template).replace(r"\{blocks\}", r"(?P<blocks>\w+)")
    return re.compile("^" + re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>\\d+)", escaped))


def renamed(key: str, to_original: bool) -> str:
    """`key` in the other layout, by the first `ORIGINAL_NAMES` rule whose side it matches (else as it is)."""
    for diffusers_name, original in ORIGINAL_NAMES:
        source, target = (diffusers_name, original) if to_original else (original, diffusers_name)
        if match := _pattern(source).match(key):
            return target.format(**match.groupdict()) + key[match.end() :]
    return key


class Lumina2Layout(FusedLayout):
    """Lumina2's files in other tools' layouts."""

    single_file_layout = "transformer alone (original layout)"

    denoiser_file_key = "cap_embedder.1.weight"  # what diffusers' reader detects Lumina 2 files by

    kohya_prefixes = {"transformer": "lora_unet_"}

    kohya_text_model_parts = ()

    kohya_model_version = "lumina2"

    kohya_layout_name = "Lumina 2"

    kohya_blocks = lumina_kohya_blocks(BLOCK_LISTS, "attn", {f"w{n}": f"feed_forward.linear_{n}" for n in (1, 2, 3)})

    def fused_row_sizes(self, modules: list[str], rows: int, columns: int) -> list[int]:
        """q is as wide as the block (the layer's input); k and v share the rest (grouped-query heads)."""
        if len(modules) == 1:
            return [rows]
        return [columns, (rows - columns) // 2, (rows - columns) // 2]

    def to_single_file(self, components: Components) -> dict[str, torch.Tensor]:
        out = {
            renamed(key, to_original=True): value.contiguous()
            for key, value in fused_qkv(components.denoiser.state_dict(), "attn").items()
        }
        # The original model holds a final norm it never applies (diffusers' reader drops it): at its initial value,
        # for readers that expect every original key.
        out["norm_final.weight"] = torch.ones(components.denoiser.config.hidden_size)
        return out

    def diffusers_names(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        weights, out = dict(weights), {}
        if self.denoiser_file_key not in weights:  # diffusers' names
            return weights
        weights.pop("norm_final.weight", None)  # the original model holds it and never applies it
        for key, value in weights.items():
            key = renamed(key, to_original=False)
            if key.endswith(".attn.qkv.weight"):  # q is as wide as the block, k and v share the rest
                q_rows = value.shape[1]
                parts = value.split([q_rows, (len(value) - q_rows) // 2, (len(value) - q_rows) // 2])
                out |= {key.replace(".qkv.", f".to_{p}."): part for p, part in zip("qkv", parts, strict=True)}
            else:
                out[key] = value
        return out


class Lumina2Targets(AdapterTargets):
    default_targets = {"transformer": TRANSFORMER_TARGETS}
    lora_text_encoders = ()  # Lumina2Pipeline's LoRA loader reads the transformer's adapters alone


class Lumina2Loading(Loading):
    # Single files: the transformer alone in the original layout (Alpha-VLLM's `consolidated.00-of-01.pth` saved as
    # safetensors, ComfyUI's `lumina_2_model_bf16.safetensors`); the other parts come from `model.single_file_config`.
    # Read and written from one table at any width (diffusers' reader assumes Lumina-Image 2.0's: 2304, 768).
    single_file_pipeline = Loading.pipeline_around_denoiser_file


class Lumina2Drawing(FlowDrawing):
    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """The pipeline's `guidance_scale` is neg + w (pos - neg) already; at 1 or less, one pass without it."""
        return {
            "max_sequence_length": TEXT_TOKENS,
            "guidance_scale": max(guidance_scale, 1.0),
            "negative_prompt": negative_prompt or None,
        }


class Lumina2Conditioning(Conditioning):
    padded_text_tokens = TEXT_TOKENS

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        ids = tokenizers["tokenizer"](
            [SYSTEM_PROMPT + PROMPT_START + caption for caption in captions],
            padding="max_length",
            max_length=TEXT_TOKENS,
            truncation=True,
            return_tensors="pt",
        )
        return {"text_encoder": ids.input_ids}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = token_ids["text_encoder"]
        mask = ids != components.tokenizers["tokenizer"].pad_token_id
        states = components.text_encoders["text_encoder"](
            ids, attention_mask=mask.long(), output_hidden_states=True
        ).hidden_states[-2]
        return valid_token_states(states, mask, 0, TEXT_TOKENS)


class Lumina2(FlowMatchingFamily):
    name = "lumina2"
    layout = Lumina2Layout()
    loading = Lumina2Loading()
    conditioning = Lumina2Conditioning()
    drawing = Lumina2Drawing()
    targets = Lumina2Targets()
    description = "Lumina 2"
    pipeline_class = Lumina2Pipeline
    pipeline_classes = ("Lumina2Pipeline", "Lumina2Text2ImgPipeline")  # and its earlier name, in folders saved then
    denoiser_class = Lumina2Transformer2DModel
    denoiser_name = "transformer"
    block_lists = BLOCK_LISTS

    # Prompts and the transformer.

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_channels  # the transformer patches the latents itself

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        states = conditioning["encoder_hidden_states"]
        prediction = components.denoiser(
            hidden_states=noisy.to(states.dtype),
            timestep=((1000 - timesteps) / 1000).to(states.dtype),
            encoder_hidden_states=states,
            encoder_attention_mask=conditioning["text_mask"].bool(),
            return_dict=False,
        )[0]
        return -prediction

    # Sampling.

    def max_sequence_length(self, components: Components) -> int:
        return TEXT_TOKENS


FAMILY = Lumina2()
