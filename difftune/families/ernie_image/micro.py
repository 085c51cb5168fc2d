"""Micro ERNIE-Image: a Mistral 3 language model without its head (`Mistral3Model`, as ERNIE-Image keeps Ministral 3)
and an ERNIE-Image transformer over FLUX.2's autoencoder; no prompt enhancer (`pe`), which training never runs."""

import torch
from diffusers import ErnieImagePipeline, ErnieImageTransformer2DModel

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._latent_statistics import flux2_autoencoder
from difftune.toy.tiny import (
    FLUX2_LATENT_CHANNELS,
    FLUX2_TEXT_HIDDEN_SIZE,
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


def build_ernie_image_transformer(
    layers: int = 1, heads: int = 2, head_dim: int = 16, text_hidden_size: int = FLUX2_TEXT_HIDDEN_SIZE
) -> ErnieImageTransformer2DModel:
    """ERNIE-Image's single-stream transformer over FLUX.2's patched latents (one token a latent pixel), its rotary
    axes (text position, row, column) in ERNIE-Image's proportions (32, 48, 48 of 128). Its class starts the shared
    modulation and the output layer at zero (a trained model's are not): drawn at random here, so the micro model's
    prediction depends on its input and its text."""
    model = ErnieImageTransformer2DModel(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_layers=layers,
        ffn_hidden_size=3 * heads * head_dim,
        in_channels=4 * FLUX2_LATENT_CHANNELS,
        out_channels=4 * FLUX2_LATENT_CHANNELS,
        text_in_dim=text_hidden_size,
        rope_axes_dim=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8),
    )
    for layer in (model.adaLN_modulation[-1], model.final_linear):
        torch.nn.init.normal_(layer.weight, std=0.02)
        torch.nn.init.normal_(layer.bias, std=0.02)
    return model
