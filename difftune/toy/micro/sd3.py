"""Micro SD3.5: CLIP-L and CLIP-G (narrower here, their widths side by side under T5's), T5 and an MMDiT over a
16-channel KL autoencoder."""

from diffusers import StableDiffusion3Pipeline

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.tiny import (
    build_sd3_scheduler,
    build_sd3_transformer,
    build_t5_encoder,
    build_t5_tokenizer,
    build_text_encoder,
    build_tokenizer,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them).
SHIPPED_JOB = "sd3_lora.toml"


def autoencoder(pixels):
    return kl_autoencoder(pixels, sixteen_channels=True)


def pipeline(vae, sizes: MicroSizes):
    t5_tokenizer = build_t5_tokenizer()
    return StableDiffusion3Pipeline(
        vae=vae,
        text_encoder=build_text_encoder(32, 32),
        tokenizer=build_tokenizer(),
        text_encoder_2=build_text_encoder(24, 24),
        tokenizer_2=build_tokenizer(),
        text_encoder_3=build_t5_encoder(len(t5_tokenizer)),
        tokenizer_3=t5_tokenizer,
        transformer=build_sd3_transformer(sizes.dit_layers or 2, sizes.dit_heads, pooled_size=32 + 24),
        scheduler=build_sd3_scheduler(),
    )
