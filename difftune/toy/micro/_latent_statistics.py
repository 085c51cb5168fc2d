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


def qwen_autoencoder(pixels: torch.Tensor, wan: bool = False):
    """Qwen-Image's autoencoder (Krea 2's too), or Wan's (`wan`), with `latents_mean` / `latents_std` set."""
    vae = build_wan_vae() if wan else build_qwen_vae()
    with torch.no_grad():
        set_latent_statistics(vae, encode_posterior(vae, pixels)[0])
    return vae


def flux2_autoencoder(pixels: torch.Tensor, token_order=None):
    """FLUX.2's autoencoder with its batch-norm statistics of the patched latents, reordered by `token_order` where
    the family's pipeline reads them in another (Ideogram 4's)."""
    vae = build_flux2_vae()
    with torch.no_grad():
        latents = encode_posterior(vae, pixels)[0]
        set_batch_norm_statistics(vae, token_order(latents) if token_order else latents)
    return vae
