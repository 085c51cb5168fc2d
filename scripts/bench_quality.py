"""Fine-tuning quality on a bundled tiny base: a default job and its variants, each trained and judged.

    python scripts/bench_quality.py [--job sdxl_lora] [--only NAME ...] [--out FILE]
    python scripts/bench_quality.py --table [--job sdxl_lora]   # BENCHMARKS.md's table from those lines

Each variant is `difftune train --config configs/<job>.toml <overrides>` (job tiny_lora: lines in
benchmarks/quality-finetune.jsonl; another job: benchmarks/quality-finetune-<job>.jsonl), then
`difftune eval` of its
adapter (the base is scored once): one JSON line per variant with the held-out concept's accuracy before
and after (overall and per shape) and the forgetting of the seen prompts. BENCHMARKS.md's table is these lines.
"""

import argparse
import json
import time
from pathlib import Path

from difftune.config import load_config
from difftune.evaluate import EvalSettings, score
from difftune.export import apply_adapters, variant_of
from difftune.families import load_components
from difftune.tiny import shape_images, write_caption_folder
from difftune.tiny_base import HELD_OUT_COLOR, SEEN_COLORS
from difftune.train import train

# Overrides of each default job; `{renders_32}` is 32 renders of the concept written by this script.
VARIANTS = {"tiny_lora": {
    "lora_r16_te": [],
    "lora_r16_unet_only": ["adapter.text_encoder=false"],
    "lora_r4_te": ["adapter.rank=4"],
    "lora_r8_te": ["adapter.rank=8"],
    "dora_r4_te": ["adapter.kind=dora", "adapter.rank=4"],
    "dora_r8_te": ["adapter.kind=dora", "adapter.rank=8"],
    "dora_r16_te": ["adapter.kind=dora"],
    "uniform_weighting": ["loss.weighting=uniform"],
    "noise_offset_0.1": ["loss.noise_offset=0.1"],
    "taesd_latents": ["model.vae=models/tiny-sd/taesd"],
    "ema": ["ema.enabled=true", "ema.decay=0.99"],
    "200_steps": ["train.max_steps=200"],
    "600_steps": ["train.max_steps=600"],
    "lr_2e-3": ["optim.learning_rate=2e-3"],
    "text_encoder_lr_3e-3": ["optim.text_encoder_learning_rate=3e-3"],
    "no_caption_dropout": ["data.caption_dropout=0.0"],
    "32_renders": ["data.path={renders_32}"],
    "lr_from_find_lr": ["optim.learning_rate=1.79e-3"],  # find-lr's suggestion at train.seed=2 (benchmarks/find-lr-*)
    "activations_every_10": ["log.activations_every_steps=10"],
}, "tiny_embedding": {
    "embedding_init_red": [],
    "embedding_random_init": ["adapter.embedding_init_word="],
    "embedding_2_vectors": ["adapter.embedding_vectors=2"],
}, "sdxl_lora": {
    "dora_r4_te": [],
    "lora_r4_te": ["adapter.kind=lora"],
    "lora_r8_te": ["adapter.kind=lora", "adapter.rank=8"],
    "lora_r16_te": ["adapter.kind=lora", "adapter.rank=16"],
    "lora_r16_unet_only": ["adapter.kind=lora", "adapter.rank=16", "adapter.text_encoder=false"],
    "dora_r16_te": ["adapter.rank=16"],
    "600_steps": ["train.max_steps=600"],
}, "flux_lora": {
    "lora_r16_te": [],
    "lora_r4_te": ["adapter.rank=4"],
    "dora_r4_te": ["adapter.kind=dora", "adapter.rank=4"],
    "dora_r16_te": ["adapter.kind=dora"],
    "lora_r16_transformer_only": ["adapter.text_encoder=false"],
    "no_shift": ["loss.flow_shift_by_resolution=false"],
    "logit_normal": ["loss.timestep_sampling=logit_normal"],
    "shift_3": ["loss.flow_shift_by_resolution=false", "loss.flow_shift=3.0"],
    "600_steps": ["train.max_steps=600"],
    "lr_5e-4": ["optim.learning_rate=5e-4"],
    "dora_r4_te_lr_5e-4": ["adapter.kind=dora", "adapter.rank=4", "optim.learning_rate=5e-4"],
    "no_caption_dropout": ["data.caption_dropout=0.0"],
    "200_steps": ["train.max_steps=200"],
    "text_encoder_lr_5e-3": ["optim.text_encoder_learning_rate=5e-3"],
    "image_stream_only": ["adapter.target_modules=['attn.to_q','attn.to_k','attn.to_v','attn.to_out.0','ff.net.0.proj','ff.net.2','proj_mlp']"],
}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=VARIANTS, default="tiny_lora", help="the default job the variants change")
    parser.add_argument("--only", nargs="*", help="variant names (default: all)")
    parser.add_argument("--out", type=Path, help="default: benchmarks/quality-finetune[-<job>].jsonl")
    parser.add_argument("--work-dir", type=Path, default=Path("output/bench-quality"))
    parser.add_argument("--table", action="store_true", help="print the --out lines as a Markdown table and exit")
    args = parser.parse_args()
    config_file = Path("configs") / f"{args.job}.toml"
    args.out = args.out or Path("benchmarks") / ("quality-finetune.jsonl" if args.job == "tiny_lora" else f"quality-finetune-{args.job}.jsonl")
    if args.table:
        print(markdown_table([json.loads(line) for line in args.out.read_text().splitlines()]))
        return

    settings = EvalSettings()
    base_config = load_config(config_file)
    before = score(load_components(base_config.model), SEEN_COLORS, HELD_OUT_COLOR, settings)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    renders_32 = args.work_dir / "renders_32"
    write_caption_folder(renders_32, shape_images(32, seed=7, colors=(HELD_OUT_COLOR,)))
    for name, overrides in VARIANTS[args.job].items():
        if args.only and name not in args.only:
            continue
        out_dir = args.work_dir / args.job / name
        overrides = [override.format(renders_32=renders_32) for override in overrides]
        config = load_config(config_file, [*overrides, f"train.output_dir={out_dir}", "train.overwrite=true", "sample.prompts=[]"])
        started = time.perf_counter()
        result = train(config)
        seconds = time.perf_counter() - started
        adapters = [result.trained_path] + ([variant_of(result.trained_path, "_ema")] if result.ema else [])
        for adapter in adapters:
            components = load_components(base_config.model)
            apply_adapters(components, [(adapter, 1.0)])
            # An embedding's concept prompts say its token where the others say the color.
            word = config.adapter.embedding_token if config.adapter.kind == "embedding" else ""
            after = score(components, SEEN_COLORS, HELD_OUT_COLOR, settings, word)
            line = {
                "run": name + (" (EMA weights)" if adapter.stem.endswith("_ema") else ""),
                "overrides": overrides,
                "train_s": round(seconds, 1),
                "concept_before": before["concept"]["both"],
                "concept_after": after["concept"]["both"],
                "by_shape": {shape: scores["both"] for shape, scores in after["concept_by_shape"].items()},
                "seen_both_before": before["seen"]["both"],
                "seen_both_after": after["seen"]["both"],
                "forgetting": round(before["seen"]["both"] - after["seen"]["both"], 3),
            }
            print(json.dumps(line), flush=True)
            with open(args.out, "a", encoding="utf-8") as out:
                out.write(json.dumps(line) + "\n")


def markdown_table(lines: list[dict]) -> str:
    rows = [
        "| run | overrides | train s | purple both, before -> after | circle / square / triangle | seen both, before -> after | forgetting |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for line in lines:
        name = f"**{line['run']} (default)**" if not line["overrides"] else line["run"]
        overrides = f"`{' '.join(line['overrides'])}`" if line["overrides"] else ""
        shapes = " / ".join(f"{value:.2f}" for value in line["by_shape"].values())
        rows.append(
            f"| {name} | {overrides} | {line['train_s']:.0f} | {line['concept_before']:.2f} -> {line['concept_after']:.2f} "
            f"| {shapes} | {line['seen_both_before']:.2f} -> {line['seen_both_after']:.2f} | {line['forgetting']:.3f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
