"""Flux.1-class flow-matching transformers: a `FluxTransformer2DModel` over 2x2-packed 16-channel latents,
conditioned on T5's token states and CLIP's pooled embedding (and, in guidance-distilled bases, a guidance
value).

- Text: T5's last hidden state (B, L, D) is the token conditioning and CLIP's pooled output (B, P) the pooled
  one, as `FluxPipeline.encode_prompt` makes them; T5's padding mask (B, L) is cached beside them, used when
  `model.family_options.text_padding_mask` asks for it.
- Latents (B, 16, h, w) stay unpacked everywhere else in difftune: `denoise` packs each 2x2 patch into one
  64-wide token with its (0, row, column) position id, calls the transformer, and unpacks the prediction.
- Objective: rectified flow, shared with the other flow families (flow.py).
- Files: diffusers' LoRA layout is the transformer's own module names; kohya / ComfyUI name the original
  (BFL) model's modules, whose attention projections are fused (`qkv`; a single block's `linear1` is q, k, v
  and the MLP's input together): `KOHYA_TRANSFORMER` maps them and `kohya.fuse` / `kohya.split` convert.
"""

from __future__ import annotations


import torch
from diffusers import FluxPipeline
from pydantic import Field

from difftune.errors import DifftuneError
from difftune.families.flow import FlowMatchingFamily, FlowOptions, pack, unpack
from difftune.families.fused import FusedKohyaLayout
from difftune.families.sd import CLIP_ATTENTION
from difftune.models import Components

# diffusers' Flux LoRA script's default targets, plus the single blocks' MLP input, so that a single block's fused
# `linear1` (q, k, v, MLP) is adapted whole: the kohya layout can then carry DoRA there too.
TRANSFORMER_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp",
]
T5_ATTENTION = ["q", "k", "v", "o"]

# The original (BFL) model's modules, as kohya and ComfyUI name them after `lora_unet_`, -> the diffusers modules
# each holds, in the order of its output rows. `{i}` is the block index.
KOHYA_DOUBLE_BLOCK = {
    "double_blocks_{i}_img_attn_qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
    "double_blocks_{i}_img_attn_proj": ["attn.to_out.0"],
    "double_blocks_{i}_img_mlp_0": ["ff.net.0.proj"],
    "double_blocks_{i}_img_mlp_2": ["ff.net.2"],
    "double_blocks_{i}_img_mod_lin": ["norm1.linear"],
    "double_blocks_{i}_txt_attn_qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    "double_blocks_{i}_txt_attn_proj": ["attn.to_add_out"],
    "double_blocks_{i}_txt_mlp_0": ["ff_context.net.0.proj"],
    "double_blocks_{i}_txt_mlp_2": ["ff_context.net.2"],
    "double_blocks_{i}_txt_mod_lin": ["norm1_context.linear"],
}
KOHYA_SINGLE_BLOCK = {
    "single_blocks_{i}_linear1": ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"],
    "single_blocks_{i}_linear2": ["proj_out"],
    "single_blocks_{i}_modulation_lin": ["norm.linear"],
}
KOHYA_GLOBAL = {
    "img_in": ["x_embedder"],
    "txt_in": ["context_embedder"],
    "time_in_in_layer": ["time_text_embed.timestep_embedder.linear_1"],
    "time_in_out_layer": ["time_text_embed.timestep_embedder.linear_2"],
    "vector_in_in_layer": ["time_text_embed.text_embedder.linear_1"],
    "vector_in_out_layer": ["time_text_embed.text_embedder.linear_2"],
    "guidance_in_in_layer": ["time_text_embed.guidance_embedder.linear_1"],
    "guidance_in_out_layer": ["time_text_embed.guidance_embedder.linear_2"],
    "final_layer_linear": ["proj_out"],
}
MLP_RATIO = 4  # a single block's MLP is this times wider than its attention (FluxSingleTransformerBlock's default)


def image_position_ids(h: int, w: int, device, dtype, index: int = 0) -> torch.Tensor:
    """(h/2 * w/2, 3) ids (index, row, column) of the packed tokens, as `FluxPipeline._prepare_latent_image_ids`:
    index 0 for the image drawn, 1 for FLUX.1 Kontext's reference image (`FluxKontextPipeline.prepare_latents`)."""
    rows = torch.arange(h // 2, device=device, dtype=dtype)[:, None].expand(h // 2, w // 2)
    columns = torch.arange(w // 2, device=device, dtype=dtype)[None, :].expand(h // 2, w // 2)
    return torch.stack([torch.full_like(rows, index), rows, columns], dim=-1).reshape(-1, 3)


class FluxOptions(FlowOptions):
    text_padding_mask: bool = Field(
        False, description="Keep the T5 padding tokens out of the joint attention in training (SimpleTuner's masked "
        "training). Off by default, as Flux.1 was trained and as FluxPipeline samples (it passes no mask, so "
        "in-training samples and other tools see the padding either way).",
    )


class Flux(FusedKohyaLayout, FlowMatchingFamily):
    name = "flux"
    description = "Flux.1-class flow-matching transformers"
    options_model = FluxOptions
    pipeline_class = FluxPipeline
    pipeline_classes = ("FluxPipeline",)
    denoiser_name = "transformer"
    text_encoder_names = ("text_encoder", "text_encoder_2")
    tokenizer_names = ("tokenizer", "tokenizer_2")
    # kohya's Flux LoRA names T5 `lora_te3_`, the prefix ComfyUI gives T5 beside two CLIPs (SD3).
    kohya_prefixes = {"transformer": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te3_"}
    kohya_text_model_parts = ("text_encoder",)
    kohya_model_version = "flux1"
    kohya_layout_name = "Flux"
    kohya_blocks = {"transformer_blocks": KOHYA_DOUBLE_BLOCK, "single_transformer_blocks": KOHYA_SINGLE_BLOCK}
    kohya_globals = KOHYA_GLOBAL
    embedding_keys = ("clip_l", "t5")
    default_targets = {"transformer": TRANSFORMER_TARGETS, "text_encoder": CLIP_ATTENTION, "text_encoder_2": T5_ATTENTION}

    def adapted_text_encoders(self) -> tuple[str, ...]:
        # CLIP only: FluxPipeline's LoRA loader reads transformer and CLIP adapters (T5's would be dropped), and
        # kohya trains T5 only on request. T5's states are what the transformer's adapter learns to read.
        return ("text_encoder",)

    # Prompts and the transformer.

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        clip = components.text_encoders["text_encoder"](token_ids["text_encoder"], output_hidden_states=False)
        t5_ids = token_ids["text_encoder_2"]
        t5_states = components.text_encoders["text_encoder_2"](t5_ids, output_hidden_states=False)[0]
        pad = components.tokenizers["tokenizer_2"].pad_token_id
        return {"encoder_hidden_states": t5_states, "pooled_prompt_embeds": clip.pooler_output, "text_mask": t5_ids != pad}

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """Reference images (an edit base's `control_latents`) follow the image's tokens, each with its own index in
        the position ids, and their predictions are dropped, as `FluxKontextPipeline` does."""
        states = conditioning["encoder_hidden_states"]
        b, _, h, w = noisy.shape
        images = [noisy, *conditioning.get("control_latents", [])]
        image_ids = torch.cat([image_position_ids(*image.shape[-2:], noisy.device, states.dtype, index)
                               for index, image in enumerate(images)])
        text_ids = torch.zeros(states.shape[1], 3, device=noisy.device, dtype=states.dtype)
        attention = None
        if components.family_options.text_padding_mask:  # text tokens, then image tokens: the joint sequence's order
            keep = torch.cat([conditioning["text_mask"].bool(), torch.ones(b, image_ids.shape[0], dtype=torch.bool,
                                                                          device=noisy.device)], dim=1)
            attention = {"attention_mask": keep[:, None, None, :]}
        prediction = components.denoiser(
            hidden_states=torch.cat([pack(image) for image in images], dim=1).to(states.dtype),
            timestep=(timesteps / 1000).to(states.dtype), guidance=self.guidance(components, b, noisy.device),
            pooled_projections=conditioning["pooled_prompt_embeds"], encoder_hidden_states=states, txt_ids=text_ids,
            img_ids=image_ids, joint_attention_kwargs=attention, return_dict=False,
        )[0]
        return unpack(prediction[:, : (h // 2) * (w // 2)], h, w)

    # Sampling.

    def max_sequence_length(self, components: Components) -> int:
        return components.tokenizers["tokenizer_2"].model_max_length

    # Files.

    def to_single_file(self, components: Components) -> dict[str, torch.Tensor]:
        raise DifftuneError(
            "merge --single-file: not written for Flux yet; the merged diffusers folder loads in diffusers, and "
            "ComfyUI reads the adapter's kohya layout"
        )

    def fused_row_sizes(self, modules: list[str], rows: int) -> list[int]:
        """A single block's `linear1` holds q, k, v and the MLP input, which is `MLP_RATIO` times as wide."""
        if not modules[-1].endswith("proj_mlp"):
            return super().fused_row_sizes(modules, rows)
        width = rows // (3 + MLP_RATIO)
        return [width] * 3 + [rows - 3 * width]
