"""Host memory per phase of a training run against the memory plan, on a real-width base
(`scripts/make_real_width_base.py`): one JSON line with each phase's measured peak (the run's own phase lines:
the kernel's high-water mark, reset as each phase starts), the plan's prediction for it, their ratio, and the issue's
targets (training <= 1.15 x the denoiser's stored bytes + 2.5 GiB; caching <= 1.15 x the encoders' bytes as loaded +
2.5 GiB). On a GPU the plan is the device's, and the row adds the run's device peak beside the plan's.

    python scripts/bench_host_memory.py --out benchmarks/cpu-host-memory.jsonl -- --config configs/flux_lora.toml \
        model.base=/data/flux1-dev model.weight_dtype=fp8 train.mixed_precision=bf16 ...

Everything after `--` is `difftune train`'s arguments (and the plan's). Run nothing else while it measures.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

GIB = 2**30
HEADROOM = 2.5 * GIB
PHASE_LINE = re.compile(
    r"^difftune: (?P<phase>.+): done in (?P<took>.+?), host peak (?P<size>[\d.]+) (?P<unit>MiB|GiB)"
    r"(?:, device peak (?P<device_size>[\d.]+) (?P<device_unit>KiB|MiB|GiB))?"
)
UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": GIB}
# The plan's phases, by the run's phase lines that make them up.
PLANNED_AS = {
    "loading and caching": re.compile(r"^loading (the encoders of )?the base|^filling the caches"),
    "loading the denoiser": re.compile(r"^loading the (transformer|unet)$"),
    "training": re.compile(r"^training$|^saving the result"),
}  # the last checkpoint's write comes between


def measured_phases(stdout: str, where: str = "") -> dict[str, int]:
    """Each plan phase's highest peak among the run's phase lines that make it up: the host's, or with `where`
    "device_" the GPU's (the lines say it on CUDA)."""
    peaks: dict[str, int] = {}
    for line in stdout.splitlines():
        found = PHASE_LINE.match(line)
        if not found or found[f"{where}size"] is None:
            continue
        size = float(found[f"{where}size"]) * UNITS[found[f"{where}unit"]]
        for phase, pattern in PLANNED_AS.items():
            if pattern.search(found["phase"]):
                peaks[phase] = max(peaks.get(phase, 0), round(size))
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to append the row to")
    parser.add_argument("--label", required=True, help="what the row measures, e.g. 'FLUX.1-dev, fp8, 64 px'")
    parser.add_argument("job", nargs=argparse.REMAINDER, help="difftune train's arguments, after --")
    args = parser.parse_args()
    job = args.job[1:] if args.job[:1] == ["--"] else args.job
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the device the run trains on, as the plan asks
    planned = json.loads(
        subprocess.run(
            [sys.executable, "-m", "difftune.cli", "plan", "--json", "--device", device, *job],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()[-1]
    )
    started = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "difftune.cli", "train", *job, "log.progress_bar=false"], capture_output=True, text=True
    )
    seconds = time.perf_counter() - started
    if run.returncode:
        sys.exit(f"bench_host_memory: the run failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    measured = measured_phases(run.stdout)
    phases = planned["host_phases"]
    denoiser = phases.get("loading the denoiser", {}).get("denoiser")
    encoders = phases["loading and caching"].get("encoders")
    targets = {}
    if denoiser:
        targets["training"] = round(1.15 * denoiser + HEADROOM)
    if encoders:
        targets["loading and caching"] = round(1.15 * encoders + HEADROOM)
    row = {
        "label": args.label,
        "job": job,
        "seconds": round(seconds),
        "phases": {
            phase: {
                "measured_bytes": measured.get(phase),
                "planned_bytes": sum(held.values()),
                "planned_over_measured": round(sum(held.values()) / measured[phase], 3) if phase in measured else None,
                "target_bytes": targets.get(phase),
                "within_target": measured[phase] <= targets[phase] if phase in targets and phase in measured else None,
            }
            for phase, held in phases.items()
        },
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "device_peak": {  # the GPU's: the highest of the run's phases against the plan's training peak
            "measured_bytes": max(measured_phases(run.stdout, "device_").values(), default=None),
            "planned_bytes": sum(planned["device"].values()),
        }
        if device == "cuda"
        else None,
        "denoiser_stored_bytes": denoiser,
        "encoders_loaded_bytes": encoders,
        "phase_lines": [line for line in run.stdout.splitlines() if PHASE_LINE.match(line)],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a", encoding="utf-8") as file:
        file.write(json.dumps(row) + "\n")
    if row["device_peak"] and row["device_peak"]["measured_bytes"]:
        print(
            f"{'device peak':<22} measured {row['device_peak']['measured_bytes'] / GIB:.2f} GiB, "
            f"planned {row['device_peak']['planned_bytes'] / GIB:.2f} GiB"
        )
    for phase, result in row["phases"].items():
        measured_gib = f"{result['measured_bytes'] / GIB:.2f}" if result["measured_bytes"] else "-"
        print(
            f"{phase:<22} measured {measured_gib} GiB, planned {result['planned_bytes'] / GIB:.2f} GiB, "
            f"target {result['target_bytes'] / GIB if result['target_bytes'] else float('nan'):.2f} GiB"
        )


if __name__ == "__main__":
    main()
