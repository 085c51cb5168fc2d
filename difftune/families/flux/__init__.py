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
  and the MLP's input together): `ORIGINAL_BLOCKS` maps them and `kohya.fuse` / `kohya.split` convert. Single files
  (the transformer alone, as BFL and ComfyUI ship it) are read and written from the same tables (layouts.py).
"""

from __future__ import annotations

import torch
from diffusers import FluxControlNetPipeline, FluxControlPipeline, FluxPipeline, FluxTransformer2DModel
from pydantic import Field

from difftune.families.common.conditioning import Conditioning
from difftune.families.common.control import FluxControlNet, InputControl
from difftune.families.common.flow import FlowMatchingFamily, FlowOptions
from difftune.families.common.layouts import FusedLayout, kohya_blocks_of, kohya_globals_of
from difftune.families.common.loading import Loading
from difftune.families.common.targets import AdapterTargets
from difftune.families.common.tokens import pack, unpack
from difftune.families.sd import CLIP_ATTENTION
from difftune.models.components import Components

# diffusers' Flux LoRA script's default targets, plus the single blocks' MLP input, so that a single block's fused
# `linear1` (q, k, v, MLP) is adapted whole: the kohya layout can then carry DoRA there too. A double block's are
# `DOUBLE_BLOCK_TARGETS`.
DOUBLE_BLOCK_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
]
TRANSFORMER_TARGETS = [*DOUBLE_BLOCK_TARGETS, "proj_mlp"]
T5_ATTENTION = ["q", "k", "v", "o"]

# The original (BFL) model's layers in a block -> the diffusers modules each holds, in the order of its output rows
# (q, k and v fused; a single block's `linear1` is q, k, v and the MLP's input); its norms keep their weight as
# `scale`. Single files and the kohya layout (`lora_unet_double_blocks_0_img_attn_qkv`) both name them.
ORIGINAL_DOUBLE_BLOCK = {
    "img_mod.lin": ["norm1.linear"],
    "img_attn.qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
    "img_attn.proj": ["attn.to_out.0"],
    "img_attn.norm.query_norm": ["attn.norm_q"],
    "img_attn.norm.key_norm": ["attn.norm_k"],
    "img_mlp.0": ["ff.net.0.proj"],
    "img_mlp.2": ["ff.net.2"],
    "txt_mod.lin": ["norm1_context.linear"],
    "txt_attn.qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    "txt_attn.proj": ["attn.to_add_out"],
    "txt_attn.norm.query_norm": ["attn.norm_added_q"],
    "txt_attn.norm.key_norm": ["attn.norm_added_k"],
    "txt_mlp.0": ["ff_context.net.0.proj"],
    "txt_mlp.2": ["ff_context.net.2"],
}
ORIGINAL_SINGLE_BLOCK = {
    "linear1": ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"],
    "linear2": ["proj_out"],
    "modulation.lin": ["norm.linear"],
    "norm.query_norm": ["attn.norm_q"],
    "norm.key_norm": ["attn.norm_k"],
}
ORIGINAL_BLOCKS = {
    "transformer_blocks": ("double_blocks", ORIGINAL_DOUBLE_BLOCK),
    "single_transformer_blocks": ("single_blocks", ORIGINAL_SINGLE_BLOCK),
}
# Outside the blocks: diffusers module -> original layer. The final layer's modulation is (shift, scale) in the
# original model, (scale, shift) in diffusers'.
ORIGINAL_GLOBALS = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
}
SWAPPED_HALVES = ("norm_out.linear.weight", "norm_out.linear.bias")
MLP_RATIO = 4  # a single block's MLP is this times wider than its attention (FluxSingleTransformerBlock's default)


def image_position_ids(h: int, w: int, device, dtype, index: int = 0) -> torch.Tensor:
    """(h/2 * w/2, 3) ids (index, row, column) of the packed tokens, as `FluxPipeline._prepare_latent_image_ids`:
    index 0 for the image drawn, 1 for FLUX.1 Kontext's reference image (`FluxKontextPipeline.prepare_latents`)."""
    rows = torch.arange(h // 2, device=device, dtype=dtype)[:, None].expand(h // 2, w // 2)
    columns = torch.arange(w // 2, device=device, dtype=dtype)[None, :].expand(h // 2, w // 2)
    return torch.stack([torch.full_like(rows, index), rows, columns], dim=-1).reshape(-1, 3)


class FluxOptions(FlowOptions):
    text_padding_mask: bool = Field(
        False,
        description="Keep the T5 padding tokens out of the joint attention in training (SimpleTuner's masked "
        "training). Off by default, as Flux.1 was trained and as FluxPipeline samples (it passes no mask, so "
        "in-training samples and other tools see the padding either way).",
    )


class SingleBlockRows:
    """Splits a Flux-kind single block's fused `linear1` (q, k, v and the MLP input, which is `MLP_RATIO` times as wide)
    by its rows; another fused layer's modules are alike (the layout's own rule)."""

    def fused_row_sizes(self, modules: list[str], rows: int, columns: int) -> list[int]:
        if not modules[-1].endswith("proj_mlp"):
            return super().fused_row_sizes(modules, rows, columns)
        width = rows // (3 + MLP_RATIO)
        return [width] * 3 + [rows - 3 * width]


class FluxLayout(SingleBlockRows, FusedLayout):
    """Flux's files in other tools' layouts."""

    single_file_layout = "transformer alone (BFL layout)"

    denoiser_file_key = "double_blocks.0.img_mod.lin.weight"  # FLUX.2's blocks share one modulation, Chroma's have none
    input_file_key = "img_in.weight"
    # ComfyUI's HunyuanImage 2.1 and HunyuanVideo files, on Flux.1's block layers: ComfyUI tells them by their caption's
    # token refiner too.
    other_models_file_keys = ("txt_in.individual_token_refiner.blocks.0.norm1.weight",)

    # kohya's Flux LoRA names T5 `lora_te3_`, the prefix ComfyUI gives T5 beside two CLIPs (SD3).
    kohya_prefixes = {"transformer": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te3_"}

    kohya_text_model_parts = ("text_encoder",)

    kohya_model_version = "flux1"

    kohya_layout_name = "Flux"

    original_blocks, original_globals, swapped_halves = ORIGINAL_BLOCKS, ORIGINAL_GLOBALS, SWAPPED_HALVES

    kohya_blocks = kohya_blocks_of(ORIGINAL_BLOCKS)

    kohya_globals = kohya_globals_of(ORIGINAL_GLOBALS, SWAPPED_HALVES)

    embedding_keys = ("clip_l", "t5")


class FluxTargets(AdapterTargets):
    default_targets = {
        "transformer": TRANSFORMER_TARGETS,
        "text_encoder": CLIP_ATTENTION,
        "text_encoder_2": T5_ATTENTION,
    }
    # CLIP only: FluxPipeline's LoRA loader reads transformer and CLIP adapters (T5's would be dropped), and kohya
    # trains T5 only on request. T5's states are what the transformer's adapter learns to read.
    lora_text_encoders = ("text_encoder",)


class FluxLoading(Loading):
    # Single files: the transformer alone, in BFL's layout (`flux1-dev.safetensors`, ComfyUI's `diffusion_models/`
    # files; an all-in-one file's autoencoder and text encoders are left out); the other parts come from
    # `model.single_file_config`.
    single_file_pipeline = Loading.pipeline_around_denoiser_file


class FluxConditioning(Conditioning):
    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        clip = components.text_encoders["text_encoder"](token_ids["text_encoder"], output_hidden_states=False)
        t5_ids = token_ids["text_encoder_2"]
        t5_states = components.text_encoders["text_encoder_2"](t5_ids, output_hidden_states=False)[0]
        pad = components.tokenizers["tokenizer_2"].pad_token_id
        return {
            "encoder_hidden_states": t5_states,
            "pooled_prompt_embeds": clip.pooler_output,
            "text_mask": t5_ids != pad,
        }


class Flux(FlowMatchingFamily):
    name = "flux"
    layout = FluxLayout()
    loading = FluxLoading()
    conditioning = FluxConditioning()
    targets = FluxTargets()
    description = "Flux.1-class flow-matching transformers"
    options_model = FluxOptions
    pipeline_class = FluxPipeline
    pipeline_classes = ("FluxPipeline", "FluxControlPipeline")  # the second: a control LoRA merged in
    controlnet = FluxControlNet(FluxControlNetPipeline)
    input_control = InputControl(FluxControlPipeline, "x_embedder", "proj_out")
    file_inputs = (64, 128)  # FLUX.1 [dev]'s 2x2 patches; a control base's (Depth, Canny [dev]) twice that
    denoiser_class = FluxTransformer2DModel
    denoiser_name = "transformer"
    text_encoder_names = ("text_encoder", "text_encoder_2")
    tokenizer_names = ("tokenizer", "tokenizer_2")

    # Prompts and the transformer.

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        """What the transformer predicts: a control LoRA's widened one (FluxControlPipeline's) reads twice that."""
        return (denoiser.config.get("out_channels") or denoiser.config.in_channels) // self.patch_size**2

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """Reference images (an edit base's `control_latents`) follow the image's tokens, each with its own index in
        the position ids, and their predictions are dropped, as `FluxKontextPipeline` does."""
        states = conditioning["encoder_hidden_states"]
        b, _, h, w = noisy.shape
        if "input_control" in conditioning:  # a control LoRA's: the control's latents as more input channels
            noisy = torch.cat([noisy, conditioning["input_control"]], dim=1)
        images = [noisy, *conditioning.get("control_latents", [])]
        image_ids = torch.cat(
            [
                image_position_ids(*image.shape[-2:], noisy.device, states.dtype, index)
                for index, image in enumerate(images)
            ]
        )
        text_ids = torch.zeros(states.shape[1], 3, device=noisy.device, dtype=states.dtype)
        attention = None
        if components.family_options.text_padding_mask:  # text tokens, then image tokens: the joint sequence's order
            keep = torch.cat(
                [
                    conditioning["text_mask"].bool(),
                    torch.ones(b, image_ids.shape[0], dtype=torch.bool, device=noisy.device),
                ],
                dim=1,
            )
            attention = {"attention_mask": keep[:, None, None, :]}
        tokens = torch.cat([pack(image) for image in images], dim=1).to(states.dtype)
        timestep = (timesteps / 1000).to(states.dtype)
        inputs = {
            "guidance": self.guidance(components, b, noisy.device),
            "pooled_projections": conditioning["pooled_prompt_embeds"],
            "encoder_hidden_states": states,
            "txt_ids": text_ids,
            "img_ids": image_ids,
            "joint_attention_kwargs": attention,
        }
        control = self.control_residuals(components, conditioning, tokens, timestep, **inputs)
        prediction = components.denoiser(
            hidden_states=tokens, timestep=timestep, **inputs, **control, return_dict=False
        )[0]
        return unpack(prediction[:, : (h // 2) * (w // 2)], h, w)

    # Sampling.

    def max_sequence_length(self, components: Components) -> int:
        return components.tokenizers["tokenizer_2"].model_max_length


FAMILY = Flux()
