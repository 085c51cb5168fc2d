"""Micro Wan 2.1: a umT5 text encoder and a Wan transformer over Wan's causal video autoencoder; and Wan 2.2's two
kinds (`wan22_pipeline`)."""

import torch
from diffusers import AutoencoderKLWan, WanPipeline

from difftune.toy.micro import MicroSizes, build_pipeline
from difftune.toy.micro._latent_statistics import qwen_autoencoder, with_latent_statistics
from difftune.toy.tiny import (
    FLUX_LATENT_CHANNELS,
    build_t5_tokenizer,
    build_umt5_encoder,
    build_wan_scheduler,
    build_wan_transformer,
    render_tensors,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "wan_image_lora.toml"
JOB_ON_MICRO = True


def autoencoder(pixels):
    return qwen_autoencoder(pixels, wan=True)


def pipeline(vae, sizes: MicroSizes):
    tokenizer = build_t5_tokenizer()
    return WanPipeline(
        vae=vae,
        text_encoder=build_umt5_encoder(len(tokenizer)),
        tokenizer=tokenizer,
        transformer=build_wan_transformer(sizes.dit_layers or 2, sizes.dit_heads),
        scheduler=build_wan_scheduler(),
    )


def wan22_pipeline(seed: int = 0, kind: str = "a14b") -> WanPipeline:
    """A micro Wan 2.2 pipeline: `a14b`, two experts (`transformer` for high noise levels, `transformer_2` below the
    T2V `boundary_ratio` 0.875, as Wan2.2-T2V-A14B's); `ti2v`, TI2V-5B's kind: one transformer reading a time per
    latent token (`expand_timesteps`) over Wan 2.2's autoencoder, which patches 2x2 itself (8x here: 4x by its
    blocks)."""
    wan = build_pipeline(seed, "wan")
    if kind == "a14b":
        torch.manual_seed(seed + 1)
        return WanPipeline(
            vae=wan.vae,
            text_encoder=wan.text_encoder,
            tokenizer=wan.tokenizer,
            scheduler=wan.scheduler,
            transformer=wan.transformer,
            transformer_2=build_wan_transformer(2, 2),
            boundary_ratio=0.875,
        )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLWan(
        base_dim=16,
        z_dim=FLUX_LATENT_CHANNELS,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True],
        is_residual=True,
        patch_size=2,
        in_channels=12,
        out_channels=12,
        scale_factor_spatial=8,
        scale_factor_temporal=2,
    )
    return WanPipeline(
        vae=with_latent_statistics(vae, render_tensors(64, seed)),
        text_encoder=wan.text_encoder,
        tokenizer=wan.tokenizer,
        scheduler=wan.scheduler,
        transformer=wan.transformer,
        expand_timesteps=True,
    )
