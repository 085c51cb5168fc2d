"""Block offloading (`model.offload_blocks`): the frozen weights of some of the denoiser's blocks live in host
memory, and each layer's weight reaches the device only while the layer computes, in forward and again in backward.

It is built on storage.py's layers, which already compute from a stored tensor through a parametrization: an
offloaded layer's stored tensor moves to host memory, the layer keeps an empty placeholder on the device (so
`Module.to`, accelerate and DDP see nothing of it), and its parametrization asks the `Offloader` below for the
stored tensor's copy on the device. Backward needs the weights again; `computed_copies_saved_as_stored()` saves each
one as its placeholder and copies it again when backward reads it. diffusers' group offloading swaps `param.data`
instead: the views autograd saves keep every block's device copy alive until backward (it saves memory in
training only with gradient checkpointing), and its disk path swaps in empty tensors, which is exact only because
those views survive. Here offloading saves the same memory with or without checkpointing.

On CUDA the copies come from page-locked memory on a stream of their own: when a layer of block k first computes,
the next block (in the order forward runs them; in backward the one before) is copied while block k computes, and
the layer waits for its copy's event before using it. Elsewhere the same copies run in line, which is how the CPU
tests check that every offloaded layer computes exactly what it computes in place.
"""

from __future__ import annotations

import weakref
from contextlib import nullcontext
from typing import NamedTuple

import torch

from difftune.memory.storage import ComputedFromStored

ALIGNMENT = 64  # bytes between tensors in a block's host buffer: any dtype's view starts aligned


class _Staged(NamedTuple):
    """A block's copies on the device, by layer, and the event that marks them written (None in line)."""

    tensors: dict[ComputedFromStored, torch.Tensor]
    ready: torch.cuda.Event | None


class Offloader:
    """The host-memory side of the offloaded blocks of one model, and the copies of them on `device`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.hosts: dict[ComputedFromStored, torch.Tensor] = {}
        self.block_of: dict[ComputedFromStored, int] = {}
        self.layers: list[list[ComputedFromStored]] = []
        self.buffers: list[torch.Tensor] = []  # page-locked on CUDA until the offloader goes
        if self.stream is not None:
            weakref.finalize(self, _unlock, self.buffers)
        self.order: list[int] = []  # blocks in the order forward first ran them
        self.staged: dict[int, _Staged] = {}
        self.current: tuple[int, bool] | None = None  # the block computing, and whether in backward
        self.copies = {"prefetched": 0, "in_line": 0}  # how each layer's copy was made, for tests and benchmarks

    def add(self, block: torch.nn.Module) -> None:
        """Move the stored tensors of `block`'s stored layers (storage.py) to one host buffer, leaving empty
        placeholders in the layers. A block at a time, so the host holds one block twice at most."""
        registered = [
            (parametrizations[0], parametrizations)
            for module in block.modules()
            for parametrizations in getattr(module, "parametrizations", {}).values()
            if isinstance(parametrizations[0], ComputedFromStored)
        ]
        buffer, hosts = _host_buffer([owner.original.detach() for _, owner in registered])
        if self.stream is not None:  # asynchronous copies need page-locked sources
            _page_lock(buffer)
        self.buffers.append(buffer)
        self.layers.append([layer for layer, _ in registered])
        for (layer, owner), host in zip(registered, hosts, strict=True):
            self.hosts[layer], self.block_of[layer] = host, len(self.layers) - 1
            owner.original.data = torch.empty(0, dtype=host.dtype, device=host.device)
            layer.offloader = self

    @property
    def host_bytes(self) -> int:
        return sum(host.numel() * host.element_size() for host in self.hosts.values())

    def on_device(self, layer: ComputedFromStored) -> torch.Tensor:
        """`layer`'s stored tensor on the device, for the compute stream."""
        block = self.block_of[layer]
        backward = torch._C._current_graph_task_id() != -1
        if (block, backward) != self.current:  # a block starts its part of a pass
            self.current = (block, backward)
            if not backward and block not in self.order:
                self.order.append(block)
            self._prefetch(block, self._next(block, backward))
        staged = self.staged.get(block)
        if staged is None:
            self.copies["in_line"] += 1
            return self._copy(self.hosts[layer])
        self.copies["prefetched"] += 1
        copy = staged.tensors[layer]
        if staged.ready is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(staged.ready)
            copy.record_stream(compute)  # its memory is not reused before the compute stream is done with it
        return copy

    def _next(self, block: int, backward: bool) -> int | None:
        """The block that runs after `block`: the next one forward ran, or in backward the one before."""
        if block not in self.order:
            return None
        position = self.order.index(block) + (-1 if backward else 1)
        return self.order[position] if 0 <= position < len(self.order) else None

    def _prefetch(self, current: int, block: int | None) -> None:
        """Copy `block` while `current` computes. Staged copies stay while their block is current or next, so the
        last block forward ran serves the first block of backward, and the first of backward the next forward:
        at most two blocks are on the device."""
        for stale in set(self.staged) - {current, block}:
            del self.staged[stale]
        if block is None or block in self.staged:
            return
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            tensors = {layer: self._copy(self.hosts[layer]) for layer in self.layers[block]}
            ready = torch.cuda.Event() if self.stream is not None else None
            if ready is not None:
                ready.record(self.stream)
        self.staged[block] = _Staged(tensors, ready)

    def _copy(self, host: torch.Tensor) -> torch.Tensor:
        return torch.empty(host.shape, dtype=host.dtype, device=self.device).copy_(host, non_blocking=True)


def offload_blocks(blocks: list[torch.nn.Module], device: torch.device) -> Offloader:
    """Keep the stored layers (storage.py) of `blocks` in host memory; the returned offloader copies them to
    `device` as the layers compute."""
    offloader = Offloader(device)
    for block in blocks:
        offloader.add(block)
    return offloader


def spread(count: int, total: int) -> list[int]:
    """`count` of `total` blocks' indices, spread evenly: offloaded blocks between kept ones give each copy a
    kept block's compute to hide behind."""
    return [int((index + 0.5) * total / count) for index in range(count)]


def _host_buffer(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Copies of `tensors` as views of one host buffer: one allocation a block, to page-lock at once."""
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // ALIGNMENT) * ALIGNMENT
    buffer = torch.empty(total, dtype=torch.uint8)
    views = [
        buffer[offset : offset + tensor.numel() * tensor.element_size()]
        .view(tensor.dtype)
        .view(tensor.shape)
        .copy_(tensor)
        for offset, tensor in zip(offsets, tensors, strict=True)
    ]
    return buffer, views


def _page_lock(buffer: torch.Tensor) -> None:
    """Register `buffer` with CUDA as page-locked, in place. torch's `pin_memory()` would copy it into its
    caching host allocator, which rounds every allocation up to a power of two: up to twice a block's bytes."""
    if buffer.numel():
        error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister of {buffer.numel()} bytes failed (error {int(error)})")


def _unlock(buffers: list[torch.Tensor]) -> None:
    for buffer in buffers:
        if buffer.numel():
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
