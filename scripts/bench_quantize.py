"""QLoRA memory and speed: the denoiser with its linear layers quantized (`model.quantize`) under a LoRA.

    python scripts/bench_quantize.py [--model sd15] [--batch 4] [--resolution 256]

For each of none / int8 / nf4, in its own process: load the generated model's denoiser (random weights, as
`scripts/bench.py` builds it), quantize, attach LoRA r4, run one forward and backward, and report the weights'
stored bytes (quantized tensors at their packed size), the time, peak RSS and the anonymous part of RSS
(memory-mapped weight files are the rest). One JSON line each, appended to benchmarks/quantize.jsonl.
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

GIB = 2**30


def measure(method: str, model_dir: Path, batch: int, resolution: int) -> dict:
    import torch
    from peft import LoraConfig

    from difftune.config import ModelConfig
    from difftune.families import load_components
    from difftune.memory.quantize import quantize_linear_layers

    components = load_components(ModelConfig(base=str(model_dir)))
    family, denoiser = components.family, components.denoiser
    del components  # the encoders' memory is not the denoiser's
    if method != "none":
        quantize_linear_layers(denoiser, method, torch.device("cpu"), torch.float32)
    denoiser.requires_grad_(False)
    denoiser.add_adapter(
        LoraConfig(
            r=4, target_modules=family.targets.default_targets[family.denoiser_name], init_lora_weights="gaussian"
        )
    )
    config = denoiser.config
    latents = torch.randn(batch, config.in_channels, resolution // 8, resolution // 8)
    text = torch.randn(batch, 77, config.cross_attention_dim)
    extra = {}
    if config.addition_embed_type == "text_time":  # SDXL's pooled text and size conditioning
        extra = {"added_cond_kwargs": {"text_embeds": torch.randn(batch, 1280), "time_ids": torch.randn(batch, 6)}}
    started = time.perf_counter()
    denoiser(latents, torch.full((batch,), 500), text, **extra).sample.square().mean().backward()
    seconds = time.perf_counter() - started
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {
        "method": method,
        "stored_weight_bytes": _stored_bytes(denoiser),
        "forward_backward_seconds": round(seconds, 2),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "anonymous_rss_bytes": int(status["RssAnon"].split()[0]) * 1024,
        "file_rss_bytes": int(status["RssFile"].split()[0]) * 1024,
    }


def _stored_bytes(model) -> int:
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        flatten = getattr(tensor, "__tensor_flatten__", None)  # torchao's quantized tensors hold inner tensors
        inner = [getattr(tensor, name) for name in flatten()[0]] if flatten else []
        total += sum(t.numel() * t.element_size() for t in inner) if inner else tensor.numel() * tensor.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sd15", help="a scripts/bench.py model spec")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/quantize.jsonl"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.model_dir, args.batch, args.resolution)))
        return

    from difftune.toy.bench import BenchOptions, prepare_workspace

    _, model_dir, _ = prepare_workspace(BenchOptions(model=args.model, resolution=args.resolution))
    for method in ("none", "int8", "nf4"):
        child = [
            sys.executable,
            __file__,
            "--child",
            method,
            "--model-dir",
            str(model_dir),
            "--batch",
            str(args.batch),
            "--resolution",
            str(args.resolution),
        ]
        done = subprocess.run(child, capture_output=True, text=True, check=True)
        line = {
            "model": args.model,
            "batch": args.batch,
            "resolution": args.resolution,
            **json.loads(done.stdout.strip().splitlines()[-1]),
        }
        print(json.dumps(line), flush=True)
        with open(args.out, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
