"""Check that a change leaves training unchanged: every bundled tiny base's default job, bit for bit.

    python scripts/same_adapters.py record [--steps 40]   # before the change: writes benchmarks/same_adapters.json
    python scripts/same_adapters.py check                 # after it: the same jobs, the same steps, the same files

A job is a config in configs/ whose `model.base` is a bundled tiny base (models/tiny-*), run through the `difftune`
command as users run it, with `--steps` optimizer steps (the shipped count with `--steps 0`) and no sampling. Every
tensor of every `.safetensors` file the run writes (the adapter in both layouts, an embedding, a merged model) is
hashed; `check` names each job, file and tensor that differs. The digests hold for one machine and one set of
packages: record and check on the same ones.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib
import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "benchmarks" / "same_adapters.json"
# What the check leaves out of a shipped job: drawing (it does not change what trains) and the checkpoints (not a
# result).
QUIET = [
    "sample.prompts=[]",
    "sample.before=false",
    "sample.every_steps=0",
    "checkpoint.every_steps=0",
    "log.tensorboard=false",
    "log.progress_bar=false",
]


def tiny_base_jobs() -> list[Path]:
    """The shipped configs that train a bundled tiny base."""
    jobs = []
    for config in sorted((REPO / "configs").glob("*.toml")):
        base = tomllib.loads(config.read_text(encoding="utf-8")).get("model", {}).get("base", "")
        if Path(base).parent.name == "models" and Path(base).name.startswith("tiny-"):
            jobs.append(config)
    return jobs


def tensor_digests(folder: Path) -> dict[str, dict[str, str]]:
    """sha256 of each tensor's bytes, dtype and shape, per safetensors file under `folder` (relative names)."""
    digests = {}
    for path in sorted(folder.rglob("*.safetensors")):
        with safe_open(path, framework="pt") as tensors:
            digests[str(path.relative_to(folder))] = {
                name: hashlib.sha256(
                    f"{tensor.dtype}{tuple(tensor.shape)}".encode()
                    + tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                ).hexdigest()
                for name in sorted(tensors.keys())
                for tensor in (tensors.get_tensor(name),)
            }
    return digests


def run_job(config: Path, steps: int, work: Path) -> dict[str, dict[str, str]]:
    """The job's written tensors' digests, after `steps` optimizer steps (0: as shipped)."""
    output = work / config.stem
    overrides = [
        f"train.output_dir={output}",
        "train.overwrite=true",
        f"cache.dir={work / 'cache' / config.stem}",
        *QUIET,
    ]
    if steps:
        overrides.append(f"train.max_steps={steps}")
    command = [sys.executable, "-m", "difftune.cli", "train", "--config", str(config), "--quiet", *overrides]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    if done.returncode:
        raise SystemExit(f"{config.name} failed:\n{done.stderr[-4000:]}")
    return tensor_digests(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("record", "check"))
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per job (record; 0: as shipped)")
    parser.add_argument(
        "--record", type=Path, default=RECORD, help=f"the digests' file (default {RECORD.relative_to(REPO)})"
    )
    parser.add_argument("--job", action="append", help="only these configs' names (e.g. tiny_lora)")
    args = parser.parse_args()
    recorded = json.loads(args.record.read_text()) if args.action == "check" else {}
    steps = recorded.get("steps", args.steps)
    jobs = [job for job in tiny_base_jobs() if not args.job or job.stem in args.job]
    results, differ = {}, []
    with tempfile.TemporaryDirectory() as work:
        for config in jobs:
            results[config.stem] = run_job(config, steps, Path(work))
            if args.action == "check":
                before = recorded["jobs"].get(config.stem)
                if before is None:
                    print(f"{config.stem}: not recorded", flush=True)
                    continue
                changed = [
                    f"{file}:{name}"
                    for file in sorted(set(before) | set(results[config.stem]))
                    for name in sorted(set(before.get(file, {})) | set(results[config.stem].get(file, {})))
                    if before.get(file, {}).get(name) != results[config.stem].get(file, {}).get(name)
                ]
                differ += [f"{config.stem} {item}" for item in changed]
                print(f"{config.stem}: {'same' if not changed else f'{len(changed)} tensors differ'}", flush=True)
            else:
                print(f"{config.stem}: {sum(len(file) for file in results[config.stem].values())} tensors", flush=True)
    if args.action == "record":
        args.record.write_text(json.dumps({"steps": steps, "jobs": results}, indent=1) + "\n")
        print(f"wrote {args.record}")
    elif differ:
        raise SystemExit("differ:\n" + "\n".join(differ[:50]))
    else:
        print(f"all {len(jobs)} jobs' files bit-identical")


if __name__ == "__main__":
    main()
