"""The concept slider job (configs/tiny_slider.toml) on the tiny base: trained, then drawn at signed scales, and how
red each drawn shape is measured: the fraction the judge calls red and blue, and the mean (R - B) / 255 over the
shape's pixels, for circles of every seen color (the slider's target) and for squares (beyond it), beside the
fraction whose shape is still judged right. One JSON line per (scale, prompt group).

    python scripts/bench_slider.py [--out benchmarks/slider-tiny.jsonl] [--seeds 0 1 2]
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np

from difftune.adapters.export import apply_adapters
from difftune.config import load_config
from difftune.families import load_components
from difftune.toy.judge import EvalSettings, judged_samples, shape_mask
from difftune.toy.tiny_base import SEEN_COLORS
from difftune.training.train import train

SCALES = (-1.0, -0.5, 0.0, 0.5, 1.0)
GROUPS = {"circle": [f"a {color} circle" for color in SEEN_COLORS], "square": [f"a {c} square" for c in SEEN_COLORS]}


def redness(rows: list[dict]) -> dict:
    """How red a group's drawn shapes are, and whether they keep their shape."""
    differences = []
    for row in rows:
        mask = shape_mask(row["image"])
        if mask is not None:
            pixels = np.asarray(row["image"].convert("RGB"), dtype=np.float32)[mask]
            differences.append(float((pixels[:, 0] - pixels[:, 2]).mean() / 255))
    count = len(rows)
    return {
        "red": sum(row["color"] == "red" for row in rows) / count,
        "blue": sum(row["color"] == "blue" for row in rows) / count,
        "red_minus_blue": round(float(np.mean(differences)), 4) if differences else None,
        "shape_kept": sum(row["shape"] == row["prompt"].split()[-1] for row in rows) / count,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/slider-tiny.jsonl"))
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/difftune-bench-slider"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    settings = EvalSettings()
    for seed in args.seeds:
        out_dir = args.work_dir / f"seed_{seed}"
        config = load_config(
            "configs/tiny_slider.toml",
            [f"train.output_dir={out_dir}", "train.overwrite=true", "sample.prompts=[]", f"train.seed={seed}"],
        )
        started = time.perf_counter()
        result = train(config)
        seconds = round(time.perf_counter() - started, 1)
        for scale in SCALES:
            components = load_components(config.model)
            if scale:
                apply_adapters(components, [(result.trained_path, scale)])
            for group, prompts in GROUPS.items():
                line = {"seed": seed, "scale": scale, "prompts": group, "train_s": seconds}
                line |= redness(judged_samples(components, prompts, settings))
                print(json.dumps(line), flush=True)
                with open(args.out, "a", encoding="utf-8") as out:
                    out.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
