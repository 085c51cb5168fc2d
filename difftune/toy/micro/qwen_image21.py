"""Micro Qwen-Image 2.1: a Qwen3-VL language model with its head (as Qwen-Image 2.1 keeps it) read through the
pipeline's processor, and a Qwen-Image 2.1 transformer over its own RGBA autoencoder at 16x."""

from diffusers import QwenImage21Pipeline

from difftune.toy.micro import MicroSizes, TinyBase
from difftune.toy.micro._latent_statistics import with_latent_statistics
from difftune.toy.micro.qwen_image import RECIPE as QWEN_RECIPE
from difftune.toy.tiny import (
    QWEN_HIDDEN_SIZE,
    build_flow_scheduler,
    build_qwen3_vl_text_encoder,
    build_qwen_image21_processor,
    build_qwen_image21_transformer,
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
    autoencoder={"kind": "qwen_image21", "latent_channels": 64, "base_dim": 16, "dim_mult": (1, 2, 2, 4, 4)},
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
