"""Micro Ideogram 4: a Qwen3-VL language model and two Ideogram 4 transformers (the second, reading no text, guides:
asymmetric guidance) over FLUX.2's autoencoder, its statistics in Ideogram 4's token order."""

from diffusers import FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._latent_statistics import flux2_autoencoder
from difftune.toy.tiny import (
    IDEOGRAM4_TEXT_LAYERS,
    QWEN3_VL_CHAT_TEMPLATE,
    QWEN_HIDDEN_SIZE,
    build_ideogram4_transformer,
    build_qwen3_tokenizer,
    build_qwen3_vl_text_encoder,
    ideogram4_token_channels,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "ideogram4_1024_lora.toml"
JOB_ON_MICRO = True


def autoencoder(pixels):
    return flux2_autoencoder(pixels, token_order=ideogram4_token_channels)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_qwen3_tokenizer()
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    layers = sizes.dit_layers or 1
    return Ideogram4Pipeline(
        vae=vae,
        text_encoder=build_qwen3_vl_text_encoder(tokenizer, width, layers=IDEOGRAM4_TEXT_LAYERS),
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000),
        transformer=build_ideogram4_transformer(layers, sizes.dit_heads, text_hidden_size=width),
        unconditional_transformer=build_ideogram4_transformer(layers, sizes.dit_heads, text_hidden_size=width),
    )
