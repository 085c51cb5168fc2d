"""Micro Qwen-Image 2.1: a Qwen3-VL language model with its head (as Qwen-Image 2.1 keeps it) read through the
pipeline's processor, and a Qwen-Image 2.1 transformer over its own RGBA autoencoder at 16x."""

from diffusers import QwenImage21Pipeline, QwenImage21Transformer2DModel
from transformers import Qwen3VLProcessor

from difftune.families.qwen_image.micro import RECIPE as QWEN_RECIPE
from difftune.toy.micro import MicroSizes, TinyBase
from difftune.toy.micro._latent_statistics import with_latent_statistics
from difftune.toy.tiny import (
    FLUX_LATENT_CHANNELS,
    QWEN_HIDDEN_SIZE,
    build_flow_scheduler,
    build_qwen3_vl_processor,
    build_qwen3_vl_text_encoder,
    build_qwen_image21_vae,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them).
SHIPPED_JOB = "qwen_image21_lora.toml"
TEXT_LAYERS = 2  # the pipeline reads the last layer's states, before the final norm
# tiny-qwen_image21: its own autoencoder at the real one's 16x and 64 channels, so a 32 px render is 2 x 2 latents
# (one image slot). Pilots of the autoencoder alone (judged on its reconstructions of 240 held-out renders): 16
# channels over blocks all of width 16, 1000 steps, then 1000 of the decoder: 21.8 dB, the judge names 0.57 of the
# shapes (soft corners); 64 channels with widths 16-64, 1000 steps: 21.1 dB, 0.65; 3000 steps: 26.6 dB, 1.00 (9.4
# min on 2 cores). Its latents learn the colors too (`vae_color_weight`: Qwen-Image's lesson). The transformer
# reads a 2-layer Qwen3-VL of width 64 kept at its random init (its states cached).
TINY_BASE = TinyBase(
    architecture=(
        "Qwen-Image 2.1's architecture at toy size, from the same classes (`QwenImage21Transformer2DModel`, a\n"
        "block-causal single-stream transformer over unpatched latents, a token a latent pixel, its own\n"
        "`AutoencoderKLQwenImage21` of RGBA images at 16x with 64 channels and per-channel statistics, a\n"
        "`Qwen3VLForConditionalGeneration` language model read through the pipeline's chat template; renders are\n"
        "opaque RGBA)"
    ),
    denoiser=lambda recipe: f"transformer ({recipe.dit_layers} single-stream blocks, width {recipe.dit_heads * 16})",
    recipe=QWEN_RECIPE
    | {
        "steps": 4000,
        "train_text_encoder": False,
        "vae_steps": 3000,
        "vae_decoder_steps": 1000,
        "taesd_steps": 450,
        "vae_color_weight": 1.0,
    },
    autoencoder={"kind": "rgba_16x", "latent_channels": 64, "base_dim": 16, "dim_mult": (1, 2, 2, 4, 4)},
)


def autoencoder(pixels):
    return with_latent_statistics(build_qwen_image21_vae(), pixels)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    processor = build_qwen_image21_processor()
    return QwenImage21Pipeline(
        vae=vae,
        text_encoder=build_qwen3_vl_text_encoder(processor.tokenizer, width, layers=TEXT_LAYERS, with_head=True),
        processor=processor,
        transformer=build_qwen_image21_transformer(
            sizes.dit_layers or 1, sizes.dit_heads, text_hidden_size=width, latent_channels=vae.config.z_dim
        ),
        scheduler=build_flow_scheduler(),  # the resolution shift over the latent tokens, as the pipeline asks for
    )


def build_qwen_image21_processor() -> Qwen3VLProcessor:
    """Qwen-Image 2.1's processor, with merges that spell the words of its pipeline's prompt template."""
    from difftune.families.qwen_image21 import PROMPT_TEMPLATE

    return build_qwen3_vl_processor(PROMPT_TEMPLATE)


def build_qwen_image21_transformer(
    layers: int = 1,
    heads: int = 2,
    head_dim: int = 16,
    text_hidden_size: int = QWEN_HIDDEN_SIZE,
    latent_channels: int = FLUX_LATENT_CHANNELS,
) -> QwenImage21Transformer2DModel:
    """Qwen-Image 2.1's block-causal single-stream transformer over unpatched latents (a token a latent pixel), its
    rotary axes (frame, row, column) in its proportions (16, 56, 56 of 128)."""
    return QwenImage21Transformer2DModel(
        in_channels=latent_channels,
        out_channels=latent_channels,
        num_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        context_in_dim=text_hidden_size,
        axes_dims_rope=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8),
    )
