"""`difftune plan`'s prediction against the measured peak: `python scripts/bench_plan.py --out F.jsonl`.

For each job (scripts/bench.py's specs), the plan is made in a fresh process, before any weight is read, and the
job is then run by scripts/bench.py in another (peak RSS on CPU, `torch.cuda.max_memory_allocated` on a GPU);
one JSON line a job with both and their ratio.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

JOBS = {  # name -> bench.py arguments
    "tiny-64": ["--model", "tiny", "--resolution", "64"],
    "sd15-256": ["--model", "sd15", "--resolution", "256"],
    "sd15-256-fp8-weights": ["--model", "sd15", "--resolution", "256", "--weight-dtype", "fp8"],
    "sd15-256-fp16-weights": ["--model", "sd15", "--resolution", "256", "--weight-dtype", "fp16"],
    "sd15-384": ["--model", "sd15", "--resolution", "384"],  # held out: CPU_HEAP_GROWTH was measured at 256 px
}
COMMON = ["--batch", "1", "--steps", "3", "--warmup", "1", "--cache"]

PLAN = """
import json, sys
from difftune.toy.bench import BenchOptions, _config, prepare_workspace
from difftune.training.plan import plan_memory
options = BenchOptions(**json.loads(sys.argv[1]))
root, model_dir, data_dir = prepare_workspace(options)
config = _config(options, model_dir, data_dir, root / "run", root / "cache", options.warmup + options.steps)
plan = plan_memory(config)
peaks = {"device_peak": plan.device_peak, "host_peak": plan.host_peak, "device": plan.device, "host": plan.host}
print(json.dumps(peaks))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", nargs="*", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--workdir", default="")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="bench.py's --dry-run: each job shrunk for a CPU")
    args = parser.parse_args()
    bench = Path(__file__).with_name("bench.py")
    for name in args.jobs:
        argv = (
            JOBS[name]
            + COMMON
            + (["--workdir", args.workdir] if args.workdir else [])
            + (["--dry-run"] if args.dry_run else [])
        )
        measured = json.loads(_last_line([sys.executable, str(bench), *argv]))
        options = {
            key: measured[key]
            for key in ("model", "resolution", "batch", "steps", "warmup", "cache", "weight_dtype", "workdir")
        }
        plan = json.loads(_last_line([sys.executable, "-c", PLAN, json.dumps(options)]))
        on_gpu = measured["device"] != "cpu"
        predicted = plan["device_peak"] if on_gpu else plan["host_peak"]
        row = {
            "job": name,
            "device": measured["device"],
            "measured_peak_bytes": measured["peak_memory_bytes"],
            "predicted_peak_bytes": predicted,
            "predicted_over_measured": predicted / measured["peak_memory_bytes"],
            "plan": plan,
        }
        print(json.dumps(row), flush=True)
        if args.out:
            with args.out.open("a") as out:
                out.write(json.dumps(row) + "\n")


def _last_line(command: list[str]) -> str:
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode:
        sys.exit(run.stderr[-3000:])
    return run.stdout.strip().splitlines()[-1]


if __name__ == "__main__":
    main()
