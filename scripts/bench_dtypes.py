"""Time SD1.5's typical layers forward + backward in fp32, bf16 and fp16 on this machine's CPU: one JSON line.

    python scripts/bench_dtypes.py

Why: whether 16-bit frozen weights (half the memory) are a speed option on a CPU depends on its kernels. On an
AVX2-only CPU torch's 16-bit convolutions fall back to slow paths (tens of times fp32's time), so difftune
trains fp32 there; on CPUs with avx512_bf16 or AMX, and on GPUs, bf16 is the fast path. Shapes: the UNet's
first block at 256 px (320 channels, 32x32 latents, 8 heads of 40).

The other way to halve the frozen weights, 16-bit storage with fp32 compute, pays a cast of every frozen weight
to fp32 in each forward and again in each backward (keeping the fp32 copies for backward would undo the saving):
`upcast_seconds_per_sd15_unet` times that cast for the SD1.5 UNet's 859.5M parameters, once.
"""

import json
import platform
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def seconds(step, repeats: int = 3) -> float:
    step()  # warm-up: kernel selection and allocations
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats


def layer_steps(dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(320, 320, 3, padding=1).to(dtype).requires_grad_(False)
    image = torch.randn(1, 320, 32, 32, dtype=dtype, requires_grad=True)
    linear = torch.nn.Linear(320, 320).to(dtype).requires_grad_(False)
    tokens = torch.randn(1, 1024, 320, dtype=dtype, requires_grad=True)
    heads = torch.randn(1, 8, 1024, 40, dtype=dtype, requires_grad=True)
    attention = torch.nn.functional.scaled_dot_product_attention
    return {
        "conv3x3_320ch_32x32": lambda: conv(image).sum().backward(),
        "linear_1024x320": lambda: linear(tokens).sum().backward(),
        "sdpa_8x1024x40": lambda: attention(heads, heads, heads).sum().backward(),
    }


SD15_UNET_PARAMETERS = 859.5e6


def upcast_seconds_per_sd15_unet(dtype: torch.dtype) -> float:
    """One cast of the SD1.5 UNet's worth of 16-bit weights to fp32, from 1280x1280 blocks (its widest layers)."""
    blocks = [torch.randn(1280, 1280).to(dtype) for _ in range(64)]
    block_seconds = seconds(lambda: [block.float() for block in blocks])
    return block_seconds * SD15_UNET_PARAMETERS / (64 * 1280 * 1280)


def main() -> None:
    timings = {
        name: {layer: round(seconds(step), 4) for layer, step in layer_steps(dtype).items()}
        for name, dtype in DTYPES.items()
    }
    ratios = {
        name: {layer: round(t / timings["fp32"][layer], 1) for layer, t in layers.items()}
        for name, layers in timings.items()
    }
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    print(
        json.dumps(
            {
                "cpu": cpu,
                "capability": torch.backends.cpu.get_cpu_capability(),
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "seconds_fwd_bwd": timings,
                "ratio_to_fp32": ratios,
                "upcast_seconds_per_sd15_unet": {
                    name: round(upcast_seconds_per_sd15_unet(DTYPES[name]), 2) for name in ("bf16", "fp16")
                },
            }
        )
    )


if __name__ == "__main__":
    main()
