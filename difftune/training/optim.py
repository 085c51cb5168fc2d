"""Optimizers by name from one table, their parameter groups (per part, and LoRA+'s faster B matrices), and
learning-rate schedules (diffusers' `get_scheduler`).

Prodigy and schedule-free AdamW come from their authors' packages (extras). Schedule-free AdamW has no schedule:
it warms up itself, and the weights to evaluate and save are its averaged ones, which `averaged_weights` swaps in.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager

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
    return Adafactor(
        groups, scale_parameter=False, relative_step=False, warmup_init=False, weight_decay=config.weight_decay
    )


def _adamw_cpu_offload(groups, config: OptimConfig, device: torch.device):
    # torchao keeps the optimizer state (2x the trained weights for AdamW) in CPU memory and steps there, overlapped
    # with the GPU's work: a full fine-tune then needs about the weights and gradients alone on the device.
    if device.type != "cuda":
        raise DifftuneError(
            'optim.optimizer = "adamw_cpu_offload" moves the optimizer state from a CUDA device '
            f'to the CPU; this run is on {device}, where it would move nothing: use "adamw"'
        )
    _require("torchao", "torchao", "adamw_cpu_offload")
    from torchao.optim import CPUOffloadOptimizer

    return CPUOffloadOptimizer(
        groups,
        torch.optim.AdamW,
        offload_gradients=False,
        fused=True,
        betas=config.betas,
        weight_decay=config.weight_decay,
        eps=config.eps,
    )


def _galore_adamw(groups, config: OptimConfig, device: torch.device):
    # GaLore (Zhao et al. 2024) keeps AdamW's moments in a rank-r projection of each weight matrix's gradient,
    # refreshed by SVD every `galore_update_proj_gap` steps; other tensors (convolutions, norms, biases) step as usual.
    _require("galore_torch", "galore", "galore_adamw")
    projected = {
        "rank": config.galore_rank,
        "update_proj_gap": config.galore_update_proj_gap,
        "scale": config.galore_scale,
        "proj_type": "std",
    }
    split = []
    for group in groups:
        matrices = [p for p in group["params"] if p.dim() == 2]
        others = [p for p in group["params"] if p.dim() != 2]
        split += [{**group, "params": others}, {**group, "params": matrices, **projected}]
    return _resumable_galore()(
        [group for group in split if group["params"]],
        betas=config.betas,
        weight_decay=config.weight_decay,
        eps=config.eps,
        no_deprecation_warning=True,
    )


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
                            group["rank"],
                            update_proj_gap=group["update_proj_gap"],
                            scale=group["scale"],
                            proj_type=group["proj_type"],
                        )
                        projector.ortho_matrix = saved["ortho_matrix"]
                        self.state[param]["projector"] = projector

    return ResumableGaLoreAdamW


def _prodigy(groups, config: OptimConfig, device: torch.device):
    # Prodigy (Mishchenko & Defazio 2024) estimates the step size D itself; `learning_rate` multiplies it (1 is
    # the authors' advice). Bias correction and the warmup safeguard are what kohya's and OneTrainer's guides set.
    _require("prodigyopt", "prodigy", "prodigy")
    from prodigyopt import Prodigy

    return Prodigy(
        groups,
        betas=config.betas,
        weight_decay=config.weight_decay,
        eps=config.eps,
        decouple=True,
        use_bias_correction=True,
        safeguard_warmup=config.warmup_steps > 0,
        d_coef=config.prodigy_d_coef,
    )


def _adamw_schedule_free(groups, config: OptimConfig, device: torch.device):
    # Schedule-free AdamW (Defazio et al. 2024): its own warmup, no decay; its train/eval modes swap between the
    # point gradients are taken at and the average that is evaluated and saved (`averaged_weights`).
    _require("schedulefree", "schedulefree", "adamw_schedule_free")
    from schedulefree import AdamWScheduleFree

    optimizer = AdamWScheduleFree(
        groups,
        betas=config.betas,
        weight_decay=config.weight_decay,
        eps=config.eps,
        warmup_steps=config.warmup_steps,
    )
    optimizer.train()
    return optimizer


def _require(module: str, extra: str, optimizer: str) -> None:
    require_extra(module, extra, f'optim.optimizer = "{optimizer}"', 'use "adamw"')


OPTIMIZERS = {
    "adamw": _adamw,
    "adamw_8bit": _adamw_8bit,
    "lion": _lion,
    "adafactor": _adafactor,
    "adamw_cpu_offload": _adamw_cpu_offload,
    "galore_adamw": _galore_adamw,
    "prodigy": _prodigy,
    "adamw_schedule_free": _adamw_schedule_free,
}
SCHEDULE_FREE = ("adamw_schedule_free",)


def is_loraplus_b(name: str, param: torch.nn.Parameter) -> bool:
    """What LoRA+ (Hayou et al. 2024) steps faster: the B (up) matrices, and the vectors beside them (DoRA's
    magnitudes), as peft's `create_loraplus_optimizer` groups them."""
    return "lora_B" in name or param.dim() == 1


def build_optimizer(
    named: dict[str, torch.nn.Parameter],
    text_encoder_parts: tuple[str, ...],
    config: OptimConfig,
    device,
    lr_scale: float = 1.0,
) -> torch.optim.Optimizer:
    """One parameter group for the denoiser (or a ControlNet) and one for the text encoders (`text_encoder_parts`;
    parameters named `<part>.<name>`), each at its own
    peak learning rate times `lr_scale` (`learning_rate_scale`); with `optim.loraplus_ratio`, each split in two,
    the B matrices at that many times the rate. (peft's LoRA+ helper builds one model's optimizer; here two parts
    with their own rates share one.)"""
    groups = []
    for in_text_encoder, lr in ((False, config.learning_rate), (True, config.text_encoder_learning_rate)):
        part = {name: p for name, p in named.items() if (name.split(".")[0] in text_encoder_parts) == in_text_encoder}
        if config.loraplus_ratio:
            b_side = {name for name, p in part.items() if is_loraplus_b(name, p)}
            groups.append({"params": [p for name, p in part.items() if name not in b_side], "lr": lr * lr_scale})
            groups.append({"params": [part[name] for name in b_side], "lr": lr * lr_scale * config.loraplus_ratio})
        else:
            groups.append({"params": list(part.values()), "lr": lr * lr_scale})
    # A LoRA of the denoiser alone trains no text encoder; an embedding trains nothing in the denoiser.
    return OPTIMIZERS[config.optimizer]([group for group in groups if group["params"]], config, device)


@contextmanager
def averaged_weights(optimizer):
    """The weights to evaluate and save in place for the block: a schedule-free optimizer's average (its eval
    mode); any other optimizer's parameters as they are. Accelerate's wrapper passes `eval`/`train` on, or
    ignores them for optimizers without."""
    switch = callable(getattr(optimizer, "eval", None))
    if switch:
        optimizer.eval()
    try:
        yield
    finally:
        if switch:
            optimizer.train()


def learning_rate_scale(rule: str, global_batch: int) -> float:
    """`optim.scale_lr`: the factor on the configured rates for this many images per optimizer step (linear: Goyal
    et al. 2017, as diffusers' and kohya's --scale_lr; sqrt: Krizhevsky 2014, the usual rule for Adam)."""
    return {"none": 1.0, "linear": float(global_batch), "sqrt": math.sqrt(global_batch)}[rule]


def build_lr_scheduler(optimizer, config: OptimConfig, max_steps: int, num_processes: int):
    if config.optimizer in SCHEDULE_FREE:  # it warms up itself (config.py allows no other schedule)
        return get_scheduler("constant", optimizer)
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
