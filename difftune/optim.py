"""Optimizers by name from one table, and learning-rate schedules (diffusers' `get_scheduler`)."""

from __future__ import annotations

import importlib.util
import math

import torch
from diffusers.optimization import get_scheduler

from difftune.config import OptimConfig
from difftune.errors import DifftuneError


def _adamw(groups, config: OptimConfig, device: torch.device):
    # fused is fastest where torch has the kernel (CUDA and CPU: 4.2x foreach's speed for a LoRA's 128 tensors on
    # 2 CPU cores, the same updates); foreach is the next best everywhere else.
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(
        groups, betas=config.betas, weight_decay=config.weight_decay, eps=config.eps, fused=fused, foreach=not fused
    )


def _adamw_8bit(groups, config: OptimConfig, device: torch.device):
    if importlib.util.find_spec("bitsandbytes") is None:
        raise DifftuneError(
            'optim.optimizer = "adamw_8bit" needs bitsandbytes: `pip install difftune[bnb]` (CUDA), or use "adamw"'
        )
    import bitsandbytes

    return bitsandbytes.optim.AdamW8bit(groups, betas=config.betas, weight_decay=config.weight_decay, eps=config.eps)


def _lion(groups, config: OptimConfig, device: torch.device):
    from lion_pytorch import Lion

    return Lion(groups, betas=config.betas, weight_decay=config.weight_decay)


def _adafactor(groups, config: OptimConfig, device: torch.device):
    from transformers.optimization import Adafactor

    # Our schedule sets the learning rate, so Adafactor's own relative steps and parameter scaling are off.
    return Adafactor(groups, scale_parameter=False, relative_step=False, warmup_init=False, weight_decay=config.weight_decay)


OPTIMIZERS = {"adamw": _adamw, "adamw_8bit": _adamw_8bit, "lion": _lion, "adafactor": _adafactor}


def build_optimizer(
    denoiser_params: list[torch.nn.Parameter], text_encoder_params: list[torch.nn.Parameter], config: OptimConfig, device,
    lr_scale: float = 1.0,
) -> torch.optim.Optimizer:
    """One parameter group for the denoiser and one for the text encoders, each at its own peak learning rate
    times `lr_scale` (`learning_rate_scale`)."""
    groups = [{"params": denoiser_params, "lr": config.learning_rate * lr_scale}]
    if text_encoder_params:
        groups.append({"params": text_encoder_params, "lr": config.text_encoder_learning_rate * lr_scale})
    return OPTIMIZERS[config.optimizer](groups, config, device)


def learning_rate_scale(rule: str, global_batch: int) -> float:
    """`optim.scale_lr`: the factor on the configured rates for this many images per optimizer step (linear: Goyal
    et al. 2017, as diffusers' and kohya's --scale_lr; sqrt: Krizhevsky 2014, the usual rule for Adam)."""
    return {"none": 1.0, "linear": float(global_batch), "sqrt": math.sqrt(global_batch)}[rule]


def build_lr_scheduler(optimizer, config: OptimConfig, max_steps: int, num_processes: int):
    # diffusers' "constant" ignores warmup steps; its "constant_with_warmup" is warmup then constant.
    name = "constant_with_warmup" if config.lr_schedule == "constant" else config.lr_schedule
    # accelerate steps a prepared scheduler once per process each optimizer step.
    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=config.warmup_steps * num_processes,
        num_training_steps=max_steps * num_processes,
        num_cycles=config.lr_cycles,
    )
