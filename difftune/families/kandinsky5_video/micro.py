"""Micro Kandinsky 5 video: the image model's micro text encoders and transformer (reading a conditioning clip beside
the noisy one, as the Lite video models) over HunyuanVideo's causal video autoencoder. Its tokenizer spells the video
template's system prompt in 131 tokens (Qwen2.5-VL's: 128, which the pipeline drops): the micro model reads the
template's last 3 before the caption."""

import torch
from diffusers import AutoencoderKLHunyuanVideo, Kandinsky5T2VPipeline

from difftune.families.kandinsky5.micro import parts
from difftune.families.kandinsky5_video import PROMPT_TEMPLATE
from difftune.models.autoencoders import encode_posterior
from difftune.toy.micro import MicroSizes
from difftune.toy.tiny import FLUX_LATENT_CHANNELS, set_latent_scaling

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "kandinsky5_video_lora.toml"
JOB_ON_MICRO = True


def autoencoder(pixels):
    vae = build_hunyuan_video_vae()
    with torch.no_grad():
        set_latent_scaling(vae, encode_posterior(vae, pixels)[0], shift=False)
    return vae


def pipeline(vae, sizes: MicroSizes):
    return Kandinsky5T2VPipeline(vae=vae, **parts(sizes, PROMPT_TEMPLATE, visual_cond=True))


def build_hunyuan_video_vae() -> AutoencoderKLHunyuanVideo:
    """HunyuanVideo's causal video autoencoder (Kandinsky 5's video models'), with three blocks: 4x in space (32 px
    -> 8x8 latents, like the other tiny autoencoders) and 4x in time (its smallest: clips of 4k + 1 frames)."""
    return AutoencoderKLHunyuanVideo(
        latent_channels=FLUX_LATENT_CHANNELS,
        down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3,
        block_out_channels=(8, 16, 16),
        layers_per_block=1,
        norm_num_groups=4,
        spatial_compression_ratio=4,
        temporal_compression_ratio=4,
        mid_block_add_attention=False,
    )
