"""Frozen weights stored in fewer bits than they are computed in: 16 bits computed in fp32 (`model.weight_dtype =
"fp16" | "bf16"` with `train.mixed_precision = "no"`: half the memory of fp32 weights, without 16-bit arithmetic,
which CPUs lacking AVX512-BF16 or AMX run up to 100x slower than fp32: docs/benchmarks.md), or fp8 (e4m3) computed in
the run's compute dtype (`model.weight_dtype = "fp8"`, any mixed precision: a quarter of fp32's memory, half of bf16's,
as kohya's `--fp8_base` and musubi-tuner's `--fp8_base`). It applies to the denoiser.

Each frozen linear or convolution layer holds its weight (and, in 16 bits, its bias) in the stored dtype, and a
parametrization hands the layer a copy in the compute dtype each time it runs. The input's gradient needs that
weight again in backward, and autograd would keep every computed copy until then: both precisions at once, more
memory than the compute dtype alone. So while training's forward runs under `computed_copies_saved_as_stored()`,
each copy autograd saves is saved as its stored source and cast again in backward. The price is two casts of every
frozen weight per step, at memory bandwidth: on 2 CPU cores the SD1.5 UNet's 256 px LoRA step went from 4.69 to
6.06 s while peak RSS went from 4684 to 3430 MB with 16-bit storage (docs/benchmarks.md). diffusers'
`enable_layerwise_casting` does the forward half only, and its backward fails on the SD1.5 UNet ("expected scalar
type Float but found Half").

fp8 weights are stored divided by a per-tensor power of two that brings the largest magnitude to within e4m3's
range (448): plain casting rounds the typical weight (|w| ~ 0.01-0.05) into e4m3's subnormals, below 2^-6, with one
to three significant bits, or to zero (docs/benchmarks.md measures both). A power of two, unlike ComfyUI's float scales,
multiplies back exactly in any compute dtype, so training on fp8 storage is exactly training on the base rounded
the same way.

Block offloading (offload.py) keeps some of these layers' stored tensors in host memory, through the same
parametrization and the same saved-tensor hooks.
"""

from __future__ import annotations

import ctypes
import math
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
FP8 = torch.float8_e4m3fn
MADV_DONTNEED = 4

# Each live computed copy's storage (`storage_key`) -> (its stored source, the parametrization that cast it). An
# entry leaves with its copy.
_SOURCES: dict[int, tuple[torch.Tensor, ComputedFromStored]] = {}


class _CastBuffers:
    """Buffers the casts reuse, by element count and dtype. A fresh buffer costs a page fault per 4 KiB: casting a
    118 MB convolution weight took 116 ms into new memory and 10 ms into a used buffer. A buffer is free when
    nothing but this pool holds its storage (counted by torch, so a copy that autograd or anything else still
    holds is never overwritten); the pool holds about one buffer per weight shape (580 MiB for SD1.5's UNet)."""

    def __init__(self):
        self.by_size: dict[tuple[int, torch.device, torch.dtype], list[torch.Tensor]] = {}

    def cast(self, stored: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
        buffers = self.by_size.setdefault((stored.numel(), stored.device, dtype), [])
        free = next((buffer for buffer in buffers if _holders(buffer) == 1), None)
        if free is None:
            free = torch.empty(stored.numel(), dtype=dtype, device=stored.device)
            buffers.append(free)
        computed = free.view(stored.shape).copy_(stored)
        return computed.mul_(scale) if scale != 1 else computed


def storage_key(tensor: torch.Tensor) -> int:
    """The address of `tensor`'s storage object, shared by its views: unique on any device, where the data's
    address is not (every meta tensor's is 0, and plan.py runs training steps on the meta device)."""
    return tensor.untyped_storage()._cdata


def _holders(tensor: torch.Tensor) -> int:
    """How many tensors (views, autograd's saved copies) hold `tensor`'s storage, itself included."""
    storage = tensor.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) - 1  # less the `storage` object made here


_BUFFERS = _CastBuffers()


@contextmanager
def own_cast_buffers():
    """A pool of cast buffers of the block's own (plan.py: each plan counts the buffers its run would make)."""
    global _BUFFERS
    kept, _BUFFERS = _BUFFERS, _CastBuffers()
    try:
        yield
    finally:
        _BUFFERS = kept


_LAST_CAST: list | None = None  # while `casts_reused`: [parametrization, stored tensor, its computed copy]


@contextmanager
def casts_reused():
    """While adapters are attached to stored layers: a layer's computed copy is made once and handed out again for
    as long as that layer is the one asked for. peft reads a layer's weight about eight times as it wraps it (its
    device, its dtype), each read a cast of the whole weight: minutes for a 12B model. One copy is held at a time."""
    global _LAST_CAST
    _LAST_CAST = [None, None, None]
    try:
        yield
    finally:
        _LAST_CAST = None


class ComputedFromStored(torch.nn.Module):
    """Parametrization: a layer's stored tensor as the `dtype` tensor the layer computes with. An fp8 tensor is
    held as its raw bytes (uint8) divided by `scale`: `Module.to(dtype)`, which the run applies to the whole
    denoiser, casts every floating-point tensor, fp8 included, and leaves bytes alone."""

    def __init__(self, dtype: torch.dtype, scale: float = 1.0, fp8: bool = False):
        super().__init__()
        self.dtype, self.scale, self.fp8 = dtype, scale, fp8
        # Set by offload.py when the stored tensor lives in host memory: the layer then holds an empty placeholder
        # on the device, and the offloader hands over the stored tensor's copy on the device.
        self.offloader = None

    def source(self, stored: torch.Tensor) -> torch.Tensor:
        if self.offloader is not None:
            stored = self.offloader.on_device(self)
        return stored.view(FP8) if self.fp8 else stored

    def cast(self, stored: torch.Tensor) -> torch.Tensor:
        if _LAST_CAST is not None and _LAST_CAST[0] is self and _LAST_CAST[1] is stored:
            return _LAST_CAST[2]
        source = self.source(stored)
        if source.dtype == self.dtype and self.scale == 1:  # an offloaded block kept in the compute dtype: its copy
            return source  # on the device is already what the layer computes with, and a cast buffer would stay
        computed = _BUFFERS.cast(source, self.dtype, self.scale)
        if _LAST_CAST is not None:
            _LAST_CAST[:] = [self, stored, computed]
        return computed

    def forward(self, stored: torch.Tensor) -> torch.Tensor:
        computed = self.cast(stored)
        address = storage_key(computed)
        _SOURCES[address] = (stored, self)
        weakref.finalize(computed, _SOURCES.pop, address, None)
        return computed


def fp8_scale(tensor: torch.Tensor) -> float:
    """The power of two `tensor` is divided by to be stored in e4m3: its largest magnitude lands in (224, 448]."""
    largest = tensor.abs().max().item()
    return 2.0 ** math.ceil(math.log2(largest / torch.finfo(FP8).max)) if largest > 0 else 1.0


def _stored(
    tensor: torch.Tensor, dtype: torch.dtype, compute_dtype: torch.dtype
) -> tuple[torch.Tensor, ComputedFromStored]:
    if dtype != FP8:
        return tensor.to(dtype), ComputedFromStored(compute_dtype)
    scale = fp8_scale(tensor)
    # Divided in fp32 whatever the loaded dtype: the bytes are those of the fp32-loaded base's, bit for bit.
    return (tensor.float() / scale).to(FP8).view(torch.uint8), ComputedFromStored(compute_dtype, scale, fp8=True)


def store_frozen_layers(model: torch.nn.Module, dtype: torch.dtype, compute_dtype: torch.dtype = torch.float32) -> int:
    """Keep every frozen linear and convolution layer of `model` in `dtype`, computed in `compute_dtype`: weight
    and bias in 16 bits; in fp8 the weight alone (a bias is a thousandth of a layer's bytes and would lose the most
    to e4m3's 3-bit mantissa), the bias following the model's dtype. Left alone: trained layers, adapters' own
    layers (frozen too when an adapter is loaded to sample) and quantized layers (other classes). Returns how many
    layers are stored."""
    adapters = {
        id(sub)
        for layer in model.modules()
        if isinstance(layer, BaseTunerLayer)
        for name in layer.adapter_layer_names
        for sub in getattr(layer, name).modules()
    }
    file_ranges = file_mappings()
    stored = 0
    for layer in list(model.modules()):
        if type(layer) not in STORED_LAYERS or layer.weight.requires_grad or id(layer) in adapters:
            continue
        for name in ("weight",) if dtype == FP8 else ("weight", "bias"):
            full = layer._parameters.get(name)
            if full is None:
                continue
            kept, parametrization = _stored(full.detach(), dtype, compute_dtype)
            layer._parameters[name] = torch.nn.Parameter(kept, requires_grad=False)
            # Only where this loop holds the full tensor alone (nothing reads it again) and the kept one is a copy:
            # a layer loaded in its storage dtype keeps the file's pages themselves.
            if sys.getrefcount(full) == 2 and kept.untyped_storage().data_ptr() != full.untyped_storage().data_ptr():
                drop_file_pages(full, file_ranges)
            parametrize.register_parametrization(layer, name, parametrization, unsafe=True)
        stored += 1
    return stored


def computed_tensors(model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """`model`'s parameters and buffers of `names` that it has (plain names, `down_blocks.0.resnets.0.conv1.weight`),
    a stored layer's as it computes (its compute dtype, an fp8 weight times its scale): what a copy started from the
    model reads (a ControlNet from its denoiser), whichever way its frozen layers are kept; only these are computed."""
    tensors = {}
    for name in names:
        holder, _, tensor = name.rpartition(".")
        try:
            value = getattr(model.get_submodule(holder), tensor, None)
        except AttributeError:  # a module the model lacks
            continue
        if isinstance(value, torch.Tensor):
            tensors[name] = value.detach()
    return tensors


def keep_fp8(layer: torch.nn.Module, scale: float, compute_dtype: torch.dtype) -> None:
    """Store `layer`'s fp8 weight as it is (an fp8 file's tensor, memory-mapped: no copy), computed in
    `compute_dtype` as the weight times `scale` (denoiser_files.py: a ComfyUI scaled file's own float scale; fp8
    times a float scale, rounded once, in any compute dtype, as ComfyUI reads it)."""
    weight = layer._parameters["weight"]
    layer._parameters["weight"] = torch.nn.Parameter(weight.detach().view(torch.uint8), requires_grad=False)
    parametrize.register_parametrization(
        layer, "weight", ComputedFromStored(compute_dtype, scale, fp8=True), unsafe=True
    )


class _Recast(NamedTuple):
    """A saved computed copy, held as its stored source, its parametrization and the view autograd saved of it."""

    source: torch.Tensor
    parametrization: ComputedFromStored
    size: torch.Size
    stride: tuple[int, ...]
    offset: int

    def tensor(self) -> torch.Tensor:
        return self.parametrization.cast(self.source).as_strided(self.size, self.stride, self.offset)


def _pack(saved: torch.Tensor):
    if saved.layout == torch.strided:
        source, parametrization = _SOURCES.get(storage_key(saved), (None, None))
        if source is not None and saved.dtype == parametrization.dtype:
            return _Recast(source, parametrization, saved.size(), saved.stride(), saved.storage_offset())
    return saved


def _unpack(packed):
    return packed.tensor() if isinstance(packed, _Recast) else packed


@contextmanager
def computed_copies_saved_as_stored():
    """Around a forward pass whose backward will run: stored layers' computed copies are saved as stored."""
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield


def file_mappings() -> list[tuple[int, int]]:
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


def drop_file_pages(tensor: torch.Tensor, file_ranges: list[tuple[int, int]]) -> None:
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
