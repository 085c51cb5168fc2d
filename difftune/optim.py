"""Optimizers by name from one table, and learning-rate schedules (diffusers' `get_scheduler`)."""

from __future__ import annotations

import functools
import math

import torch
from diffusers.optimization import get_scheduler

from difftune.config import OptimConfig
from difftune.errors import DifftuneError, require_extra


def _adamw(groups, config: OptimConfig, device: torch.device):
    # fused is fastest where torch has the kernel (CUDA and CPU: 4.2x foreach's speed for a LoRA's 128 tensors on
    # 2 CPU cores, the same updates); foreach is the next best everywhere else.
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(
        groups, betas=config.betas, weight_decay=config.weight_decay, eps=config.eps, fused=fused, foreach=not fused
    )


def _adamw_8bit(groups, config: OptimConfig, device: torch.device):
    _require("bitsandbytes", "bnb", "adamw_8bit")
    import bitsandbytes

    return bitsandbytes.optim.AdamW8bit(groups, betas=config.betas, weight_decay=config.weight_decay, eps=config.eps)


def _lion(groups, config: OptimConfig, device: torch.device):
    from lion_pytorch import Lion

    return Lion(groups, betas=config.betas, weight_decay=config.weight_decay)


def _adafactor(groups, config: OptimConfig, device: torch.device):
    from transformers.optimization import Adafactor

    # Our schedule sets the learning rate, so Adafactor's own relative steps and parameter scaling are off.
    return Adafactor(groups, scale_parameter=False, relative_step=False, warmup_init=False, weight_decay=config.weight_decay)


def _adamw_cpu_offload(groups, config: OptimConfig, device: torch.device):
    # torchao keeps the optimizer state (2x the trained weights for AdamW) in CPU memory and steps there, overlapped
    # with the GPU's work: a full fine-tune then needs about the weights and gradients alone on the device.
    if device.type != "cuda":
        raise DifftuneError(
            f'optim.optimizer = "adamw_cpu_offload" moves the optimizer state from a CUDA device to the CPU; this run is '
            f'on {device}, where it would move nothing: use "adamw"'
        )
    _require("torchao", "torchao", "adamw_cpu_offload")
    from torchao.optim import CPUOffloadOptimizer

    return CPUOffloadOptimizer(
        groups, torch.optim.AdamW, offload_gradients=False, fused=True, betas=config.betas,
        weight_decay=config.weight_decay, eps=config.eps,
    )


def _galore_adamw(groups, config: OptimConfig, device: torch.device):
    # GaLore (Zhao et al. 2024) keeps AdamW's moments in a rank-r projection of each weight matrix's gradient,
    # refreshed by SVD every `galore_update_proj_gap` steps; other tensors (convolutions, norms, biases) step as usual.
    _require("galore_torch", "galore", "galore_adamw")
    projected = {"rank": config.galore_rank, "update_proj_gap": config.galore_update_proj_gap,
                 "scale": config.galore_scale, "proj_type": "std"}
    split = []
    for group in groups:
        matrices = [p for p in group["params"] if p.dim() == 2]
        others = [p for p in group["params"] if p.dim() != 2]
        split += [{**group, "params": others}, {**group, "params": matrices, **projected}]
    return _resumable_galore()([group for group in split if group["params"]], betas=config.betas,
                               weight_decay=config.weight_decay, eps=config.eps, no_deprecation_warning=True)


@functools.cache
def _resumable_galore():
    """galore_torch's GaLoreAdamW, whose state keeps each matrix's projector as a Python object: checkpoints hold
    its matrix alone (the rest is the parameter group's settings), so they load with `torch.load(weights_only=True)`
    and resume exactly."""
    from galore_torch import GaLoreAdamW
    from galore_torch.galore_projector import GaLoreProjector

    class ResumableGaLoreAdamW(GaLoreAdamW):
        def state_dict(self):
            state = super().state_dict()
            for key, entry in state["state"].items():
                if isinstance(entry.get("projector"), GaLoreProjector):
                    state["state"][key] = {**entry, "projector": {"ortho_matrix": entry["projector"].ortho_matrix}}
            return state

        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict)
            for group in self.param_groups:
                for param in group["params"]:
                    saved = self.state.get(param, {}).get("projector")
                    if isinstance(saved, dict):
                        projector = GaLoreProjector(
                            group["rank"], update_proj_gap=group["update_proj_gap"], scale=group["scale"],
                            proj_type=group["proj_type"],
                        )
                        projector.ortho_matrix = saved["ortho_matrix"]
                        self.state[param]["projector"] = projector

    return ResumableGaLoreAdamW


def _require(module: str, extra: str, optimizer: str) -> None:
    require_extra(module, extra, f'optim.optimizer = "{optimizer}"', 'use "adamw"')


OPTIMIZERS = {
    "adamw": _adamw, "adamw_8bit": _adamw_8bit, "lion": _lion, "adafactor": _adafactor,
    "adamw_cpu_offload": _adamw_cpu_offload, "galore_adamw": _galore_adamw,
}


def build_optimizer(
    denoiser_params: list[torch.nn.Parameter], text_encoder_params: list[torch.nn.Parameter], config: OptimConfig, device,
    lr_scale: float = 1.0,
) -> torch.optim.Optimizer:
    """One parameter group for the denoiser and one for the text encoders, each at its own peak learning rate
    times `lr_scale` (`learning_rate_scale`)."""
    groups = [
        {"params": denoiser_params, "lr": config.learning_rate * lr_scale},
        {"params": text_encoder_params, "lr": config.text_encoder_learning_rate * lr_scale},
    ]
    # A LoRA of the denoiser alone trains no text encoder; an embedding trains nothing in the denoiser.
    return OPTIMIZERS[config.optimizer]([group for group in groups if group["params"]], config, device)


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
