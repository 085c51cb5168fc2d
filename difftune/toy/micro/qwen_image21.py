"""Micro Qwen-Image 2.1: a Qwen3-VL language model with its head (as Qwen-Image 2.1 keeps it) read through the
pipeline's processor, and a Qwen-Image 2.1 transformer over its own RGBA autoencoder at 16x."""

from diffusers import QwenImage21Pipeline

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._latent_statistics import with_latent_statistics
from difftune.toy.tiny import (
    QWEN_HIDDEN_SIZE,
    build_flow_scheduler,
    build_qwen3_vl_text_encoder,
    build_qwen_image21_processor,
    build_qwen_image21_transformer,
    build_qwen_image21_vae,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "qwen_image21_1024_lora.toml"
JOB_ON_MICRO = True
TEXT_LAYERS = 2  # the pipeline reads the last layer's states, before the final norm


def autoencoder(pixels):
    return with_latent_statistics(build_qwen_image21_vae(), pixels)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    processor = build_qwen_image21_processor()
    return QwenImage21Pipeline(
        vae=vae,
        text_encoder=build_qwen3_vl_text_encoder(processor.tokenizer, width, layers=TEXT_LAYERS, with_head=True),
        processor=processor,
        transformer=build_qwen_image21_transformer(sizes.dit_layers or 1, sizes.dit_heads, text_hidden_size=width),
        scheduler=build_flow_scheduler(),  # the resolution shift over the latent tokens, as the pipeline asks for
    )
