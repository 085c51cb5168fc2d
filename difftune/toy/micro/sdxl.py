"""Micro SDXL: two CLIP text encoders (the second pooled) and an SDXL UNet over a 4-channel KL autoencoder."""

from diffusers import StableDiffusionXLPipeline

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.tiny import (
    TEXT_2_HIDDEN_SIZE,
    TEXT_2_PROJECTION_SIZE,
    build_noise_scheduler,
    build_text_encoder,
    build_tokenizer,
    build_unet,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them).
SHIPPED_JOB = "sdxl_lora.toml"


def autoencoder(pixels):
    return kl_autoencoder(pixels, sixteen_channels=False)


def pipeline(vae, sizes: MicroSizes):
    text_encoder, tokenizer = build_text_encoder(), build_tokenizer()
    return StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=build_text_encoder(TEXT_2_HIDDEN_SIZE, TEXT_2_PROJECTION_SIZE),
        tokenizer_2=build_tokenizer(),
        unet=build_unet(sizes.unet_block_out_channels, sdxl=True),
        scheduler=build_noise_scheduler(),
        # Trained with empty-caption dropout, not SDXL's zeroed embeddings: "" is what an empty prompt means.
        force_zeros_for_empty_prompt=False,
        add_watermarker=False,
    )
