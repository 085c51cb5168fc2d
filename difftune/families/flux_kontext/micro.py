"""Micro FLUX.1 Kontext: FLUX.1's, with a guidance embedding (as Kontext [dev]), in its edit pipeline."""

from diffusers import FluxKontextPipeline

from difftune.families.flux import micro as flux
from difftune.families.flux.micro import autoencoder
from difftune.toy.micro import MicroSizes

__all__ = ["autoencoder", "pipeline"]


def pipeline(vae, sizes: MicroSizes):
    return flux.pipeline(vae, sizes, pipeline_class=FluxKontextPipeline, guidance=True)
