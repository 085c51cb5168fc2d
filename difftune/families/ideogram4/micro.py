"""Micro Ideogram 4: a Qwen3-VL language model and two Ideogram 4 transformers (the second, reading no text, guides:
asymmetric guidance) over FLUX.2's autoencoder, its statistics in Ideogram 4's token order."""

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline, Ideogram4Transformer2DModel

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._latent_statistics import flux2_autoencoder
from difftune.toy.tiny import (
    FLUX2_LATENT_CHANNELS,
    IDEOGRAM4_TEXT_LAYERS,
    QWEN3_VL_CHAT_TEMPLATE,
    QWEN_HIDDEN_SIZE,
    build_qwen3_tokenizer,
    build_qwen3_vl_text_encoder,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "ideogram4_1024_lora.toml"
JOB_ON_MICRO = True


def autoencoder(pixels):
    return flux2_autoencoder(pixels, token_order=ideogram4_token_channels)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_qwen3_tokenizer()
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    layers = sizes.dit_layers or 1
    return Ideogram4Pipeline(
        vae=vae,
        text_encoder=build_qwen3_vl_text_encoder(tokenizer, width, layers=IDEOGRAM4_TEXT_LAYERS),
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000),
        transformer=build_ideogram4_transformer(layers, sizes.dit_heads, text_hidden_size=width),
        unconditional_transformer=build_ideogram4_transformer(layers, sizes.dit_heads, text_hidden_size=width),
    )


def build_ideogram4_transformer(
    layers: int = 1, heads: int = 2, head_dim: int = 16, text_hidden_size: int = QWEN_HIDDEN_SIZE
) -> Ideogram4Transformer2DModel:
    """`layers` blocks over FLUX.2's patched latents, reading 13 language-model layers' states side by side; the
    rotary frequencies split (time, row, column) 4:2:2, interleaved as Ideogram 4's 24:20:20."""
    return Ideogram4Transformer2DModel(
        in_channels=4 * FLUX2_LATENT_CHANNELS,
        num_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        intermediate_size=2 * heads * head_dim,
        adaln_dim=16,
        llm_features_dim=13 * text_hidden_size,
        rope_theta=10000,
        mrope_section=(head_dim // 4, head_dim // 8, head_dim // 8),
    )


def ideogram4_token_channels(patched_latents: torch.Tensor) -> torch.Tensor:
    """FLUX.2-patched latents (B, 4C, h, w), channel c * 4 + p, with their channels in Ideogram 4's token order
    (p * C + c): the order its batch-norm statistics are kept in."""
    b, channels, h, w = patched_latents.shape
    return patched_latents.view(b, channels // 4, 4, h, w).transpose(1, 2).reshape(b, channels, h, w)
