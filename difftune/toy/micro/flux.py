"""Micro FLUX.1: CLIP and T5 text encoders and a Flux transformer over a 16-channel KL autoencoder."""

from diffusers import FluxPipeline

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.tiny import (
    build_flow_scheduler,
    build_flux_transformer,
    build_t5_encoder,
    build_t5_tokenizer,
    build_text_encoder,
    build_tokenizer,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them).
SHIPPED_JOB = "flux_lora.toml"


def autoencoder(pixels):
    return kl_autoencoder(pixels, sixteen_channels=True)


def pipeline(vae, sizes: MicroSizes, pipeline_class=FluxPipeline, guidance: bool = False):
    """`pipeline_class` and `guidance` (a guidance embedding besides `sizes.guidance`): FLUX.1 Kontext's too."""
    text_encoder, tokenizer = build_text_encoder(), build_tokenizer()
    t5_tokenizer = build_t5_tokenizer()
    return pipeline_class(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=build_t5_encoder(len(t5_tokenizer)),
        tokenizer_2=t5_tokenizer,
        transformer=build_flux_transformer(sizes.flux_layers, sizes.flux_heads, guidance=sizes.guidance or guidance),
        scheduler=build_flow_scheduler(),
    )
