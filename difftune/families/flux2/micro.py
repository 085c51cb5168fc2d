"""Micro FLUX.2 [dev]: a Mistral 3 language model and a FLUX.2 transformer with a guidance embedding over FLUX.2's
autoencoder."""

from diffusers import Flux2Pipeline, Flux2Transformer2DModel

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._latent_statistics import flux2_autoencoder
from difftune.toy.tiny import (
    FLUX2_LATENT_CHANNELS,
    FLUX2_TEXT_HIDDEN_SIZE,
    build_flow_scheduler,
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


def build_flux2_transformer(
    layers: tuple[int, int] = (1, 1),
    heads: int = 2,
    head_dim: int = 16,
    text_hidden_size: int = 3 * FLUX2_TEXT_HIDDEN_SIZE,
    guidance: bool = False,
) -> Flux2Transformer2DModel:
    """`layers` (double-stream, single-stream) FLUX.2 blocks over patched latents, reading the stacked states of
    three language-model layers; 4-D rotary axes (time, row, column, text position) of equal width. `guidance`: with
    a guidance embedding, as FLUX.2 [dev]."""
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * FLUX2_LATENT_CHANNELS,
        num_layers=layers[0],
        num_single_layers=layers[1],
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=text_hidden_size,
        timestep_guidance_channels=32,
        axes_dims_rope=(head_dim // 4,) * 4,
        guidance_embeds=guidance,
    )
