"""Micro Chroma: a T5 text encoder and a Chroma transformer over a 16-channel KL autoencoder."""

from diffusers import ChromaPipeline

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.tiny import build_chroma_transformer, build_flow_scheduler, build_t5_encoder, build_t5_tokenizer

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them).
SHIPPED_JOB = "chroma_lora.toml"


def autoencoder(pixels):
    return kl_autoencoder(pixels, sixteen_channels=True)


def pipeline(vae, sizes: MicroSizes):
    tokenizer = build_t5_tokenizer()
    return ChromaPipeline(
        vae=vae,
        text_encoder=build_t5_encoder(len(tokenizer)),
        tokenizer=tokenizer,
        transformer=build_chroma_transformer(sizes.flux_layers, sizes.flux_heads),
        scheduler=build_flow_scheduler(),
    )
