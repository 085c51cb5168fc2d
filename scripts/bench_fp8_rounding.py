"""How much of each frozen weight fp8 storage keeps: plain e4m3 casting against storage's per-tensor power-of-two
scale, over every linear and convolution weight of the bundled tiny bases and of SD1.5's UNet shapes (diffusers'
initialization). One JSON line per model.

    python scripts/bench_fp8_rounding.py

Why: e4m3's normal numbers start at 2^-6 = 0.0156 and end at 448; a typical weight is smaller than the first, so a
plain cast keeps it with few significant bits or none (ComfyUI's and kohya's `_fp8_e4m3fn` files are plain casts).
"""

import json

import torch

from difftune.config import ModelConfig
from difftune.families import load_components
from difftune.memory import storage
from difftune.toy.bench import build_pipeline

FP8 = torch.float8_e4m3fn


def errors(model: torch.nn.Module) -> dict:
    """Relative RMS error over all weights (sum of squared errors / sum of squares), and the share of nonzero weights
    that become zero, plain and scaled."""
    totals = {"plain": [0.0, 0], "scaled": [0.0, 0]}
    energy, nonzero = 0.0, 0
    for layer in model.modules():
        if type(layer) not in storage.STORED_LAYERS:
            continue
        weight = layer.weight.detach().double()
        energy += weight.square().sum().item()
        nonzero += int((weight != 0).sum())
        scale = storage.fp8_scale(layer.weight.detach())
        for name, rounded in (
            ("plain", weight.to(FP8).double()),
            ("scaled", (weight / scale).to(FP8).double() * scale),
        ):
            totals[name][0] += (rounded - weight).square().sum().item()
            totals[name][1] += int(((rounded == 0) & (weight != 0)).sum())
    return {
        name: {"relative_rms_error": (squared / energy) ** 0.5, "flushed_to_zero": zeros / nonzero}
        for name, (squared, zeros) in totals.items()
    }


def main() -> None:
    for base in ("models/tiny-sd", "models/tiny-flux", "models/tiny-qwen_image"):
        print(json.dumps({"model": base, **errors(load_components(ModelConfig(base=base)).denoiser)}))
    print(json.dumps({"model": "sd15-shaped UNet (random init)", **errors(build_pipeline("sd15").unet)}))


if __name__ == "__main__":
    main()
