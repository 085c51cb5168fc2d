"""A random-weight base at a published model's real widths, saved in bf16 in its published layout (sharded
safetensors with the hub's index files), for measuring host and device memory on real sizes: weights' values do not
change memory. Its configs are the ones difftune keeps (`difftune/published`); its tokenizers are the family's tiny
base's (character-level, 32 tokens: real token ids would need files this machine cannot download, and short
captions keep a CPU step of a 12B model to a minute).

    python scripts/make_real_width_base.py --base black-forest-labs/FLUX.1-dev --out /data/flux1-dev-random
    python scripts/make_real_width_base.py --base Qwen/Qwen-Image --out /data/qwen-40 --blocks 40

`--blocks N` keeps the first N blocks of the denoiser (a base larger than this machine's disk or memory allows).
`--config-only PART` writes a part's config without its weights, for a part the measured job never loads: Wan 2.2
A14B's high-noise expert, where a run trains the low-noise one without previews (57 GB of the folder otherwise).

    python scripts/make_real_width_base.py --base Wan-AI/Wan2.2-T2V-A14B-Diffusers --out /data/wan22 --config-only
    transformer

`--denoiser-file fp8_scaled|Q8_0` writes the denoiser as the single file people download instead of its folder's
weights (the folder keeps its config, for `model.single_file_config`): ComfyUI's `*_fp8_scaled.safetensors` (each
matrix in e4m3 with its `.scale_weight`) or city96's `*-Q8_0.gguf`, in the family's single-file layout, a tensor
at a time into the file's dtype (the file is built in memory whole, as both writers do: its own size).
Weights: matrices N(0, 0.02), norms' scales 1, biases 0, in bf16; written a shard (<= 5 GB) at a time, so building
holds one shard in memory.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from difftune import published

REPO = Path(__file__).resolve().parents[1]
SHARD_BYTES = 5 * 10**9
# The denoiser's block counts in its config, by the key each family's config names them with.
BLOCK_KEYS = ("num_layers", "num_single_layers")
WEIGHT_FILES = {"diffusers": "diffusion_pytorch_model", "transformers": "model"}


def meta_model(library: str, class_name: str, folder: Path) -> torch.nn.Module:
    part_class = getattr(importlib.import_module(library), class_name)
    with torch.device("meta"):
        if library == "diffusers":
            return part_class.from_config(part_class.load_config(folder))
        from transformers import AutoConfig

        return part_class._from_config(AutoConfig.from_pretrained(folder))


def random_like(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    if name.endswith("bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    if len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)


def write_part(model: torch.nn.Module, library: str, folder: Path, generator: torch.Generator) -> int:
    """The part's state dict, random, in shards of at most SHARD_BYTES with the hub's index; returns its bytes. A
    tensor held under two names (T5's tied `shared` and `encoder.embed_tokens`) is written once, under its first, as
    `save_pretrained` writes it."""
    shapes, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.is_floating_point() and id(tensor) not in seen:
            shapes[name] = tensor.shape
            seen.add(id(tensor))
    stem = WEIGHT_FILES[library]
    shards, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = shape.numel() * 2
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for number, names in enumerate(shards, 1):
        file = f"{stem}.safetensors" if len(shards) == 1 else f"{stem}-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: random_like(name, shapes[name], generator) for name in names}
        total += sum(tensor.numel() * 2 for tensor in tensors.values())
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, file)
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


def write_denoiser_file(family, model: torch.nn.Module, kind: str, out: Path, generator: torch.Generator) -> int:
    """The denoiser as a single file of `kind` in the family's single-file layout; returns its tensors' bytes."""
    from difftune.models.components import Components

    shapes = {
        key: tensor.shape
        for key, tensor in family.layout.to_single_file(
            Components(family=family, denoiser=model, vae=None, text_encoders={}, tokenizers={}, noise_scheduler=None)
        ).items()
    }
    if kind == "Q8_0":
        import gguf

        writer = gguf.GGUFWriter(str(out / f"{family.denoiser_name}-Q8_0.gguf"), arch=family.name)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        total = 0
        for key, shape in shapes.items():
            value = random_like(key, shape, generator).float().numpy()
            if len(shape) >= 2 and shape[-1] % 32 == 0:
                value = gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(key, value, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                writer.add_tensor(key, value)
            total += value.nbytes
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return total
    tensors = {"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}
    for key, shape in shapes.items():
        value = random_like(key, shape, generator)
        if key.endswith(".weight") and len(shape) >= 2:
            scale = value.float().abs().max() / torch.finfo(torch.float8_e4m3fn).max
            tensors[key] = (value.float() / scale).to(torch.float8_e4m3fn)
            tensors[key.removesuffix(".weight") + ".scale_weight"] = scale
        else:
            tensors[key] = value
    save_file(tensors, out / f"{family.denoiser_name}_fp8_scaled.safetensors")
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, choices=published.published_bases(), help="the published base")
    parser.add_argument("--out", type=Path, required=True, help="folder to write (must not exist)")
    parser.add_argument("--blocks", type=int, help="keep the denoiser's first N blocks (each kind: double, single)")
    parser.add_argument(
        "--tokenizers-from", type=Path, help="tiny base whose tokenizers to copy (default: the family's)"
    )
    parser.add_argument(
        "--denoiser-file",
        choices=("fp8_scaled", "Q8_0"),
        help="write the denoiser as a ComfyUI scaled fp8 or a GGUF Q8_0 single file",
    )
    parser.add_argument(
        "--config-only",
        action="append",
        default=[],
        metavar="PART",
        help="write this part's config alone (a part the measured job never loads)",
    )
    args = parser.parse_args()

    from difftune.config import ModelConfig
    from difftune.families import family_of

    configs = published.config_folder(args.base)
    family = family_of(ModelConfig(base=str(configs)))
    tokenizers = args.tokenizers_from or REPO / "models" / f"tiny-{family.name}"
    args.out.mkdir(parents=True)
    index = json.loads((configs / "model_index.json").read_text())
    (args.out / "model_index.json").write_text(json.dumps(index, indent=1))
    generator = torch.Generator().manual_seed(0)
    written = {}
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or None in spec:
            continue
        if not (configs / name).is_dir():  # a tokenizer: the tiny base's
            shutil.copytree(tokenizers / name, args.out / name)
            continue
        shutil.copytree(configs / name, args.out / name)
        if name == "scheduler" or name in args.config_only:
            continue
        config_path = args.out / name / "config.json"
        if name == family.denoiser_name and args.blocks:
            config = json.loads(config_path.read_text())
            config |= {key: min(config[key], args.blocks) for key in BLOCK_KEYS if key in config}
            config_path.write_text(json.dumps(config, indent=1))
        started = time.perf_counter()
        model = meta_model(*spec, args.out / name)
        if name == family.denoiser_name and args.denoiser_file:
            written[name] = write_denoiser_file(family, model, args.denoiser_file, args.out, generator)
        else:
            written[name] = write_part(model, spec[0], args.out / name, generator)
        print(f"{name}: {written[name] / 2**30:.2f} GiB in {time.perf_counter() - started:.0f} s", flush=True)
    (args.out / "README.md").write_text(
        f"# {args.base} at its real widths, random weights (bf16)\n\nBuilt by `python scripts/make_real_width_base.py "
        f"--base {args.base}{f' --blocks {args.blocks}' if args.blocks else ''}"
        + "".join(f" --config-only {part}" for part in args.config_only)
        + "`: not a model, a size. Parts' bytes: "
        + ", ".join(f"{name} {size / 2**30:.2f} GiB" for name, size in written.items())
        + ".\n"
    )


if __name__ == "__main__":
    main()
