"""Micro Z-Image: a Qwen3 text encoder and a Z-Image transformer over a 16-channel KL autoencoder."""

from diffusers import ZImagePipeline

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.tiny import (
    QWEN_HIDDEN_SIZE,
    build_qwen3_text_encoder,
    build_qwen3_tokenizer,
    build_z_image_scheduler,
    build_z_image_transformer,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them).
SHIPPED_JOB = "z_image_lora.toml"


def autoencoder(pixels):
    return kl_autoencoder(pixels, sixteen_channels=True)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_qwen3_tokenizer()
    return ZImagePipeline(
        vae=vae,
        text_encoder=build_qwen3_text_encoder(tokenizer, width),
        tokenizer=tokenizer,
        scheduler=build_z_image_scheduler(),
        transformer=build_z_image_transformer(sizes.dit_layers or 1, heads=sizes.dit_heads, text_hidden_size=width),
    )
