"""Micro ERNIE-Image: a Mistral 3 language model without its head (`Mistral3Model`, as ERNIE-Image keeps Ministral 3)
and an ERNIE-Image transformer over FLUX.2's autoencoder; no prompt enhancer (`pe`), which training never runs."""

from diffusers import ErnieImagePipeline

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._latent_statistics import flux2_autoencoder
from difftune.toy.tiny import (
    FLUX2_TEXT_HIDDEN_SIZE,
    build_ernie_image_transformer,
    build_mistral3_text_encoder,
    build_mistral_tokenizer,
    build_sd3_scheduler,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "ernie_image_1024_lora.toml"
JOB_ON_MICRO = True
TEXT_LAYERS = 3  # the pipeline reads the second-to-last layer's states: 3 layers give it one below and one above


def autoencoder(pixels):
    return flux2_autoencoder(pixels)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or FLUX2_TEXT_HIDDEN_SIZE
    tokenizer = build_mistral_tokenizer(bos=True)
    return ErnieImagePipeline(
        vae=vae,
        text_encoder=build_mistral3_text_encoder(tokenizer, width, layers=TEXT_LAYERS, with_head=False),
        tokenizer=tokenizer,
        scheduler=build_sd3_scheduler(),  # one shift at every size: the pipeline passes its sigmas, never a mu
        transformer=build_ernie_image_transformer(sizes.dit_layers or 1, sizes.dit_heads, text_hidden_size=width),
    )
