"""The ControlNet job (configs/tiny_controlnet.toml; or the control LoRA's, configs/tiny_flux_control_lora.toml) on its
tiny base: trained, then scored on where it draws: for 8
held-out silhouettes of every seen color and shape, the fraction drawn in the asked color and shape, the fraction
whose drawn shape overlaps the control's silhouette by at least half (intersection over union), and the mean overlap;
the base alone (its drawing ignores the control) is the before. One JSON line per seed (and variant).

    python scripts/bench_controlnet.py [--config configs/tiny_controlnet.toml] [--out benchmarks/controlnet-tiny.jsonl]
        [--seeds 0 1 2] [--set key=value ...]
"""

import argparse
import json
import time
from pathlib import Path

from difftune.adapters.export import apply_adapters
from difftune.config import load_config
from difftune.families import load_components
from difftune.toy.judge import EvalSettings, placement_score
from difftune.toy.tiny_base import SEEN_COLORS
from difftune.training.train import train


def summary(scores: dict) -> dict:
    seen = scores["seen"]
    return {
        "color_and_shape": seen["both"],
        "placed": seen["place"],
        "all": seen["all"],
        "overlap": round(seen["overlap"], 3),
        "placed_by_shape": {shape: row["place"] for shape, row in scores["seen_by_shape"].items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny_controlnet.toml")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/controlnet-tiny.jsonl"))
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/difftune-bench-controlnet"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--set", nargs="*", default=[], dest="overrides", help="config overrides of the variant")
    parser.add_argument(
        "--guidance-scale",
        type=float,
        default=3.0,
        help="the judge's, before and after (1: FluxControlPipeline on a "
        "base without a guidance embedding, which it cannot guide otherwise)",
    )
    args = parser.parse_args()
    settings = EvalSettings(guidance_scale=args.guidance_scale)
    before = summary(placement_score(load_components(load_config(args.config).model), SEEN_COLORS, settings))
    for seed in args.seeds:
        out_dir = args.work_dir / f"seed_{seed}"
        config = load_config(
            args.config,
            [
                *args.overrides,
                f"train.output_dir={out_dir}",
                "train.overwrite=true",
                "sample.prompts=[]",
                f"train.seed={seed}",
            ],
        )
        started = time.perf_counter()
        result = train(config)
        seconds = round(time.perf_counter() - started, 1)
        components = load_components(config.model)
        apply_adapters(components, [(result.trained_path, 1.0)])
        after = summary(placement_score(components, SEEN_COLORS, settings))
        line = {
            "config": args.config,
            "seed": seed,
            "overrides": args.overrides,
            "train_s": seconds,
            "before": before,
            "after": after,
        }
        print(json.dumps(line), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
