"""The text encoders and the denoiser on one GPU by turns, where it cannot hold them together: the samples a run draws
(previews, the end of the run, `difftune sample`) and its validation captions.

A run whose captions are cached keeps its text encoders in host memory, or drops them and loads them again at the end
(`encoder_placement`). Drawing a sample needs them on the device beside the denoiser, its adapters and their
optimizer state: LTX-2's Gemma 3 (14.6 GiB in fp8) beside its transformer (17.6 GiB) does not fit 24 GB, though
training it did. `taking_turns` gives each text encoder and each model that denoises (the denoiser, a ControlNet, a
pipeline's second transformer) an accelerate hook: before it computes, its group comes to the device, and where the
two groups do not fit together the other group goes to host memory first. The hooks are accelerate's `ModelHook`s, as
diffusers' `enable_model_cpu_offload` uses, so a pipeline reads its execution device from them and its inputs follow.
diffusers' model offloading moves every model each call, always; this moves only what the device cannot hold, and
`Module.to` moves parameters in place, so an optimizer's references to the adapters still hold.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from accelerate.utils import send_to_device
from torch.distributed.tensor import DTensor

HOST = torch.device("cpu")
# Free device memory kept beside the text encoders for what computes while they are there (the encoding's
# activations, the denoiser's step where both stay).
ROOM_TO_COMPUTE = 2 * 2**30


class Turns:
    """Groups of models (by name) taking turns on `device`: a group comes when one of its models computes; unless
    `together`, the groups there leave first."""

    def __init__(
        self, groups: dict[str, list[torch.nn.Module]], present: set[str], device: torch.device, together: bool
    ):
        self.groups, self.present, self.device, self.together = groups, present, device, together
        self.moves: list[tuple[str, torch.device]] = []  # each group moved, and where: what tests read

    def bring(self, group: str) -> None:
        if group in self.present:
            return
        if not self.together:
            for other in self.present:
                self._move(other, HOST)
            self.present.clear()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the freed blocks returned before the other group's arrive
        self._move(group, self.device)
        self.present.add(group)

    def _move(self, group: str, where: torch.device) -> None:
        for module in self.groups[group]:
            module.to(where)
        self.moves.append((group, where))


class _Turn(ModelHook):
    """A model's turn: its group on the device before it computes, its inputs sent there (`execution_device` is
    what diffusers' pipelines read their device from)."""

    def __init__(self, turns: Turns, group: str):
        self.turns, self.group, self.execution_device = turns, group, turns.device

    def pre_forward(self, module, *args, **kwargs):
        self.turns.bring(self.group)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)


def device_has_room(device: torch.device, needed: int) -> bool:
    """Whether `device` holds `needed` bytes more, with room to compute beside them (always, off CUDA: one memory)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return needed + ROOM_TO_COMPUTE <= free


def _bytes(modules: list[torch.nn.Module]) -> int:
    return sum(t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers()))


def _off(modules: list[torch.nn.Module], device: torch.device) -> list[torch.nn.Module]:
    """The modules with a parameter elsewhere than `device` ("cuda" and "cuda:0" alike where no index is given)."""
    return [m for m in modules if any(not _on(t.device, device) for t in m.parameters())]


def _on(where: torch.device, device: torch.device) -> bool:
    return where.type == device.type and (where.index is None or device.index is None or where.index == device.index)


@contextmanager
def taking_turns(text_encoders: list[torch.nn.Module], denoisers: list[torch.nn.Module], device: torch.device):
    """While the block runs, `text_encoders` not on `device` come to it when they compute, and `denoisers` leave it
    then where the device cannot hold both (`device_has_room`), coming back when they compute; afterwards every model
    is where it was. A model another hook already moves (a base loaded with a device map) leaves it all as it is."""
    text_encoders, denoisers = [m for m in text_encoders if m is not None], [m for m in denoisers if m is not None]
    arriving = _off(text_encoders, device)
    models = (*text_encoders, *denoisers)
    if not arriving or any(hasattr(m, "_hf_hook") or _sharded(m) for m in models):
        yield None
        return
    homes = {m: next(m.parameters()).device for m in models}
    together = device_has_room(device, _bytes(arriving))
    present = {"denoisers"} if not _off(denoisers, device) else set()
    turns = Turns({"text encoders": text_encoders, "denoisers": denoisers}, present, device, together)
    for group, modules in turns.groups.items():
        for module in modules:
            add_hook_to_module(module, _Turn(turns, group))
    # A family's own encoding may call a text encoder's parts rather than the whole (Qwen-Image 2.1's reads
    # `text_encoder.model`): each part brings its encoder too.
    bring_text = partial(_bring, turns, "text encoders")
    parts = [part.register_forward_pre_hook(bring_text) for m in text_encoders for part in m.modules() if part is not m]
    try:
        yield turns
    finally:
        for handle in parts:
            handle.remove()
        for module, home in homes.items():
            remove_hook_from_module(module)
            module.to(home)


def _bring(turns: Turns, group: str, module, inputs) -> None:
    turns.bring(group)


def _sharded(module: torch.nn.Module) -> bool:
    """Whether `module`'s parameters are shards (FSDP2's DTensors), which only their process group moves."""
    return any(isinstance(parameter, DTensor) for parameter in module.parameters())
