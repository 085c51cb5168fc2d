"""The KL autoencoder of the SD, Flux.1 and SD3-style micro families: latent scaling (and a shift for the 16-channel
ones) from the shapes' latents."""

from __future__ import annotations

import torch

from difftune.models.autoencoders import encode_posterior
from difftune.toy.tiny import FLUX_LATENT_CHANNELS, build_vae, set_latent_scaling


def kl_autoencoder(pixels: torch.Tensor, sixteen_channels: bool, downsampling: int = 4):
    """4 channels, scaled (SD's), or 16, scaled and shifted (Flux.1's); `downsampling` 4 (8 for Lumina 2's)."""
    vae = build_vae(latent_channels=FLUX_LATENT_CHANNELS if sixteen_channels else 4, downsampling=downsampling)
    return scaled_to(vae, pixels, shift=sixteen_channels)


def scaled_to(vae, pixels: torch.Tensor, shift: bool):
    """`vae` with its scaling (and, with `shift`, shift) factor set from its latents of `pixels`."""
    with torch.no_grad():
        latents = encode_posterior(vae, pixels)[0]  # (64, C, 8, 8)
    set_latent_scaling(vae, latents, shift=shift)
    return vae
