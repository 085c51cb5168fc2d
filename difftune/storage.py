"""Frozen weights kept in 16 bits and computed in fp32: half the memory of fp32 weights, without 16-bit arithmetic,
which CPUs lacking AVX512-BF16 or AMX run up to 100x slower than fp32 (BENCHMARKS.md). Set by
`model.weight_dtype = "fp16" | "bf16"` with `train.mixed_precision = "no"`; it applies to the denoiser.

Each frozen linear or convolution layer holds its weight and bias in 16 bits, and a parametrization hands the
layer an fp32 copy each time it runs. The input's gradient needs that weight again in backward, and autograd
would keep every fp32 copy until then: both precisions at once, more memory than fp32 alone. So while
training's forward runs under `fp32_copies_saved_as_stored()`, each copy autograd saves is saved as its 16-bit
source and cast again in backward. The price is two casts of every frozen weight per step, at memory bandwidth:
on 2 CPU cores the SD1.5 UNet's 256 px LoRA step went from 4.69 to 6.06 s while peak RSS went from 4684 to
3430 MB (BENCHMARKS.md). diffusers' `enable_layerwise_casting` does the forward half only, and its backward
fails on the SD1.5 UNet ("expected scalar type Float but found Half").
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch.nn.utils import parametrize

STORED_LAYERS = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
MADV_DONTNEED = 4

# Storage address of each live fp32 copy -> the 16-bit tensor it was cast from. An entry leaves with its copy.
_SOURCES: dict[int, torch.Tensor] = {}


class _CastBuffers:
    """fp32 buffers the casts reuse, by element count. A fresh buffer costs a page fault per 4 KiB: casting a
    118 MB convolution weight took 116 ms into new memory and 10 ms into a used buffer. A buffer is free when
    nothing but this pool holds its storage (counted by torch, so a copy that autograd or anything else still
    holds is never overwritten); the pool holds about one buffer per weight shape (580 MiB for SD1.5's UNet)."""

    def __init__(self):
        self.by_size: dict[tuple[int, torch.device], list[torch.Tensor]] = {}

    def cast(self, stored: torch.Tensor) -> torch.Tensor:
        buffers = self.by_size.setdefault((stored.numel(), stored.device), [])
        free = next((buffer for buffer in buffers if _holders(buffer) == 1), None)
        if free is None:
            free = torch.empty(stored.numel(), dtype=torch.float32, device=stored.device)
            buffers.append(free)
        return free.view(stored.shape).copy_(stored)


def _holders(tensor: torch.Tensor) -> int:
    """How many tensors (views, autograd's saved copies) hold `tensor`'s storage, itself included."""
    storage = tensor.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) - 1  # less the `storage` object made here


_BUFFERS = _CastBuffers()


class ComputedInFP32(torch.nn.Module):
    """Parametrization: a layer's 16-bit stored tensor, as the fp32 tensor the layer computes with."""

    def forward(self, stored: torch.Tensor) -> torch.Tensor:
        computed = _BUFFERS.cast(stored)
        address = computed.untyped_storage().data_ptr()
        _SOURCES[address] = stored
        weakref.finalize(computed, _SOURCES.pop, address, None)
        return computed


def store_frozen_layers(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Keep the weight and bias of every frozen linear and convolution layer of `model` in `dtype`, computed in
    fp32. Left alone: trained layers, adapters' own layers (frozen too when an adapter is loaded to sample) and
    quantized layers (other classes). Returns how many layers are stored."""
    adapters = {id(sub) for layer in model.modules() if isinstance(layer, BaseTunerLayer)
                for name in layer.adapter_layer_names for sub in getattr(layer, name).modules()}
    file_ranges = _file_mappings()
    stored = 0
    for layer in list(model.modules()):
        if type(layer) not in STORED_LAYERS or layer.weight.requires_grad or id(layer) in adapters:
            continue
        for name in ("weight", "bias"):
            full = layer._parameters.get(name)
            if full is None:
                continue
            layer._parameters[name] = torch.nn.Parameter(full.detach().to(dtype), requires_grad=False)
            if sys.getrefcount(full) == 2:  # this loop holds the fp32 tensor alone: nothing reads it again
                _drop_file_pages(full, file_ranges)
            parametrize.register_parametrization(layer, name, ComputedInFP32(), unsafe=True)
        stored += 1
    return stored


class _Recast(NamedTuple):
    """A saved fp32 copy, held as its 16-bit source and the view autograd saved of the copy."""

    source: torch.Tensor
    size: torch.Size
    stride: tuple[int, ...]
    offset: int

    def tensor(self) -> torch.Tensor:
        return _BUFFERS.cast(self.source).as_strided(self.size, self.stride, self.offset)


def _pack(saved: torch.Tensor):
    if saved.dtype == torch.float32 and saved.layout == torch.strided:
        source = _SOURCES.get(saved.untyped_storage().data_ptr())
        if source is not None:
            return _Recast(source, saved.size(), saved.stride(), saved.storage_offset())
    return saved


def _unpack(packed):
    return packed.tensor() if isinstance(packed, _Recast) else packed


@contextmanager
def fp32_copies_saved_as_stored():
    """Around a forward pass whose backward will run: stored layers' fp32 copies are saved as 16 bits."""
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield


def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges of the files this process maps (Linux), such as safetensors' zero-copy loads."""
    maps = Path("/proc/self/maps")
    if not sys.platform.startswith("linux") or not maps.exists():
        return []
    ranges = []
    for line in maps.read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = fields[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def _drop_file_pages(tensor: torch.Tensor, file_ranges: list[tuple[int, int]]) -> None:
    """diffusers loads safetensors by mapping the file privately and using it in place; the pages read to make
    the 16-bit copy would stay in this process's RSS until every tensor of the file is gone, so converting a
    model would peak at its fp32 size plus its 16-bit size. Telling the kernel that this tensor's pages are not
    needed drops them now. Only for a tensor nothing holds any more (its caller checks): a dropped page of a
    private file mapping reads back as the file's bytes, so a weight changed in place would be reverted."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    if not any(low <= start and end <= high for low, high in file_ranges):
        return
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page  # whole pages inside the tensor
    if last > first:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED)
