"""Gradient checkpointing of a diffusers denoiser's blocks: their activations recomputed in the backward pass instead
of kept through it."""

from __future__ import annotations

import torch
import torch.utils.checkpoint


def enable_gradient_checkpointing(denoiser: torch.nn.Module) -> None:
    """diffusers' switch, with a checkpoint function that passes keyword arguments on to the block: diffusers' own
    passes positional ones alone, and some transformers hand their blocks keywords (HunyuanImage 2.1's attention mask
    and rotary embedding: a TypeError with diffusers' function)."""
    denoiser.enable_gradient_checkpointing(_checkpointed)


def _checkpointed(block, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False, **kwargs)
