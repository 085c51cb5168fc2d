"""Each family's shipped job, run as shipped on its micro model: for the families without a bundled tiny base, issue
33's "default job on the purple set whose validation loss falls and whose adapter loads and renders in the family's
pipeline" (`scripts/family_jobs.py`; docs/benchmarks.md has the rows).

A job is the family's own config file from `configs/` (its adapter, loss, optimizer, precision, frozen-weight dtype and
cache settings kept) pointed at the family's random-init micro model (`micro.build_pipeline`), the purple renders
(`examples/purple`) at 32 px and a held-out set of other purple renders for validation, for a few hundred steps. What
a row says: the validation loss before and after (the job moves the model towards the set, through every setting the
config ships); and the run's parity check, which loads the saved adapter the way users do, through the family's own
diffusers pipeline (`load_lora_weights`), and redraws the in-training sample (0: the file draws exactly what was
trained). A random micro model knows no colour, so these rows say the job runs and learns, not how well (the tiny
bases' scores say that).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from difftune.config import FAMILY_NAMES, load_config
from difftune.families import FAMILIES
from difftune.toy.micro import build_pipeline, builder
from difftune.toy.tiny import shape_images, write_caption_folder
from difftune.toy.tiny_base import HELD_OUT_COLOR
from difftune.training.metrics import read_metrics
from difftune.training.parity import PARITY_FILE

REPO = Path(__file__).resolve().parents[2]
# Each family's text-to-image job (configs/), as its micro builder names it, for sweeping settings over every family
# (`overrides`); and those run as shipped on their micro model, the families without a bundled tiny base of it.
ALL_FAMILY_CONFIGS = {name: builder(name).SHIPPED_JOB for name in FAMILY_NAMES if hasattr(builder(name), "SHIPPED_JOB")}
FAMILY_CONFIGS = {
    name: job for name, job in ALL_FAMILY_CONFIGS.items() if getattr(builder(name), "JOB_ON_MICRO", False)
}


def job_overrides(
    base: Path, data: Path, validation: Path, output_dir: Path, steps: int, clips: bool = False
) -> list[str]:
    """What changes from the shipped job: the micro base and the purple sets at 32 px (no buckets), fewer steps, a
    validation pass every quarter, one purple sample drawn in few steps (the parity check redraws it); a video
    family's (`clips`) a clip of 5 frames, the fewest past one its autoencoders take."""
    values = {
        "model.base": base,
        "data.path": data,
        "data.resolution": 32,
        "data.buckets": "false",
        "data.num_workers": 0,
        "train.output_dir": output_dir,
        "train.overwrite": "true",
        "train.max_steps": steps,
        "train.batch_size": 4,
        "cache.dir": output_dir / "cache",
        "validation.path": validation,
        "validation.every_steps": max(1, steps // 4),
        "sample.prompts": '["a purple circle"]',
        "sample.steps": 8,
        "sample.every_steps": 0,
        "sample.before": "false",
        "checkpoint.every_steps": 0,
        "log.tensorboard": "false",
        "log.progress_bar": "false",
    }
    if clips:
        values["sample.frames"] = 5
    return [f"{key}={value}" for key, value in values.items()]


def run_family_job(family: str, work_dir: Path, steps: int = 200, seed: int = 1, overrides: list[str] = ()) -> dict:
    """The family's shipped job on its micro model (built in `work_dir`), with `overrides` (`section.key=value`) on top;
    its row."""
    from difftune.training.train import train

    base, validation = work_dir / f"micro-{family}", work_dir / "purple-validation"
    if not base.is_dir():
        FAMILIES[family].loading.save_pipeline(build_pipeline(seed=seed, family=family), base)
    if not validation.is_dir():  # purple renders the job never sees
        write_caption_folder(validation, shape_images(12, seed=seed + 100, colors=(HELD_OUT_COLOR,)))
    output_dir = work_dir / f"job-{family}"
    config_file = REPO / "configs" / ALL_FAMILY_CONFIGS[family]
    config = load_config(
        config_file,
        job_overrides(base, REPO / "examples" / "purple", validation, output_dir, steps, FAMILIES[family].reads_clips)
        + list(overrides),
    )
    started = time.perf_counter()
    result = train(config)
    seconds = time.perf_counter() - started
    losses = [(row["step"], row["val_loss"]) for row in read_metrics(output_dir) if "val_loss" in row]
    parity = json.loads((result.trained_path.parent / PARITY_FILE).read_text())
    return {
        "family": family,
        "config": f"configs/{config_file.name}",
        "overrides": list(overrides),
        "steps": steps,
        "batch_size": 4,
        "resolution": 32,
        "validation_loss": losses,
        "validation_loss_fell": losses[-1][1] < losses[0][1],
        "parity_max_pixel_difference": {
            layout: row["max_pixel_difference"] for layout, row in parity["layouts"].items()
        },
        "parity_not_checked": sorted(parity.get("not_checked", {})),
        "seconds": round(seconds, 1),
    }
