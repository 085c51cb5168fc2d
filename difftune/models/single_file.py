"""The original single-file checkpoint layouts (LDM for SD 1.x/2.x, SGM for SDXL), written from diffusers models.

A1111, ComfyUI and `from_single_file` read one `.safetensors` with `model.diffusion_model.*` (UNet) and
`first_stage_model.*` (VAE) keys, and the text encoders under `cond_stage_model.transformer.*` (SD's CLIP) or
`conditioner.embedders.0.transformer.*` and `conditioner.embedders.1.model.*` (SDXL's CLIP and OpenCLIP).
diffusers ships only the reading direction (`single_file_utils`); this is the writing one, derived from each
model's config (levels, layers per block, attention placement), so it serves any SD- or SDXL-shaped UNet, the
tiny ones included. A family module says which pieces its file has.
"""

from __future__ import annotations

import re

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
TEXT_ENCODER_PREFIX = "cond_stage_model.transformer."
SDXL_CONDITIONER_PREFIX = "conditioner."
SDXL_TEXT_ENCODER_PREFIX = "conditioner.embedders.0.transformer."
SDXL_TEXT_ENCODER_2_PREFIX = "conditioner.embedders.1.model."

_UNET_TOP_LEVEL = {
    "time_embedding.linear_1.": "time_embed.0.",
    "time_embedding.linear_2.": "time_embed.2.",
    "conv_in.": "input_blocks.0.0.",
    "conv_norm_out.": "out.0.",
    "conv_out.": "out.2.",
    "add_embedding.linear_1.": "label_emb.0.0.",  # SDXL's size/crop and pooled-text embedding
    "add_embedding.linear_2.": "label_emb.0.2.",
}
_UNET_RESNET = {
    "norm1.": "in_layers.0.",
    "conv1.": "in_layers.2.",
    "time_emb_proj.": "emb_layers.1.",
    "norm2.": "out_layers.0.",
    "conv2.": "out_layers.3.",
    "conv_shortcut.": "skip_connection.",
}
_VAE_ATTENTION = {
    "group_norm.": "norm.",
    "to_q.": "q.",
    "to_k.": "k.",
    "to_v.": "v.",
    "to_out.0.": "proj_out.",
}


def unet_to_ldm(unet: UNet2DConditionModel) -> dict:
    """UNet state dict -> LDM keys (`model.diffusion_model.` prefix)."""
    prefixes = _unet_prefixes(
        unet.config.layers_per_block,
        len(unet.down_blocks),
        [bool(getattr(block, "attentions", None)) for block in unet.up_blocks],
    )
    return {UNET_PREFIX + _ldm_name(key, prefixes): value for key, value in unet.state_dict().items()}


def unet_ldm_module_names(module_names: list[str]) -> dict[str, str]:
    """A UNet's modules by their original LDM / SGM names (`input_blocks.4.1.proj_in` -> `down_blocks.1.attentions.0.
    proj_in`), the names kohya's SDXL LoRAs use; the layout is read from the diffusers `module_names` themselves. Names
    of no UNet (a transformer's) give none."""

    def indices(pattern: str) -> set[int]:
        return {int(match.group(1)) for name in module_names if (match := re.match(pattern, name))}

    layers, down, up = (
        indices(r"down_blocks\.0\.resnets\.(\d+)\."),
        indices(r"down_blocks\.(\d+)\."),
        indices(r"up_blocks\.(\d+)\."),
    )
    if not (layers and down and up):
        return {}
    with_attention = indices(r"up_blocks\.(\d+)\.attentions\.")
    prefixes = _unet_prefixes(max(layers) + 1, max(down) + 1, [level in with_attention for level in range(max(up) + 1)])
    return {_ldm_name(f"{name}.", prefixes).removesuffix("."): name for name in module_names}


def _unet_prefixes(layers_per_block: int, down_levels: int, up_has_attention: list[bool]) -> dict[str, str]:
    """diffusers name prefixes -> LDM ones, for a UNet of this layout."""
    per_level = layers_per_block + 1  # LDM puts each level's downsampler in its own input block
    prefixes = dict(_UNET_TOP_LEVEL)
    for level in range(down_levels):
        for layer in range(layers_per_block):
            index = per_level * level + layer + 1
            prefixes[f"down_blocks.{level}.resnets.{layer}."] = f"input_blocks.{index}.0."
            prefixes[f"down_blocks.{level}.attentions.{layer}."] = f"input_blocks.{index}.1."
        prefixes[f"down_blocks.{level}.downsamplers.0.conv."] = f"input_blocks.{per_level * (level + 1)}.0.op."
    prefixes["mid_block.resnets.0."] = "middle_block.0."
    prefixes["mid_block.attentions.0."] = "middle_block.1."
    prefixes["mid_block.resnets.1."] = "middle_block.2."
    for level, has_attention in enumerate(up_has_attention):
        for layer in range(per_level):
            index = per_level * level + layer
            prefixes[f"up_blocks.{level}.resnets.{layer}."] = f"output_blocks.{index}.0."
            prefixes[f"up_blocks.{level}.attentions.{layer}."] = f"output_blocks.{index}.1."
        upsampler_slot = 2 if has_attention else 1
        prefixes[f"up_blocks.{level}.upsamplers.0."] = (
            f"output_blocks.{per_level * level + per_level - 1}.{upsampler_slot}."
        )
    return prefixes


def _ldm_name(key: str, prefixes: dict[str, str]) -> str:
    """A UNet weight's (or module's, with a trailing `.`) diffusers name -> its LDM name."""
    new_key = _replace_prefix(key, prefixes)
    return _replace_inner(new_key, _UNET_RESNET) if ".resnets." in key else new_key


def vae_to_ldm(vae: AutoencoderKL) -> dict:
    """KL VAE state dict -> LDM keys (`first_stage_model.` prefix); attention projections become 1x1 convs."""
    levels = len(vae.config.block_out_channels)
    prefixes = {
        "encoder.conv_norm_out.": "encoder.norm_out.",
        "decoder.conv_norm_out.": "decoder.norm_out.",
        "encoder.mid_block.attentions.0.": "encoder.mid.attn_1.",
        "decoder.mid_block.attentions.0.": "decoder.mid.attn_1.",
    }
    for i in range(2):
        prefixes[f"encoder.mid_block.resnets.{i}."] = f"encoder.mid.block_{i + 1}."
        prefixes[f"decoder.mid_block.resnets.{i}."] = f"decoder.mid.block_{i + 1}."
    for level in range(levels):
        prefixes[f"encoder.down_blocks.{level}.resnets."] = f"encoder.down.{level}.block."
        prefixes[f"encoder.down_blocks.{level}.downsamplers.0."] = f"encoder.down.{level}.downsample."
        # LDM numbers decoder levels from the bottom up.
        prefixes[f"decoder.up_blocks.{level}.resnets."] = f"decoder.up.{levels - 1 - level}.block."
        prefixes[f"decoder.up_blocks.{level}.upsamplers.0."] = f"decoder.up.{levels - 1 - level}.upsample."
    out = {}
    for key, value in vae.state_dict().items():
        new_key = _replace_prefix(key, prefixes).replace("conv_shortcut.", "nin_shortcut.")
        if ".mid.attn_1." in new_key:
            new_key = _replace_inner(new_key, _VAE_ATTENTION)
            if value.ndim == 2:
                value = value[:, :, None, None]
        out[VAE_PREFIX + new_key] = value
    return out


def clip_to_ldm(text_encoder, prefix: str) -> dict:
    """A CLIP text encoder in Hugging Face's layout under `prefix` (`...transformer.text_model.*`). transformers 5
    dropped the `text_model` level from CLIPTextModel; the original layout (and every reader of it) keeps it."""
    out = {}
    for key, value in text_encoder.state_dict().items():
        key = key if key.startswith("text_model.") else f"text_model.{key}"
        out[prefix + key] = value
    return out


_OPEN_CLIP_LAYERS = {
    "text_model.embeddings.position_embedding.weight": "positional_embedding",
    "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
    "text_model.final_layer_norm.weight": "ln_final.weight",
    "text_model.final_layer_norm.bias": "ln_final.bias",
}
_OPEN_CLIP_BLOCK = {
    "layer_norm1.": "ln_1.",
    "layer_norm2.": "ln_2.",
    "mlp.fc1.": "mlp.c_fc.",
    "mlp.fc2.": "mlp.c_proj.",
    "self_attn.out_proj.": "attn.out_proj.",
}


def open_clip_to_ldm(text_encoder, prefix: str) -> dict:
    """A `CLIPTextModelWithProjection` in OpenCLIP's layout under `prefix`, as SDXL's second encoder is stored:
    `transformer.resblocks.N.*`, the attention's q/k/v stacked into one `in_proj`, and `text_projection`
    transposed (OpenCLIP multiplies by it from the right)."""
    state = {
        key if key.startswith(("text_model.", "text_projection")) else f"text_model.{key}": value
        for key, value in text_encoder.state_dict().items()
    }
    out = {prefix + "text_projection": state.pop("text_projection.weight").T.contiguous()}
    for key, name in _OPEN_CLIP_LAYERS.items():
        out[prefix + name] = state.pop(key)
    layers = {key.split(".")[3] for key in state if key.startswith("text_model.encoder.layers.")}
    for layer in sorted(layers, key=int):
        source, target = f"text_model.encoder.layers.{layer}.", f"{prefix}transformer.resblocks.{layer}."
        for kind in ("weight", "bias"):
            out[f"{target}attn.in_proj_{kind}"] = torch.cat(
                [state.pop(f"{source}self_attn.{p}_proj.{kind}") for p in "qkv"]
            )
        for key in [k for k in state if k.startswith(source)]:
            out[target + _replace_prefix(key[len(source) :], _OPEN_CLIP_BLOCK)] = state.pop(key)
    if state:
        raise ValueError(f"open_clip_to_ldm: no OpenCLIP name for {sorted(state)[0]}")
    return out


def _replace_prefix(key: str, prefixes: dict[str, str]) -> str:
    # Longest first, so `down_blocks.1.resnets.0.` wins over a shorter prefix of it.
    for old in sorted(prefixes, key=len, reverse=True):
        if key.startswith(old):
            return prefixes[old] + key[len(old) :]
    return key


def _replace_inner(key: str, names: dict[str, str]) -> str:
    for old, new in names.items():
        if f".{old}" in key:
            return key.replace(f".{old}", f".{new}", 1)
    return key
