"""Single files that hold a denoiser alone, as ComfyUI, BFL and the quantizers ship them, read without a whole-model
copy in another dtype.

A file's tensors are read where they lie: a `.safetensors` file memory-mapped (safetensors' `load_file`), its fp8
weights with the scale each is multiplied by (1 in a plain `*_fp8_e4m3fn` file, the `.scale_weight` of ComfyUI's
`*_fp8_scaled` files); a GGUF file (city96's quantizations, which ComfyUI-GGUF reads) mapped too, its quantized
weights in their blocks. Whoever loads them makes each weight in its load dtype one tensor at a time
(`DenoiserFile.weight`), keeps an fp8 weight as the file holds it where the run stores the denoiser in fp8 anyway
(`storage.keep_fp8`), or a GGUF weight quantized, dequantized as its layer runs (diffusers' `GGUFLinear`). A 12B
FLUX.1 scaled file then costs its 12 GB of mapped pages, where unscaling it whole took a 24 GB bf16 copy besides.

The family converts the file's names to diffusers' (its `diffusers_names`, often diffusers' own converter, which
splits fused q/k/v rows, swaps halves and renames). That conversion is run once, over codes that name each row of
each file tensor (spread over the tensor's shape without memory), never over the weights: each of diffusers' tensors
is then the file's rows it names, a view where they are one run of one tensor. So an fp8 tensor's scale follows its
rows, and a GGUF tensor's quantized blocks, which hold whole rows, are moved as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import NamedTuple

import torch
from safetensors.torch import load_file

from difftune.errors import DifftuneError
from difftune.memory.storage import FP8, STORED_LAYERS, drop_file_pages, file_mappings, keep_fp8
from difftune.models.dtypes import AS_STORED, PartDtypes

# What ComfyUI's and ai-toolkit's denoiser-alone files may put before the denoiser's own keys.
DENOISER_FILE_PREFIXES = ("model.diffusion_model.", "diffusion_model.")
SCALED_FP8_MARKER = "scaled_fp8"  # ComfyUI's key for a file whose fp8 weights carry per-tensor `.scale_weight`s
SCALE_SUFFIXES = (".scale_weight", ".scale_input")  # the weights' scales, and the inputs' (for ComfyUI's fp8 matmuls)
GGUF_SUFFIX = ".gguf"
ROW_BITS = 40  # a row code: the file tensor's index above these bits, the row below

Scale = float | torch.Tensor  # one number for the tensor, or one per row where its rows come from several tensors


class Rows(NamedTuple):
    """Where one of diffusers' tensors comes from: runs of rows of the file's tensors (key, first row, end row), in
    order, and its shape."""

    runs: list[tuple[str, int, int]]
    shape: torch.Size


class DenoiserFile(NamedTuple):
    """A denoiser-alone file's tensors under diffusers' names, as the file holds them (memory-mapped), and each fp8
    tensor's scale: the tensor times its scale is the weight."""

    tensors: dict[str, torch.Tensor]
    fp8_scales: dict[str, Scale]
    file_ranges: list[tuple[int, int]]  # where the file is mapped (`drop_file_pages`)

    def weight(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor `key` as the model's weight in `dtype`: an fp8 one times its scale in fp32, then rounded once, as
        ComfyUI computes it, and the file's pages it was read from let go."""
        tensor = self.tensors[key]
        if not tensor.is_floating_point() or tensor.dtype == dtype:
            return tensor
        if tensor.dtype != FP8:
            return tensor.to(dtype)
        weight = (tensor.float() * self.fp8_scales.get(key, 1.0)).to(dtype)
        drop_file_pages(tensor, self.file_ranges)
        return weight


def is_scaled_fp8(keys) -> bool:
    return SCALED_FP8_MARKER in keys or any(key.endswith(".scale_weight") for key in keys)


def is_gguf(path: str) -> bool:
    return path.endswith(GGUF_SUFFIX)


def read_denoiser_file(path: str, diffusers_names: Callable[[dict], dict]) -> DenoiserFile:
    """The denoiser's tensors of the `.safetensors` file at `path` under diffusers' names (`diffusers_names`: the
    family's conversion of the file's layout), without ComfyUI's prefixes; where keys carry a prefix, those alone (an
    all-in-one file's others are its text encoders and autoencoder)."""
    file = _denoiser_keys(load_file(path))
    tensors = {
        key: value for key, value in file.items() if key != SCALED_FP8_MARKER and not key.endswith(SCALE_SUFFIXES)
    }
    rows = converted_rows({key: tensor.shape for key, tensor in tensors.items()}, diffusers_names)
    converted = {key: _gathered(tensors, runs) for key, runs in rows.items()}
    scales = {}
    for key, (runs, shape) in rows.items():
        if converted[key].dtype == FP8:
            of_runs = [_file_scale(file, source) for source, _, _ in runs]
            scales[key] = of_runs[0] if len(set(of_runs)) == 1 else _row_scales(runs, of_runs, shape)
    return DenoiserFile(converted, scales, file_mappings() if scales else [])


def read_gguf_file(path: str, diffusers_names: Callable[[dict], dict]) -> dict[str, torch.Tensor]:
    """The denoiser's tensors of the GGUF file at `path` under diffusers' names: quantized ones as diffusers'
    `GGUFParameter`s (their blocks, as its `GGUFLinear` dequantizes them), f32 and f16 ones as tensors. Read through
    gguf's own reader, mapped copy-on-write: diffusers' `load_gguf_checkpoint` copies every tensor out of the file,
    which holds the whole file twice while it loads."""
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES, GGUFParameter
    from gguf import GGMLQuantizationType, GGUFReader

    plain = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
    file, quant_types = {}, {}
    for tensor in GGUFReader(path, mode="c").tensors:
        if tensor.tensor_type not in plain and tensor.tensor_type not in SUPPORTED_GGUF_QUANT_TYPES:
            raise DifftuneError(
                f"model.base {path}: tensor {tensor.name} is quantized as {tensor.tensor_type.name}, which diffusers' "
                f"GGUF layers do not read (they read {', '.join(t.name for t in SUPPORTED_GGUF_QUANT_TYPES)}); "
                "use another quantization of the model"
            )
        file[tensor.name] = torch.from_numpy(tensor.data)
        quant_types[tensor.name] = None if tensor.tensor_type in plain else tensor.tensor_type
    file, quant_types = _denoiser_keys(file), _denoiser_keys(quant_types)
    # A quantized tensor's rows are its logical rows (each holds whole blocks); the conversion sees logical shapes.
    shapes = {
        key: torch.Size(GGUFParameter(value, quant_type=quant_types[key]).quant_shape)
        if quant_types[key]
        else value.shape
        for key, value in file.items()
    }
    out = {}
    for key, rows in converted_rows(shapes, diffusers_names).items():
        quant_type = quant_types[rows.runs[0][0]]
        if any(quant_types[source] != quant_type for source, _, _ in rows.runs):
            raise DifftuneError(
                f"model.base {path}: {key} joins tensors quantized as different types; use a file "
                "quantized as one type per layer"
            )
        if quant_type is None:
            out[key] = _gathered(file, rows)
        else:  # its rows of blocks (the last dimension in bytes)
            data = _gathered(file, Rows(rows.runs, torch.Size((*rows.shape[:-1], file[rows.runs[0][0]].shape[-1]))))
            out[key] = GGUFParameter(data, quant_type=quant_type)
    return out


def load_denoiser_file(denoiser: torch.nn.Module, file: DenoiserFile, dtypes: PartDtypes) -> torch.nn.Module:
    """`denoiser` (built empty) with `file`'s weights in `dtypes.denoiser` (`AS_STORED`: as the file holds them, an
    fp8 file's in the compute dtype), made one tensor at a time. Where the run stores the denoiser in fp8
    (`dtypes.stored_fp8_computes_in`), an fp8 file's weights are kept as the file holds them, with their own scales."""
    kept = {}
    if dtypes.stored_fp8_computes_in is not None:
        layers = {f"{name}.weight" for name, module in denoiser.named_modules() if type(module) in STORED_LAYERS}
        kept = {key: scale for key, scale in file.fp8_scales.items() if key in layers and isinstance(scale, float)}

    def load_dtype(tensor: torch.Tensor) -> torch.dtype:
        if dtypes.denoiser != AS_STORED:
            return dtypes.denoiser
        return dtypes.others if tensor.dtype == FP8 else tensor.dtype

    weights = {
        key: tensor if key in kept else file.weight(key, load_dtype(tensor)) for key, tensor in file.tensors.items()
    }
    denoiser.load_state_dict(weights, strict=True, assign=True)
    for key, scale in kept.items():
        keep_fp8(denoiser.get_submodule(key.removesuffix(".weight")), scale, dtypes.stored_fp8_computes_in)
    return denoiser


def load_gguf_file(
    denoiser: torch.nn.Module, path: str, diffusers_names: Callable[[dict], dict], compute_dtype: torch.dtype
) -> torch.nn.Module:
    """`denoiser` (built empty) with the weights of the GGUF file at `path` (`read_gguf_file`): each quantized linear
    layer a diffusers `GGUFLinear` that keeps its weight in its quantized blocks and dequantizes it to
    `compute_dtype` as it runs; the rest in `compute_dtype`. diffusers' own GGUF loading (`from_single_file`)
    converts the original layout with the published models' widths written in (3072 for FLUX.1), so the layers
    are swapped in here as its quantizer swaps them."""
    from diffusers.quantizers.gguf.utils import (
        GGUFLinear,
        GGUFParameter,
        _replace_with_gguf_linear,
        dequantize_gguf_tensor,
    )

    weights = read_gguf_file(path, diffusers_names)
    # As diffusers' GGUF loading: the modules the model keeps in fp32 are dequantized and kept so.
    in_fp32 = list(denoiser._keep_in_fp32_modules or [])
    _replace_with_gguf_linear(denoiser, compute_dtype, weights, modules_to_not_convert=in_fp32)
    quantized = {f"{name}.weight" for name, layer in denoiser.named_modules() if isinstance(layer, GGUFLinear)}
    for key in quantized:  # its blocks, not the layer's shape: set as diffusers' quantizer sets them
        layer, name = key.rsplit(".", 1)
        denoiser.get_submodule(layer)._parameters[name] = weights.pop(key)
    # Quantized tensors of other layers (a modulation table, a pad token) are small: dequantized (diffusers would
    # hand their blocks to the layer as its values).
    weights = {
        key: (dequantize_gguf_tensor(value) if isinstance(value, GGUFParameter) else value).to(
            torch.float32 if any(module in key.split(".") for module in in_fp32) else compute_dtype
        )
        for key, value in weights.items()
    }
    loaded = denoiser.load_state_dict(weights, strict=False, assign=True)
    mismatched = [key for key in loaded.missing_keys if key not in quantized] + loaded.unexpected_keys
    if mismatched:
        raise DifftuneError(
            f"model.base {path}: not a {type(denoiser).__name__} of the shape model.single_file_config "
            f"gives: {', '.join(mismatched[:5])} ..."
        )
    return denoiser.requires_grad_(False)


def gguf_tensor_bytes(path: str) -> int:
    """The bytes of a GGUF file's tensors, as it loads (mapped) and stays: what its denoiser holds."""
    from gguf import GGUFReader

    return sum(int(tensor.n_bytes) for tensor in GGUFReader(path).tensors)


def gguf_tensor_names(path: str) -> set[str]:
    """The tensor names of a GGUF file, read from its header (the data is mapped, not read)."""
    from gguf import GGUFReader

    return {tensor.name for tensor in GGUFReader(path).tensors}


def converted_rows(shapes: dict[str, torch.Size], diffusers_names: Callable[[dict], dict]) -> dict[str, Rows]:
    """Where each of diffusers' tensors comes from, as `diffusers_names` converts tensors of `shapes`. Refused where
    the conversion does more than move whole rows (or reshape a vector, as Krea 2's modulation tables)."""
    keys = list(shapes)
    codes = {}
    for index, (key, shape) in enumerate(shapes.items()):
        row_codes = torch.arange(shape[0] if shape else 1, dtype=torch.int64) + (index << ROW_BITS)
        codes[key] = row_codes.view(-1, *[1] * (len(shape) - 1)).expand(shape) if shape else row_codes.reshape(())
    rows = {}
    for key, converted in diffusers_names(codes).items():
        first = converted[(slice(None),) + (0,) * (converted.dim() - 1)] if converted.dim() else converted.reshape(1)
        spread = first.view(-1, *[1] * (converted.dim() - 1)) if converted.dim() else first
        whole_rows = all(stride == 0 for stride in converted.stride()[1:]) or bool((converted == spread).all())
        if not whole_rows:
            first = converted.reshape(-1)  # elements of vectors, reshaped
        sources, row = first >> ROW_BITS, first & ((1 << ROW_BITS) - 1)
        source_shapes = [shapes[keys[index]] for index in sources.unique().tolist()]
        if (
            any(len(shape) > 1 for shape in source_shapes)
            if not whole_rows
            else any(shape[1:] != converted.shape[1:] for shape in source_shapes)
        ):
            raise DifftuneError(
                f"{key}: the conversion of this file's layout does more than move whole rows of its "
                "tensors; read a file in diffusers' layout"
            )
        breaks = [0, *((torch.nonzero((row.diff() != 1) | (sources.diff() != 0)).flatten() + 1).tolist()), len(first)]
        runs = [
            (keys[int(sources[start])], int(row[start]), int(row[stop - 1]) + 1) for start, stop in pairwise(breaks)
        ]
        rows[key] = Rows(runs, converted.shape)
    return rows


def _gathered(tensors: dict[str, torch.Tensor], rows: Rows) -> torch.Tensor:
    """The rows `rows` names: a view of the file's tensor (the tensor itself where it is all of it), several joined."""
    pieces = [
        tensors[source]
        if tensors[source].dim() == 0 or (start, stop) == (0, len(tensors[source]))
        else tensors[source][start:stop]
        for source, start, stop in rows.runs
    ]
    whole = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return whole if whole.shape == rows.shape else whole.reshape(rows.shape)


def _denoiser_keys(file: dict) -> dict:
    prefixed = [key for key in file if key.startswith(DENOISER_FILE_PREFIXES)]
    return {_unprefixed(key): file[key] for key in prefixed or file}


def _unprefixed(key: str) -> str:
    for prefix in DENOISER_FILE_PREFIXES:
        key = key.removeprefix(prefix)
    return key


def _file_scale(file: dict[str, torch.Tensor], key: str) -> float:
    scale = file.get(key.removesuffix(".weight") + ".scale_weight")
    return 1.0 if scale is None else scale.float().item()


def _row_scales(runs: list[tuple[str, int, int]], scales: list[float], shape: torch.Size) -> torch.Tensor:
    """One scale per row (per element of a reshaped vector), for a tensor joined from tensors of different scales."""
    per_row = torch.cat(
        [torch.full((stop - start,), scale) for (_, start, stop), scale in zip(runs, scales, strict=True)]
    )
    return per_row.view(shape) if len(per_row) == shape.numel() else per_row.view(-1, *[1] * (len(shape) - 1))
