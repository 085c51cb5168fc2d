"""Micro FLUX.2 [dev]: a Mistral 3 language model and a FLUX.2 transformer with a guidance embedding over FLUX.2's
autoencoder."""

from diffusers import Flux2Pipeline

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._latent_statistics import flux2_autoencoder
from difftune.toy.tiny import (
    FLUX2_TEXT_HIDDEN_SIZE,
    build_flow_scheduler,
    build_flux2_transformer,
    build_mistral3_text_encoder,
    build_mistral_tokenizer,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "flux2_dev_1024_lora.toml"
JOB_ON_MICRO = True


def autoencoder(pixels):
    return flux2_autoencoder(pixels)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or FLUX2_TEXT_HIDDEN_SIZE
    tokenizer = build_mistral_tokenizer()
    return Flux2Pipeline(
        vae=vae,
        text_encoder=build_mistral3_text_encoder(tokenizer, width),
        tokenizer=tokenizer,
        scheduler=build_flow_scheduler(),
        transformer=build_flux2_transformer(
            sizes.flux_layers, sizes.flux_heads, text_hidden_size=3 * width, guidance=True
        ),
    )
