"""Micro FLUX.3: a Qwen3-VL language model (with its head, as FLUX.3 keeps it) read through a Qwen3-VL processor,
and a FLUX.3 transformer over FLUX.2's autoencoder, in FLUX.3's modular pipeline (its prompt upsampler left out)."""

from diffusers import Flux3Transformer2DModel

from difftune.families.flux.micro import RECIPE as FLUX_RECIPE
from difftune.families.flux3 import TEXT_LAYERS, template_ends
from difftune.toy.micro import MicroSizes, TinyBase
from difftune.toy.micro._latent_statistics import flux2_autoencoder
from difftune.toy.tiny import (
    FLUX2_LATENT_CHANNELS,
    FLUX2_TEXT_HIDDEN_SIZE,
    build_qwen3_vl_processor,
    build_qwen3_vl_text_encoder,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them).
SHIPPED_JOB = "flux3_lora.toml"
# tiny-flux3: Flux's recipe for FLUX.3's transformer (2 per-mode blocks each for the text and the image, 2 joint
# blocks) over tiny-flux2_klein's FLUX.2 autoencoder (the same kind: 8 channels, patched 2x2 into 32), reading the
# states of 8 of a 32-layer Qwen3-VL of width 32 that stays at its random init (its states cached once). Every caption
# is read in its pipeline's window of 80 tokens, padding included. At width 96 it drew the seen shapes at 0.958 after
# 2500 steps and 0.979 after 4000, but the default job made it forget the seen squares (forgetting 0.125-0.156, then
# 0.062-0.104 at seeds 0-2); it is width 128 and trains 5000 steps (seen shapes 0.990; the job forgets 0.042-0.083),
# about 1 s a step at batch 128 on 2 cores.
TINY_BASE = TinyBase(
    architecture=(
        "FLUX.3's architecture at toy size, from the same classes in its modular pipeline (`Flux3ModularPipeline`:\n"
        "`Flux3Transformer2DModel`, FLUX.2's `AutoencoderKLFlux2` with its batch norm over 2x2-patched latents, a\n"
        "32-layer `Qwen3VLForConditionalGeneration` read at layers 4, 8, ..., 32 through its chat template in windows\n"
        "of 80 tokens)"
    ),
    denoiser=lambda recipe: (
        f"transformer ({recipe.flux_layers[0]} per-mode blocks each for the text and the image, "
        f"{recipe.flux_layers[1]} joint blocks, width {recipe.flux_heads * 16})"
    ),
    recipe=FLUX_RECIPE
    | {"flux_layers": (2, 2), "flux_heads": 8, "language_model_width": 32, "train_text_encoder": False, "steps": 5000},
    autoencoders_from="tiny-flux2_klein",
)


def autoencoder(pixels):
    return flux2_autoencoder(pixels)


def pipeline(vae, sizes: MicroSizes):
    from difftune.families import FAMILIES

    width = sizes.language_model_width or FLUX2_TEXT_HIDDEN_SIZE
    processor = build_qwen3_vl_processor("")
    processor = build_qwen3_vl_processor("".join(template_ends(processor)))
    text_encoder = build_qwen3_vl_text_encoder(processor.tokenizer, width, layers=max(TEXT_LAYERS), with_head=True)
    family = FAMILIES["flux3"]
    modular = family.loading.modular_pipeline()
    modular.update_components(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=processor,
        transformer=build_flux3_transformer(
            sizes.flux_layers, sizes.flux_heads, text_hidden_size=len(TEXT_LAYERS) * width
        ),
    )
    return modular


def build_flux3_transformer(
    layers: tuple[int, int] = (1, 1), heads: int = 2, head_dim: int = 16, text_hidden_size: int = 8 * 16
) -> Flux3Transformer2DModel:
    """`layers` (per-mode, joint single) FLUX.3 blocks over patched latents, reading the stacked states of eight
    language-model layers; 4-D rotary axes (time, row, column, text position) of equal width."""
    return Flux3Transformer2DModel(
        in_channels=4 * FLUX2_LATENT_CHANNELS,
        cond_in_channels=4 * FLUX2_LATENT_CHANNELS,
        num_layers=layers[0],
        num_single_layers=layers[1],
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=text_hidden_size,
        timestep_channels=32,
        axes_dims_rope=(head_dim // 4,) * 4,
    )
