"""`model.training_adapter`: a LoRA merged into the base for training only, never into what the run saves (ai-toolkit's
`assistant_lora_path`, musubi-tuner's `--base_weights`).

A step-distilled base (Z-Image Turbo, FLUX.1 [schnell]) drifts from its distillation when an adapter is trained on
it directly. Its de-distilling "training adapter" merged in gives a base that trains like an undistilled one; the
adapter trained over it is saved alone and applies to the distilled base, which keeps its few-step sampling.

Training runs on the merged weights (peft's merge through diffusers' `fuse_lora`, as `difftune merge` does), so a
step costs what it costs without one. Previews show what the saved adapter does on the distilled base: the training
adapter's change is taken off again at each of its layers' outputs while they sample (`without_merged_changes`), as
ai-toolkit samples with the assistant inverted; exact up to rounding.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from difftune.adapters import export
from difftune.errors import DifftuneError
from difftune.models.components import Components, explained_load_errors


@dataclass
class LowRankChange:
    """One layer's merged change: `scale * up(down(x))`, with the adapter's own down and up layers (linear or conv)."""

    down: torch.nn.Module
    up: torch.nn.Module
    scale: float


def adapter_file(name: str) -> Path:
    """A local file, or `owner/repo/file.safetensors` fetched from the hub."""
    if Path(name).is_file():
        return Path(name)
    parts = name.split("/")
    if Path(name).exists() or len(parts) < 3 or not name.endswith(".safetensors"):
        raise DifftuneError(
            f"model.training_adapter {name}: not an adapter file; give a local .safetensors file or "
            "`owner/repo/file.safetensors` on the hub"
        )
    from huggingface_hub import hf_hub_download

    with explained_load_errors("model.training_adapter", name):
        return Path(hf_hub_download("/".join(parts[:2]), "/".join(parts[2:])))


def merge_training_adapter(components: Components, name: str) -> dict[str, LowRankChange]:
    """Merge the adapter file `name` into the denoiser; its change per layer (module name -> change), for
    `without_merged_changes`."""
    from peft.tuners.lora import LoraLayer

    path = adapter_file(name)
    export.apply_adapters(components, [(path, 1.0)])
    denoiser_part = components.family.denoiser_name
    changes = {}
    for part, model in components.parts().items():
        for module_name, layer in model.named_modules() if model is not None else ():
            if not isinstance(layer, LoraLayer) or not layer.lora_A:
                continue
            adapter = next(iter(layer.lora_A))
            if part != denoiser_part or layer.use_dora.get(adapter):
                raise DifftuneError(
                    f"model.training_adapter {name}: adapts "
                    f"{part}.{module_name}{' with DoRA' if part == denoiser_part else ''}"
                    f"; a training adapter is a LoRA on the {denoiser_part} alone"
                )
            changes[module_name] = LowRankChange(
                copy.deepcopy(layer.lora_A[adapter]),
                copy.deepcopy(layer.lora_B[adapter]),
                float(layer.scaling[adapter]),
            )
    if not changes:
        raise DifftuneError(f"model.training_adapter {name}: a LoRA file (LoHa and LoKr are not training adapters)")
    pipeline = components.pipeline()
    pipeline.fuse_lora(components=[denoiser_part], lora_scale=1.0)
    pipeline.unload_lora_weights()
    return changes


@contextmanager
def without_merged_changes(denoiser: torch.nn.Module, changes: dict[str, LowRankChange]):
    """The denoiser as if the training adapter were not merged into it: each of its layers' outputs less the change."""
    device = next(denoiser.parameters()).device
    handles = []
    for module_name, change in changes.items():
        down, up = change.down.to(device), change.up.to(device)

        def subtract(module, args, output, down=down, up=up, scale=change.scale):
            delta = up(down(args[0].to(down.weight.dtype)))
            return output - (scale * delta).to(output.dtype)

        handles.append(denoiser.get_submodule(module_name).register_forward_hook(subtract))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
