"""Micro FLUX.3: a Qwen3-VL language model (with its head, as FLUX.3 keeps it) read through a Qwen3-VL processor,
and a FLUX.3 transformer over FLUX.2's autoencoder, in FLUX.3's modular pipeline (its prompt upsampler left out)."""

from difftune.families.flux3 import TEXT_LAYERS, template_ends
from difftune.families.modular import ModularBase
from difftune.toy.micro import MicroSizes
from difftune.toy.micro._latent_statistics import flux2_autoencoder
from difftune.toy.tiny import (
    FLUX2_TEXT_HIDDEN_SIZE,
    build_flux3_transformer,
    build_qwen3_vl_processor,
    build_qwen3_vl_text_encoder,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "flux3_1024_lora.toml"
JOB_ON_MICRO = True


def autoencoder(pixels):
    return flux2_autoencoder(pixels)


def pipeline(vae, sizes: MicroSizes):
    from difftune.families import FAMILIES

    width = sizes.language_model_width or FLUX2_TEXT_HIDDEN_SIZE
    processor = build_qwen3_vl_processor("")
    processor = build_qwen3_vl_processor("".join(template_ends(processor)))
    text_encoder = build_qwen3_vl_text_encoder(processor.tokenizer, width, layers=max(TEXT_LAYERS), with_head=True)
    family: ModularBase = FAMILIES["flux3"]
    modular = family.modular_pipeline()
    modular.update_components(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=processor,
        transformer=build_flux3_transformer(
            sizes.flux_layers, sizes.flux_heads, text_hidden_size=len(TEXT_LAYERS) * width
        ),
    )
    return modular
