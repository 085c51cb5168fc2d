"""How ComfyUI finds and applies a LoRA file's keys (its `comfy/lora.py`: `model_lora_keys_unet`,
`model_lora_keys_clip`, `load_lora` and the "lora" weight patch), restated here for the tests as the reader we
did not write: a file that loads in ComfyUI is one whose every key this map reaches.

- The diffusion model is held in its original (single-file) layout, each weight `X.weight` under
  `diffusion_model.`; a LoRA reaches it as `lora_unet_` + X with `_` for `.`, or as `diffusion_model.X` (the
  "generic" form). A UNet is also reached by its diffusers module names (`lora_unet_down_blocks_0_...`).
- CLIP text encoders are reached per layer as `lora_te_` / `lora_te1_` / `lora_te2_` +
  `text_model_encoder_layers_<i>_<module>`; a T5 as `lora_te<n>_` + its module path with `_`, `n` counting the
  CLIPs before it.
- Each module's change is `alpha / rank * up @ down` (rank: `down`'s rows; no `.alpha` tensor: a scale of 1),
  added to the weight; keys that map to nothing are "lora key not loaded" and change nothing.
"""

from __future__ import annotations

import re

import torch

CLIP_LAYER_MODULES = (
    "mlp.fc1",
    "mlp.fc2",
    "self_attn.k_proj",
    "self_attn.q_proj",
    "self_attn.v_proj",
    "self_attn.out_proj",
)


def denoiser_weights(single_file: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The diffusion model's weights as ComfyUI names them, from a single file in the original layout (an all-in-one
    checkpoint keeps them under `model.diffusion_model.`; a lone model's file has them bare)."""
    for prefix in ("model.diffusion_model.", "net."):  # `net.`: a Cosmos model's (Anima's), which ComfyUI strips too
        if any(key.startswith(prefix) for key in single_file):
            return {key.removeprefix(prefix): value for key, value in single_file.items() if key.startswith(prefix)}
    return dict(single_file)


def unet_key_map(weights: dict[str, torch.Tensor], diffusers_names: dict[str, str]) -> dict[str, str]:
    """LoRA key -> the weight it patches. `diffusers_names`: a UNet's diffusers module -> original module."""
    found = {}
    for key in weights:
        if key.endswith(".weight"):
            module = key.removesuffix(".weight")
            found[f"lora_unet_{module.replace('.', '_')}"] = key
            found[f"diffusion_model.{module}"] = key
    for diffusers, original in diffusers_names.items():
        if f"{original}.weight" in weights:
            found[f"lora_unet_{diffusers.replace('.', '_')}"] = f"{original}.weight"
    return found


def text_key_map(encoders: dict[str, tuple[str, dict[str, torch.Tensor]]]) -> dict[str, tuple[str, str]]:
    """LoRA key -> (part, weight) for text encoders: part -> (its kind, "clip" or "t5", and its weights named as
    transformers names them). CLIPs first, in ComfyUI's order; a T5 after them."""
    found, clips = {}, 0
    for part, (kind, weights) in encoders.items():
        if kind != "clip":
            continue
        clips += 1
        prefixes = ("lora_te_", "lora_te1_") if clips == 1 else ("lora_te2_",)
        for key in weights:
            module = key.removesuffix(".weight").removeprefix("text_model.")
            if (
                key.endswith(".weight")
                and module.startswith("encoder.layers.")
                and module.split(".", 3)[3] in CLIP_LAYER_MODULES
            ):
                for prefix in prefixes:
                    found[f"{prefix}text_model_{module.replace('.', '_')}"] = (part, key)
    for part, (kind, weights) in encoders.items():
        if kind == "t5":
            for key in weights:
                if key.endswith(".weight"):
                    found[f"lora_te{clips + 1}_{key.removesuffix('.weight').replace('.', '_')}"] = (part, key)
    return found


def apply_lora(lora: dict[str, torch.Tensor], key_map: dict, weights: dict) -> tuple[dict, list[str]]:
    """`weights` (keyed as `key_map`'s values) with the file's changes added, and the file's keys not loaded."""
    patched, loaded = dict(weights), set()
    for name, target in key_map.items():
        up, down = lora.get(f"{name}.lora_up.weight"), lora.get(f"{name}.lora_down.weight")
        if up is None or down is None:
            continue
        alpha = lora.get(f"{name}.alpha")
        scale = 1.0 if alpha is None else alpha.item() / down.shape[0]
        change = (up.flatten(1).double() @ down.flatten(1).double()).reshape(patched[target].shape)
        patched[target] = (patched[target].double() + scale * change).to(patched[target].dtype)
        loaded |= {f"{name}.lora_up.weight", f"{name}.lora_down.weight", f"{name}.alpha"}
    return patched, sorted(set(lora) - loaded)


# ComfyUI's names for the layers of Tencent's files (its HunyuanVideo model's `process_unet_state_dict`, which
# HunyuanImage 2.1 and HunyuanVideo 1.5 load through): the model is built of Flux.1's `DoubleStreamBlock`
# and `SingleStreamBlock` (comfy/ldm/flux/layers.py: `img_attn.qkv`, `img_attn.norm.query_norm.scale`, `img_mlp.0`,
# `img_mod.lin`, `linear1`, `modulation.lin`), a `TokenRefiner` (`self_attn.qkv`, `mlp.0`) and `MLPEmbedder`s
# (`in_layer`, `out_layer`) (comfy/ldm/hunyuan_video/model.py).
HUNYUAN_VIDEO_RENAMES = (
    (r"\.(img|txt)_attn_q_norm\.weight$", r".\1_attn.norm.query_norm.scale"),
    (r"\.(img|txt)_attn_k_norm\.weight$", r".\1_attn.norm.key_norm.scale"),
    (r"^(single_blocks\.\d+)\.q_norm\.weight$", r"\1.norm.query_norm.scale"),
    (r"^(single_blocks\.\d+)\.k_norm\.weight$", r"\1.norm.key_norm.scale"),
    (r"_attn_(qkv|proj)\.", r"_attn.\1."),
    (r"mlp\.fc1\.", "mlp.0."),
    (r"mlp\.fc2\.", "mlp.2."),
    (r"\.(img_mod|txt_mod|modulation)\.linear\.", r".\1.lin."),
    (r"^(time_in|time_r_in|guidance_in|txt_in\.t_embedder)\.mlp\.0\.", r"\1.in_layer."),
    (r"^(time_in|time_r_in|guidance_in|txt_in\.t_embedder)\.mlp\.2\.", r"\1.out_layer."),
    (r"^txt_in\.c_embedder\.linear_1\.", "txt_in.c_embedder.in_layer."),
    (r"^txt_in\.c_embedder\.linear_2\.", "txt_in.c_embedder.out_layer."),
)


def in_hunyuan_video_names(key: str) -> str:
    for pattern, replacement in HUNYUAN_VIDEO_RENAMES:
        key = re.sub(pattern, replacement, key)
    return key


def saved_by_comfyui(tencents_file: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformer file in Tencent's layout as ComfyUI saves its HunyuanVideo model: its names, its prefix."""
    return {"model.diffusion_model." + in_hunyuan_video_names(key): value for key, value in tencents_file.items()}
