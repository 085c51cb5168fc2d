"""Each family's micro pipeline: random weights at a few hundred thousand parameters, built from diffusers' and
transformers' config classes, so every family trains, saves and reloads in CI with no downloads.

One module per family, named as the family (`config.FAMILY_NAMES`), with two functions: `autoencoder(pixels)` builds
the family's autoencoder and sets its latent statistics from `pixels` (the shapes renders), and
`pipeline(vae, sizes)` builds the text encoders and the denoiser around it, in that order (a seed's random draws
depend on it). Adding a family adds its module here; `build_pipeline` finds it by name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from difftune.config import FAMILY_NAMES
from difftune.toy.tiny import render_tensors


@dataclass(frozen=True)
class MicroSizes:
    """What a caller may change of a micro pipeline (each family reads the sizes it has)."""

    unet_block_out_channels: tuple[int, ...] = (32, 64)
    flux_layers: tuple[int, int] = (1, 1)  # double- and single-stream blocks
    flux_heads: int = 2
    guidance: bool = False  # Flux with a guidance embedding (FLUX.1 Kontext always has one, as Kontext [dev])
    dit_layers: int | None = None  # blocks of a transformer counted in one number (None: the family's micro count)
    dit_heads: int = 2
    language_model_width: int | None = None  # its language model's (None: the family's micro width)
    text_tokens: int | None = None  # FLUX.2 [klein]'s tokenizer's `model_max_length` (None: the pipeline's 512)
    caption_words: bool = False  # Qwen-Image's tokenizer spells each caption word in one token


def builder(family: str):
    """The family's micro builder module."""
    if family not in FAMILY_NAMES:
        raise ValueError(f"{family!r}: not a family ({', '.join(FAMILY_NAMES)})")
    return importlib.import_module(f"{__name__}.{family}")


def build_pipeline(seed: int = 0, family: str = "sd", guidance: bool = False):
    """A random-init micro pipeline of `family`; its autoencoder's latent statistics are those of `shape_images`'
    latents, the way SD's 0.18215 was chosen (Flux: its shift factor their mean, as Flux.1's 0.1159). `guidance`:
    Flux with a guidance embedding."""
    torch.manual_seed(seed)
    family_builder = builder(family)
    return family_builder.pipeline(family_builder.autoencoder(render_tensors(64, seed)), MicroSizes(guidance=guidance))


def assemble_tiny_pipeline(vae, family: str, **sizes):
    """Random text encoders and denoiser of `family` around `vae` (a trained one: the tiny bases'), at `sizes`
    (`MicroSizes`' fields)."""
    return builder(family).pipeline(vae, MicroSizes(**sizes))
