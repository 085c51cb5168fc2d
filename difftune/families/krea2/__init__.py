"""Krea 2 (`Krea2Pipeline`): a single-stream MMDiT (`Krea2Transformer2DModel`) over 2x2-packed latents of Qwen-Image's
(Wan's) autoencoder, conditioned on a stack of a Qwen3-VL language model's hidden states that the transformer fuses
itself (`text_fusion`). Trained by flow matching (flow.py).

- Text, exactly as `Krea2Pipeline.encode_prompt`: each caption after Qwen-Image's system prompt, padded to a fixed
  length, then the assistant suffix after the padding (`[prefix | caption | PAD | suffix]`, how Krea 2 was trained);
  positions count real tokens only (the suffix follows the caption without a gap); the states of the layers the
  pipeline names (`text_encoder_select_layers`) are stacked per token, (B, L, layers, D), the system prompt's
  `TEMPLATE_TOKENS` dropped, with the mask of real tokens. The cache keeps the real tokens alone and puts the
  padding back where it was.
- Latents (B, 16, h, w), Qwen-Image's per-channel normalisation (autoencoders.py), packed 2x2 (flow.py); the text
  sits at the rotary origin and the image at its grid (`prepare_position_ids`).
- Noise levels: `loss.flow_shift_by_resolution` draws them with the shift the pipeline samples this size with: its
  own resolution rule (up to 6400 tokens), or the fixed mu 1.15 of the few-step distilled checkpoint (`is_distilled`).
- Guidance: the pipeline's is pos + s (pos - neg); `sample.guidance_scale` keeps difftune's meaning (flow.py's
  `anchored_guidance`).
- Files: diffusers' layout (`transformer.`, which `Krea2Pipeline.load_lora_weights` reads: transformer adapters
  alone); the kohya layout names the original model's modules (`lora_unet_blocks_0_attn_wq`), which ComfyUI maps
  for any model from its own weight names; diffusers' reader of the original layout is the reference for those
  names (`ORIGINAL_NAMES`, tested against it). A single file is the transformer alone in the original layout (the
  authors' and ComfyUI's), read through diffusers' converter and written as its inverse (`ORIGINAL_WEIGHT_NAMES`).
"""

from __future__ import annotations

import math
import re

import torch
from diffusers import Krea2Pipeline, Krea2Transformer2DModel
from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers
from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift

from difftune.families.common.conditioning import Conditioning
from difftune.families.common.flow import FlowDrawing, FlowMatching, FlowMatchingFamily, anchored_guidance
from difftune.families.common.layouts import RenamedLayout
from difftune.families.common.loading import Loading
from difftune.families.common.targets import AdapterTargets
from difftune.families.common.tokens import pack, unpack
from difftune.models.components import Components

# Krea2Pipeline's prompt layout (`prompt_template_encode_prefix` / `_suffix`, `_start_idx`, `_num_suffix_tokens`;
# tests/test_families.py checks them against it).
PROMPT_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
PROMPT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
TEMPLATE_TOKENS = 34
SUFFIX_TOKENS = 5
TEXT_TOKENS = 512  # the pipeline's default `max_sequence_length`: every caption is padded to it
DISTILLED_MU = 1.15  # the pipeline's fixed shift for the few-step distilled checkpoint
# The Krea 2 authors' recommended targets, diffusers' Krea 2 script's default: every attention (text fusion's too) and
# the main blocks' MLPs, the input, output, text and time projections.
TRANSFORMER_TARGETS = [
    "img_in",
    "final_layer.linear",
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "to_gate",
    "ff.up",
    "ff.down",
    "text_fusion.projector",
    "txt_in.linear_1",
    "txt_in.linear_2",
    "time_embed.linear_1",
    "time_embed.linear_2",
    "time_mod_proj",
]
# diffusers module -> the original model's (`krea-ai/krea-2`, ComfyUI's), the inverse of diffusers' reader of
# original-layout LoRAs (`_convert_non_diffusers_krea2_lora_to_diffusers`).
ORIGINAL_NAMES = {
    "img_in": "first",
    "final_layer.linear": "last.linear",
    "time_embed.linear_1": "tmlp.0",
    "time_embed.linear_2": "tmlp.2",
    "time_mod_proj": "tproj.1",
    "txt_in.linear_1": "txtmlp.1",
    "txt_in.linear_2": "txtmlp.3",
    "text_fusion.projector": "txtfusion.projector",
}
ORIGINAL_IN_BLOCK = {
    "attn.to_q": "attn.wq",
    "attn.to_k": "attn.wk",
    "attn.to_v": "attn.wv",
    "attn.to_out.0": "attn.wo",
    "attn.to_gate": "attn.gate",
    "ff.gate": "mlp.gate",
    "ff.up": "mlp.up",
    "ff.down": "mlp.down",
}
BLOCK = re.compile(r"^(transformer_blocks|text_fusion\.layerwise_blocks|text_fusion\.refiner_blocks)\.(\d+)\.(.+)$")
ORIGINAL_BLOCKS = {
    "transformer_blocks": "blocks",
    "text_fusion.layerwise_blocks": "txtfusion.layerwise_blocks",
    "text_fusion.refiner_blocks": "txtfusion.refiner_blocks",
}

# For single files: the inverse of diffusers' reader (`convert_krea2_transformer_checkpoint_to_diffusers`) on weight
# names, outside the blocks by prefix, then within every block; a block's six modulation vectors are one flat
# vector in the original.
ORIGINAL_WEIGHT_PREFIXES = {
    "img_in.": "first.",
    "time_embed.linear_1.": "tmlp.0.",
    "time_embed.linear_2.": "tmlp.2.",
    "time_mod_proj.": "tproj.1.",
    "txt_in.norm.weight": "txtmlp.0.scale",
    "txt_in.linear_1.": "txtmlp.1.",
    "txt_in.linear_2.": "txtmlp.3.",
    "text_fusion.": "txtfusion.",
    "transformer_blocks.": "blocks.",
    "final_layer.linear.": "last.linear.",
    "final_layer.norm.weight": "last.norm.scale",
    "final_layer.scale_shift_table": "last.modulation.lin",
}
ORIGINAL_WEIGHT_NAMES = {
    ".attn.to_q.": ".attn.wq.",
    ".attn.to_k.": ".attn.wk.",
    ".attn.to_v.": ".attn.wv.",
    ".attn.to_out.0.": ".attn.wo.",
    ".attn.to_gate.": ".attn.gate.",
    ".attn.norm_q.weight": ".attn.qknorm.qnorm.scale",
    ".attn.norm_k.weight": ".attn.qknorm.knorm.scale",
    ".ff.": ".mlp.",
    ".norm1.weight": ".prenorm.scale",
    ".norm2.weight": ".postnorm.scale",
    ".scale_shift_table": ".mod.lin",
}


def original_weight_name(key: str) -> str:
    for diffusers_name, original in ORIGINAL_WEIGHT_PREFIXES.items():
        if key.startswith(diffusers_name):
            key = original + key[len(diffusers_name) :]
            break
    for diffusers_name, original in ORIGINAL_WEIGHT_NAMES.items():
        key = key.replace(diffusers_name, original)
    return key


def original_name(module: str) -> str | None:
    """A transformer module's name in the original model (None: it has no adaptable counterpart there)."""
    if match := BLOCK.match(module):
        blocks, index, member = match.groups()
        return f"{ORIGINAL_BLOCKS[blocks]}.{index}.{ORIGINAL_IN_BLOCK[member]}" if member in ORIGINAL_IN_BLOCK else None
    return ORIGINAL_NAMES.get(module)


def krea2_shift(components: Components, image_tokens: int) -> float:
    """The shift Krea 2's pipeline samples `image_tokens` with: a distilled base's one mu, else the scheduler's rule
    with Krea 2's defaults."""
    if components.pipeline_options.get("is_distilled"):
        return math.exp(DISTILLED_MU)
    config = components.noise_scheduler.config
    return math.exp(
        calculate_shift(
            image_tokens,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 6400),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
    )


class Krea2Layout(RenamedLayout):
    """Krea2's files in other tools' layouts."""

    single_file_layout = "transformer alone (original layout)"

    denoiser_file_key = "txtfusion.projector.weight"  # what diffusers' reader detects Krea 2 files by

    kohya_prefixes = {"transformer": "lora_unet_"}

    kohya_text_model_parts = ()

    kohya_model_version = "krea2"

    kohya_layout_name = "Krea 2"

    def original_name(self, module: str) -> str | None:
        return original_name(module)

    def diffusers_names(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return (
            convert_krea2_transformer_checkpoint_to_diffusers(weights) if self.denoiser_file_key in weights else weights
        )

    def to_single_file(self, components: Components) -> dict[str, torch.Tensor]:
        out = {}
        for key, value in components.denoiser.state_dict().items():
            if key.startswith("transformer_blocks.") and key.endswith(".scale_shift_table"):
                value = value.flatten()
            out[original_weight_name(key)] = value.contiguous()
        return out


class Krea2Targets(AdapterTargets):
    default_targets = {"transformer": TRANSFORMER_TARGETS}
    lora_text_encoders = ()  # Krea2Pipeline's LoRA loader reads the transformer's adapters alone


class Krea2Loading(Loading):
    # Single files: the transformer alone (`diffusion_models/krea-2*.safetensors`); the other parts come from
    # `model.single_file_config`.
    single_file_pipeline = Loading.pipeline_around_denoiser_file


class Krea2Drawing(FlowDrawing):
    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        return {"max_sequence_length": TEXT_TOKENS} | anchored_guidance(guidance_scale, negative_prompt)


class Krea2Conditioning(Conditioning):
    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        tokenizer = tokenizers["tokenizer"]
        text = tokenizer(
            [PROMPT_PREFIX + caption for caption in captions],
            truncation=True,
            padding="max_length",
            max_length=TEXT_TOKENS + TEMPLATE_TOKENS - SUFFIX_TOKENS,
            return_tensors="pt",
        ).input_ids
        suffix = tokenizer([PROMPT_SUFFIX] * len(captions), return_tensors="pt").input_ids
        return {"text_encoder": torch.cat([text, suffix], dim=1)}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = token_ids["text_encoder"]
        mask = ids != components.tokenizers["tokenizer"].pad_token_id
        positions = (mask.long().cumsum(dim=-1) - 1).clamp(min=0)  # the suffix follows the caption without a gap
        hidden = components.text_encoders["text_encoder"](
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions.unsqueeze(0).expand(3, -1, -1),
            output_hidden_states=True,
        ).hidden_states
        layers = components.pipeline_options["text_encoder_select_layers"]
        states = torch.stack([hidden[layer] for layer in layers], dim=2)[:, TEMPLATE_TOKENS:]  # (B, L, layers, D)
        return {"encoder_hidden_states": states, "text_mask": mask[:, TEMPLATE_TOKENS:].long()}

    def cached_conditioning(self, conditioning):
        """The real tokens alone: at full length an entry is 512 x 12 x 2560 fp32 for Krea 2 (63 MB)."""
        valid = conditioning["text_mask"].bool()
        return {name: tensor[valid] for name, tensor in conditioning.items()}

    def uncached_conditioning(self, stored):
        """Inverse of `cached_conditioning`: the caption's tokens first, the suffix's last, padding between."""
        real = len(stored["text_mask"])
        restored = {}
        for name, tensor in stored.items():
            full = tensor.new_zeros(TEXT_TOKENS, *tensor.shape[1:])
            full[: real - SUFFIX_TOKENS], full[TEXT_TOKENS - SUFFIX_TOKENS :] = (
                tensor[:-SUFFIX_TOKENS],
                tensor[-SUFFIX_TOKENS:],
            )
            restored[name] = full
        return restored


class Krea2(FlowMatchingFamily):
    name = "krea2"
    layout = Krea2Layout()
    loading = Krea2Loading()
    conditioning = Krea2Conditioning()
    drawing = Krea2Drawing()
    targets = Krea2Targets()
    objective = FlowMatching(resolution_shift=krea2_shift)
    description = "Krea 2"
    pipeline_class = Krea2Pipeline
    pipeline_classes = ("Krea2Pipeline",)
    denoiser_class = Krea2Transformer2DModel
    denoiser_name = "transformer"
    pipeline_options = ("text_encoder_select_layers", "is_distilled", "patch_size")

    # Prompts and the transformer.

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        states, mask = conditioning["encoder_hidden_states"], conditioning["text_mask"].bool()
        _, _, h, w = noisy.shape
        prediction = components.denoiser(
            hidden_states=pack(noisy).to(states.dtype),
            encoder_hidden_states=states,
            timestep=(timesteps / 1000).to(states.dtype),
            position_ids=Krea2Pipeline.prepare_position_ids(states.shape[1], h // 2, w // 2, noisy.device),
            encoder_attention_mask=mask,
            return_dict=False,
        )[0]
        return unpack(prediction, h, w)

    # Sampling.

    def max_sequence_length(self, components: Components) -> int:
        return TEXT_TOKENS


FAMILY = Krea2()
