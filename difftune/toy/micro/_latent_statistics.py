"""The autoencoders that state their latents' per-channel statistics (Qwen-Image's and Wan's causal video
autoencoders) or normalise them by batch norm (FLUX.2's), set from the shapes' latents."""

from __future__ import annotations

import torch

from difftune.models.autoencoders import encode_posterior
from difftune.toy.tiny import (
    build_flux2_vae,
    build_qwen_vae,
    build_wan_vae,
    set_batch_norm_statistics,
    set_latent_statistics,
)


def with_latent_statistics(vae, pixels: torch.Tensor):
    """`vae` with `latents_mean` / `latents_std` of its latents of `pixels`, as Wan's autoencoder states them."""
    with torch.no_grad():
        set_latent_statistics(vae, encode_posterior(vae, pixels)[0])
    return vae


def qwen_autoencoder(pixels: torch.Tensor, wan: bool = False):
    """Qwen-Image's autoencoder (Krea 2's too), or Wan's (`wan`), with its latent statistics set."""
    return with_latent_statistics(build_wan_vae() if wan else build_qwen_vae(), pixels)


def flux2_autoencoder(pixels: torch.Tensor, token_order=None):
    """FLUX.2's autoencoder with its batch-norm statistics of the patched latents, reordered by `token_order` where
    the family's pipeline reads them in another (Ideogram 4's)."""
    vae = build_flux2_vae()
    with torch.no_grad():
        latents = encode_posterior(vae, pixels)[0]
        set_batch_norm_statistics(vae, token_order(latents) if token_order else latents)
    return vae
