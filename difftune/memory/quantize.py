"""QLoRA: the frozen denoiser's linear layers stored quantized, while the adapters on them train in fp32.

`int8` is torchao's weight-only int8 (per-channel scales); `nf4` is bitsandbytes' 4-bit NormalFloat with
double-quantized statistics, as in QLoRA (Dettmers et al. 2023). peft puts its LoRA and DoRA layers on both
(its torchao and bitsandbytes layer types). Convolutions keep their weights: neither library quantizes them.
Only the adapters are saved, so the files load on the unquantized base like any other.
"""

from __future__ import annotations

import warnings

import torch

from difftune.errors import require_extra

# peft says a torchao-quantized layer cannot merge its adapter: nothing here merges into a quantized base (merging
# and exports load the unquantized one), so the warning would only alarm.
warnings.filterwarnings("ignore", message="TorchaoLoraLinear was instantiated without")
# The library each method needs, and the extra that installs it.
NEEDS = {"int8": ("torchao", "torchao"), "nf4": ("bitsandbytes", "bnb")}


def quantize_linear_layers(
    model: torch.nn.Module, method: str, device: torch.device, compute_dtype: torch.dtype
) -> None:
    """Replace `model`'s linear weights by their `method` quantization, made on `device` (where the layers are
    moved; nf4 layers compute in `compute_dtype`)."""
    require_extra(*NEEDS[method], f'model.quantize = "{method}"', 'set "none"')
    linear = [name for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    for name in linear:
        model.get_submodule(name).to(device)
    if method == "int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda module, name: type(module) is torch.nn.Linear)
    else:
        for name in linear:
            parent, _, child = name.rpartition(".")
            layer = model.get_submodule(name)
            model.get_submodule(parent).register_module(child, _nf4_layer(layer, device, compute_dtype))


def _nf4_layer(layer: torch.nn.Linear, device: torch.device, compute_dtype: torch.dtype) -> torch.nn.Module:
    import bitsandbytes as bnb

    quantized = bnb.nn.Linear4bit(
        layer.in_features,
        layer.out_features,
        bias=layer.bias is not None,
        compute_dtype=compute_dtype,
        compress_statistics=True,
        quant_type="nf4",
        device="meta",
    )
    # bitsandbytes quantizes a Params4bit when it moves to a device.
    quantized.weight = bnb.nn.Params4bit(
        layer.weight.data.cpu(), requires_grad=False, compress_statistics=True, quant_type="nf4"
    ).to(device)
    if layer.bias is not None:
        quantized.bias = torch.nn.Parameter(layer.bias.data, requires_grad=False)
    # On a CPU with AVX-512 BF16, bitsandbytes repacks a layer's weight at its first no-grad forward in eval mode
    # (validation, samples, parity) into a layout that needs in_features a multiple of its 64-wide blocks and
    # out_features of 32, and fails on any other layer ("shape '[128, 0]' is invalid"). That layout also rounds the
    # block scales to bf16, so evaluation would compute another model than training does. Every layer keeps the
    # layout training uses: the same numbers in training and evaluation, on every x86-64 CPU.
    quantized.support_avx512bf16_for_cpu = False
    return quantized
