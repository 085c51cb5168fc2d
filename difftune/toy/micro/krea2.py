"""Micro Krea 2: a Qwen3-VL language model (its tokenizer spells Qwen-Image's template, which Krea 2's prompts use)
and a Krea 2 transformer over Qwen-Image's autoencoder."""

from diffusers import Krea2Pipeline

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._latent_statistics import qwen_autoencoder
from difftune.toy.tiny import (
    KREA2_TEXT_LAYERS,
    QWEN_HIDDEN_SIZE,
    build_krea2_scheduler,
    build_krea2_transformer,
    build_qwen3_vl_text_encoder,
    build_qwen_tokenizer,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "krea2_1024_lora.toml"
JOB_ON_MICRO = True


def autoencoder(pixels):
    return qwen_autoencoder(pixels)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_qwen_tokenizer()
    return Krea2Pipeline(
        vae=vae,
        text_encoder=build_qwen3_vl_text_encoder(tokenizer, width),
        tokenizer=tokenizer,
        scheduler=build_krea2_scheduler(),
        transformer=build_krea2_transformer(sizes.dit_layers or 1, sizes.dit_heads, text_hidden_size=width),
        text_encoder_select_layers=tuple(range(1, KREA2_TEXT_LAYERS + 1)),
    )
