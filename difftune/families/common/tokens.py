"""Latents as the tokens of a transformer that reads 2x2 patches (Flux.1's, Qwen-Image's and the families built on
them): packed and unpacked as their pipelines do."""

from __future__ import annotations

import torch


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C): each 2x2 patch one token, as `FluxPipeline._pack_latents` and
    `QwenImagePipeline._pack_latents`."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of `pack`."""
    b, _, channels = tokens.shape
    return tokens.view(b, h // 2, w // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, channels // 4, h, w)
