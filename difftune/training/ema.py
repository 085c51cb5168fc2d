"""An exponential moving average of the trained parameters, on diffusers' `EMAModel` (foreach updates)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from diffusers.training_utils import EMAModel

from difftune.config import EmaConfig


def build_ema(parameters: list[torch.nn.Parameter], config: EmaConfig) -> EMAModel | None:
    if not config.enabled:
        return None
    ema = EMAModel(
        parameters,
        decay=config.decay,
        # Without warmup the decay is constant: min_decay = decay pins diffusers' (1 + t) / (10 + t) ramp.
        min_decay=0.0 if config.warmup else config.decay,
        use_ema_warmup=config.warmup,
        power=config.power,
        foreach=True,
    )
    if config.offload_to_cpu:
        ema.to("cpu")
    return ema


def update_ema(ema: EMAModel, parameters: list[torch.nn.Parameter], config: EmaConfig) -> None:
    if config.offload_to_cpu:
        ema.to(parameters[0].device, non_blocking=True)
    ema.step(parameters)
    if config.offload_to_cpu:
        ema.to("cpu", non_blocking=True)


@contextmanager
def ema_weights(ema: EMAModel, parameters: list[torch.nn.Parameter]):
    """Swap the EMA weights into the model for the block (to evaluate or save them), then swap back."""
    ema.store(parameters)
    ema.copy_to(parameters)
    try:
        yield
    finally:
        ema.restore(parameters)
