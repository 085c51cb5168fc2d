"""Sharded training through accelerate's FSDP2: what the rest of the trainer needs to know about it.

Under FSDP2 (`accelerate launch --config_file configs/accelerate/fsdp.yaml`) every trained parameter is a
DTensor holding this process's shard. Three things follow, and they live here:
- gathering is collective: every process calls `gather` (a checkpoint, the final weights), then the main
  process alone writes what came back;
- loading a saved full tensor into a shard takes this process's slice of it (`load_full`);
- a forward pass on a sharded model is collective too, so work that only the main process does in the loop
  (validation, preview samples, adapter snapshots) cannot run there: `check_config` refuses it by name, and
  the end-of-run samples and exports use an unsharded copy the main process builds from the gathered weights;
- accelerate's FSDP2 prepares one model, so only the denoiser trains (`check_config` says so).
"""

from __future__ import annotations

import torch
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor, distribute_tensor

from difftune.config import Config
from difftune.errors import DifftuneError

FSDP_CONFIG = "configs/accelerate/fsdp.yaml"


def is_sharded(accelerator) -> bool:
    return accelerator.distributed_type == DistributedType.FSDP


def check_accelerator(accelerator) -> None:
    """FSDP2 is supported; FSDP1 and DeepSpeed are refused (their saves and resumes are not tested here)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise DifftuneError(
            f"DeepSpeed is not supported: its ZeRO engine saves and resumes through its own torch.save'd files "
            f"(mp_rank_*_model_states.pt, zero_pp_rank_*_optim_states.pt: pickles, which difftune never loads), and "
            f"exact resume is tested with DDP and FSDP2 only. FSDP2 shards what ZeRO-2/3 shard: use {FSDP_CONFIG} (or "
            f"configs/accelerate/multi_node_fsdp.yaml), or configs/accelerate/ddp.yaml"
        )
    if is_sharded(accelerator) and not accelerator.is_fsdp2:
        raise DifftuneError(
            f"FSDP version 1 is not supported: set `fsdp_version: 2` in the accelerate config (see {FSDP_CONFIG})"
        )


def check_config(config: Config) -> None:
    """Settings whose work runs on the main process alone during training, which a sharded model cannot do."""
    main_only = {
        "validation.path": config.validation.path,
        "sample.every_steps": config.sample.every_steps,
        "export.every_steps": config.export.every_steps,
    }
    refused = [name for name, value in main_only.items() if value]
    if refused:
        raise DifftuneError(
            f"{', '.join(refused)}: not supported with FSDP yet (that work runs on the main process alone, and a "
            f"sharded model runs forward on all processes together); leave it unset, or train with DDP"
        )
    if config.frozen_weights_kept_apart:
        raise DifftuneError(
            f"{config.frozen_weights_kept_apart}: not supported with FSDP (untested with sharded layers); leave "
            'weight_dtype "auto" and offload_blocks 0, or train with DDP'
        )
    if config.model.quantize != "none":
        raise DifftuneError(
            f'model.quantize = "{config.model.quantize}": not supported with FSDP (sharding quantized weights is '
            'untested here); set it to "none", or train on one process'
        )
    if config.adapter.trains_text_encoders:
        raise DifftuneError(
            'adapter.text_encoder = true and adapter.kind = "embedding" are not supported with FSDP (accelerate\'s '
            "FSDP2 prepares one model, the denoiser); train the text encoders with DDP"
        )


def gather(tensors: dict[str, torch.Tensor], keep: bool = True) -> dict[str, torch.Tensor]:
    """Full CPU copies of `tensors`; shards are gathered, which is collective: every process calls this, and
    those with `keep` false (all but the writer) get nothing back."""
    copies = {}
    for name, value in tensors.items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if keep:
            # copy=True: on CPU in fp32 `.to` would return the live tensor, which later steps change.
            copies[name] = full.detach().to("cpu", copy=True).contiguous()
    return copies


@torch.no_grad()
def load_full(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a full tensor into `target`, which may be a shard (then only this process's slice is taken)."""
    value = value.to(target.device, target.dtype)
    if isinstance(target, DTensor):
        value = distribute_tensor(value, target.device_mesh, target.placements)
    target.copy_(value)
