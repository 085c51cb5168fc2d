"""Micro FLUX.2 [klein]: a deep Qwen3 language model (its think block in the template) and a FLUX.2 transformer
over FLUX.2's autoencoder."""

from diffusers import Flux2KleinPipeline

from difftune.toy.micro import MicroSizes
from difftune.toy.micro.flux2 import autoencoder
from difftune.toy.tiny import (
    FLUX2_TEXT_HIDDEN_SIZE,
    build_flow_scheduler,
    build_flux2_transformer,
    build_qwen3_text_encoder,
    build_qwen3_tokenizer,
)

__all__ = ["autoencoder", "pipeline"]

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them).
SHIPPED_JOB = "flux2_klein_lora.toml"


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or FLUX2_TEXT_HIDDEN_SIZE
    tokenizer = build_qwen3_tokenizer(think_block=True)
    if sizes.text_tokens:
        tokenizer.model_max_length = sizes.text_tokens
    return Flux2KleinPipeline(
        vae=vae,
        text_encoder=build_qwen3_text_encoder(tokenizer, width, layers=27, causal_lm=True),
        tokenizer=tokenizer,
        scheduler=build_flow_scheduler(),
        transformer=build_flux2_transformer(sizes.flux_layers, sizes.flux_heads, text_hidden_size=3 * width),
    )
