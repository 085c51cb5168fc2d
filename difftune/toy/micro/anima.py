"""Micro Anima: a Qwen3 language model (without its head, as Anima keeps Qwen3 0.6B), a T5 tokenizer for the text
conditioner's queries, Anima's text conditioner and a Cosmos-Predict2 transformer over Qwen-Image's autoencoder, in
Anima's modular pipeline."""

from difftune.families.modular import ModularBase
from difftune.toy.micro import MicroSizes
from difftune.toy.micro._latent_statistics import qwen_autoencoder
from difftune.toy.tiny import (
    QWEN_HIDDEN_SIZE,
    build_anima_text_conditioner,
    build_cosmos_transformer,
    build_qwen3_text_encoder,
    build_qwen3_tokenizer,
    build_sd3_scheduler,
    build_t5_tokenizer,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "anima_1024_lora.toml"
JOB_ON_MICRO = True


def autoencoder(pixels):
    return qwen_autoencoder(pixels)


def pipeline(vae, sizes: MicroSizes):
    from difftune.families import FAMILIES

    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer, t5_tokenizer = build_qwen3_tokenizer(), build_t5_tokenizer()
    text_encoder = build_qwen3_text_encoder(tokenizer, width)
    text_conditioner = build_anima_text_conditioner(width, width, len(t5_tokenizer))
    family: ModularBase = FAMILIES["anima"]
    modular = family.modular_pipeline()
    modular.update_components(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        t5_tokenizer=t5_tokenizer,
        text_conditioner=text_conditioner,
        transformer=build_cosmos_transformer(sizes.dit_layers or 1, sizes.dit_heads, text_hidden_size=width),
        scheduler=build_sd3_scheduler(),  # Anima's: one shift (3) at every size
    )
    return modular
