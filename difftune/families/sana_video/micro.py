"""Micro Sana-Video: micro Sana's Gemma 2 text encoder and a Sana-Video transformer over micro Wan's causal video
autoencoder, with the sampler diffusers' Sana-Video conversion makes (DPM-Solver on flow sigmas shifted by 8)."""

from diffusers import SanaVideoPipeline, SanaVideoTransformer3DModel

from difftune.families.sana.micro import sana_blocks, sana_pipeline
from difftune.families.wan.micro import autoencoder
from difftune.toy.micro import MicroSizes
from difftune.toy.tiny import FLUX_LATENT_CHANNELS, QWEN_HIDDEN_SIZE

SHIPPED_JOB = "sana_video_lora.toml"
JOB_ON_MICRO = True

__all__ = ["autoencoder", "pipeline"]


def pipeline(vae, sizes: MicroSizes):
    return sana_pipeline(SanaVideoPipeline, vae, sizes, 8.0, build_sana_video_transformer)


def build_sana_video_transformer(
    layers: int = 1, heads: int = 2, head_dim: int = 24, text_hidden_size: int = QWEN_HIDDEN_SIZE
) -> SanaVideoTransformer3DModel:
    """`layers` Sana-Video blocks over 1x2x2 patches of Wan's 16-channel latents, Wan's rotary axes split over (time,
    row, column) from the head's width."""
    return SanaVideoTransformer3DModel(
        in_channels=FLUX_LATENT_CHANNELS,
        out_channels=FLUX_LATENT_CHANNELS,
        mlp_ratio=3.0,
        sample_size=4,
        patch_size=(1, 2, 2),
        rope_max_seq_len=64,
        **sana_blocks(layers, heads, head_dim, text_hidden_size),
    )
