"""The benchmarks page's tables (docs/benchmarks.md), made from the JSONL the benchmark scripts append to
(benchmarks/*.jsonl), never typed by hand: each row with its date, the machine it ran on and the command that
measures it again. `scripts/update_docs.py` puts them between the page's markers; a test keeps them current."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from pathlib import Path

from difftune.toy.bench import BenchOptions

CPU = "CPU, 2 cores"  # the development machine every CPU row was measured on (x86-64, 24 GiB)
GIB = 1024**3


def records(path: Path) -> list[dict]:
    """A JSONL file's records, each once (a line appended twice counts once), in order; none where it is missing."""
    if not path.is_file():
        return []
    seen, found = set(), []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and line not in seen:
            seen.add(line)
            found.append(json.loads(line))
    return found


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _machine(record: dict) -> str:
    device = record.get("device", "cpu")
    return CPU if device == "cpu" else device


def bench_command(record: dict) -> str:
    """`scripts/bench.py` with the options of `record` that differ from its defaults (the workspace left out)."""
    words = ["python", "scripts/bench.py"]
    for field in dataclasses.fields(BenchOptions):
        if field.name in ("workdir", "profile") or field.name not in record or record[field.name] == field.default:
            continue
        flag = "--" + field.name.replace("_", "-")
        value = record[field.name]
        if isinstance(field.default, bool):
            words.append(flag if value else "--no-" + flag[2:])
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def speed_table(benchmarks: Path) -> str:
    """Training speed on each GPU measured (scripts/bench.py's rows): the real models' widths, random weights."""
    rows = []
    for name in sorted(path.name for path in benchmarks.glob("gpu-*.jsonl")):
        for record in records(benchmarks / name):
            if "seconds_per_step" not in record:
                continue
            setup = [record["precision"], f"{record['adapter']} r{record['rank']}"]
            if record.get("weight_dtype", "auto") != "auto":
                setup.append(f"{record['weight_dtype']} weights")
            if record.get("offload_blocks"):
                setup.append(f"{record['offload_blocks']} blocks offloaded")
            if record.get("gradient_checkpointing"):
                setup.append("checkpointing")
            rows.append(
                [
                    record["model"],
                    f"{record['resolution']} px, batch {record['batch']}",
                    ", ".join(setup),
                    f"{record['seconds_per_step']:.3f}",
                    f"{record['samples_per_second']:.1f}",
                    f"{record['peak_memory_bytes'] / GIB:.1f}",
                    f"{100 * record['mfu']:.1f}%" if record.get("mfu") else "",
                    _machine(record),
                    record["date"],
                    f"`{bench_command(record)}`",
                ]
            )
    header = ["model", "size", "settings", "s/step", "samples/s", "peak GiB", "MFU", "machine", "date", "command"]
    return _table(header, rows)


def host_memory_table(benchmarks: Path) -> str:
    """Each phase's host peak against the plan's, for the real models at full size (scripts/bench_host_memory.py)."""
    rows = []
    for name in ("cpu-host-memory.jsonl", *sorted(p.name for p in benchmarks.glob("gpu-*.jsonl"))):
        for record in records(benchmarks / name):
            if "phases" not in record:
                continue
            phases = "; ".join(
                f"{phase} {value['measured_bytes'] / GIB:.1f} GiB (plan {value['planned_over_measured']:.2f}x)"
                for phase, value in record["phases"].items()
            )
            command = shlex.join(["python", "scripts/bench_host_memory.py", "--", *record["job"]])
            rows.append([record["label"], phases, _machine(record), record["date"], f"`{command}`"])
    return _table(["what", "host peak per phase (planned / measured)", "machine", "date", "command"], rows)


def plan_table(benchmarks: Path) -> str:
    """`difftune plan`'s predicted peak against the measured one (scripts/bench_plan.py)."""
    rows = [
        [
            record["job"],
            f"{record['measured_peak_bytes'] / 2**20:.0f}",
            f"{record['predicted_peak_bytes'] / 2**20:.0f}",
            f"{record['predicted_over_measured']:.2f}x",
            _machine(record),
            record["date"],
            f"`python scripts/bench_plan.py --jobs {record['job']} --dry-run`",
        ]
        for record in records(benchmarks / "cpu-plan-vs-measured.jsonl")
    ]
    return _table(["job", "measured MiB", "planned MiB", "planned / measured", "machine", "date", "command"], rows)


def _scores(record: dict) -> tuple[float, float] | None:
    """A quality run's held-out color after training and its forgetting: as bench_quality.py writes them, or from
    the `difftune eval` report a video job's line holds (clips: color and shape in every frame)."""
    if "concept_after" in record:
        return record["concept_after"], record["forgetting"]
    if "report" in record:
        return record["report"]["after"]["concept"]["both"], record["report"]["forgetting"]
    return None


def _seed(record: dict) -> str | None:
    """The seed of a run of the job as shipped (no override but its seed: "0" for none), or None for a variant."""
    overrides = record.get("overrides", [])
    if _scores(record) is None or not all(o.startswith("train.seed=") for o in overrides):
        return None
    return overrides[-1].removeprefix("train.seed=") if overrides else "0"


def quality_table(benchmarks: Path, configs: Path) -> str:
    """Each bundled default job's result on its tiny base (scripts/bench_quality.py), each seed's newest run (older
    ones were of earlier builds of the base or the job) from the job's files (`quality-finetune-<job>*.jsonl`): the
    held-out color drawn after training (1.00: every sample right), and the forgetting of the seen prompts."""
    jobs = {"tiny_lora": [benchmarks / "quality-finetune.jsonl"]}
    shipped = [config.stem for config in configs.glob("*.toml")]  # a file is its job's, or a variant's of it
    for path in sorted(benchmarks.glob("quality-finetune-*.jsonl")):
        named = path.stem.removeprefix("quality-finetune-")
        job = max((stem for stem in shipped if named == stem or named.startswith(stem + "-")), key=len, default=None)
        if job:
            jobs.setdefault(job, []).append(path)
    rows = []
    for job, paths in sorted(jobs.items()):
        runs = sorted((record for path in paths for record in records(path) if _seed(record)), key=lambda r: r["date"])
        newest = list({_seed(record): record for record in runs}.values())  # the last of each seed, by date
        if not newest:
            continue
        after, forgetting = zip(*(_scores(record) for record in newest), strict=True)
        if all("report" in record for record in newest):  # the job run and scored as a user would
            base = re.match(r"models/[\w-]+", newest[-1]["base"]).group(0)
            command = (
                f"difftune train --config configs/{job}.toml && difftune eval --base {base} "
                f"--adapter output/{job}/pytorch_lora_weights.safetensors"
            )
        else:
            command = f"python scripts/bench_quality.py --job {job}"
        rows.append(
            [
                f"`configs/{job}.toml`",
                str(len(newest)),
                f"{min(after):.2f}-{max(after):.2f}",
                f"{min(forgetting):.3f} to {max(forgetting):.3f}",
                CPU,
                max(record["date"] for record in newest),
                f"`{command}`",
            ]
        )
    header = ["job", "seeds", "purple after", "forgetting", "machine", "newest", "command"]
    return _table(header, rows)


def family_jobs_table(benchmarks: Path) -> str:
    """The shipped jobs of the families without a tiny base, on their micro models (scripts/family_jobs.py): the
    validation loss over the run, and the largest pixel difference of the written files redrawn in each layout."""
    rows = []
    for record in records(benchmarks / "family_jobs.jsonl"):
        losses = record["validation_loss"]
        parity = ", ".join(f"{layout} {value}" for layout, value in record["parity_max_pixel_difference"].items())
        rows.append(
            [
                f"`{record['config']}`",
                str(record["steps"]),
                f"{losses[0][1]:.4f} to {losses[-1][1]:.4f}",
                parity,
                CPU,
                record["date"],
                f"`python scripts/family_jobs.py --family {record['family']}`",
            ]
        )
    return _table(["job", "steps", "validation loss", "parity (levels)", "machine", "date", "command"], rows)
