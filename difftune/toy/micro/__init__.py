"""Each family's micro pipeline: random weights at a few hundred thousand parameters, built from diffusers' and
transformers' config classes, so every family trains, saves and reloads in CI with no downloads.

Each family's folder holds its micro builder, `families/<family>/micro.py` (toy tooling kept beside its family: only
the toy imports it, .importlinter), with two functions: `autoencoder(pixels)` builds the family's autoencoder and sets
its latent statistics from `pixels` (the shapes renders), and `pipeline(vae, sizes)` builds the text encoders and the
denoiser around it, in that order (a seed's random draws depend on it). A family that ships a bundled tiny base
(`models/tiny-<family>`) says how it is built in `TINY_BASE`: its recipe, its autoencoder or the base it borrows one
from, its model card's lines. What several families' builders share is here and in toy/tiny.py; `build_pipeline` and
the tiny-base builder find a family's by its name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

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
    text_tokens: int | None = None  # FLUX.2 [klein]'s, LTX-2's tokenizer's `model_max_length` (None: the pipeline's)
    caption_words: bool = False  # Qwen-Image's tokenizer spells each caption word in one token


@dataclass(frozen=True)
class TinyBase:
    """How a family's bundled tiny base (`models/tiny-<family>`) is built by `scripts/make_tiny_base.py --family
    <family>`: its micro pipeline's classes at the sizes of `recipe`, trained on the shapes (toy/tiny_base.py). A
    family module that ships one says so in `TINY_BASE`."""

    architecture: str  # the model card's first lines: the real model's architecture, at toy size
    denoiser: Callable  # the card's line for the denoiser, from the `tiny_base.Recipe`
    recipe: dict = field(default_factory=dict)  # the `tiny_base.Recipe` fields that differ from its defaults
    autoencoders_from: str = ""  # a built base whose autoencoders it reuses (the same kind), else its own trained
    autoencoder: dict = field(default_factory=dict)  # `tiny_base.train_vae`'s settings for its own autoencoder
    # A video base's own autoencoder, fresh (trained on clips from its random init); None: from its lender's stills
    clip_autoencoder: Callable | None = None
    text_note: str = ""  # a video base's card: what its text encoder is and how it stays
    edit_recipe: dict | None = None  # the edit base built from it (scripts/make_tiny_edit_base.py), if any
    inpaint_recipe: dict | None = None  # the inpainting base built from it (scripts/make_tiny_inpaint_base.py), if any


def two_stream_transformer(recipe) -> str:
    """The card's line for Flux.1's kind of transformer."""
    return (
        f"transformer ({recipe.flux_layers[0]} double- and {recipe.flux_layers[1]} single-stream blocks, "
        f"width {recipe.flux_heads * 16})"
    )


def mmdit(recipe) -> str:
    return f"transformer ({recipe.dit_layers} MMDiT blocks, width {recipe.dit_heads * 16})"


def unet(recipe) -> str:
    return f"UNet (block channels {recipe.unet_block_out_channels})"


def tiny_base_of(family: str) -> TinyBase | None:
    """The family's tiny base, if it ships one."""
    return getattr(builder(family), "TINY_BASE", None)


def builder(family: str):
    """The family's micro builder module."""
    if family not in FAMILY_NAMES:
        raise ValueError(f"{family!r}: not a family ({', '.join(FAMILY_NAMES)})")
    return importlib.import_module(f"difftune.families.{family}.micro")


def build_pipeline(seed: int = 0, *, family: str, guidance: bool = False):
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
