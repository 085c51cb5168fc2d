"""What sealing and checking checkpoints costs: `python scripts/bench_checkpoint.py --model sd15`.

Trains one step of a full fine-tune (`adapter.kind = "none"`, AdamW) of the model spec and checkpoints it, timing
the whole `Checkpointer.save` and the part of it that seals the folder (SHA-256 of every file, fsync, manifest),
then `checkpoint.verify` of the written checkpoint with the page cache warm and, where this user may drop it
(root on Linux), cold. Prints one JSON line.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from difftune.toy.bench import BenchOptions, _config, prepare_workspace
from difftune.training import checkpoint
from difftune.training.train import train


def _timed(function, seconds: list):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    return wrapper


def _drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sd15")
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "difftune-bench"))
    args = parser.parse_args()
    options = BenchOptions(
        model=args.model,
        resolution=args.resolution,
        batch=1,
        steps=1,
        warmup=0,
        adapter="none",
        cache=False,
        workdir=args.workdir,
    )
    root, model_dir, data_dir = prepare_workspace(options)
    output_dir = root / "checkpoint-run"
    config = _config(options, model_dir, data_dir, output_dir, root / "cache", 1)
    config.optim.optimizer = "adamw"
    config.checkpoint.every_steps = 1
    config.sample.prompts = []
    saves, seals = [], []
    checkpoint.Checkpointer.save = _timed(checkpoint.Checkpointer.save, saves)
    checkpoint._seal = _timed(checkpoint._seal, seals)
    train(config)
    written = checkpoint.complete_checkpoints(output_dir)[-1]
    size = sum(path.stat().st_size for path in written.rglob("*") if path.is_file())
    started = time.perf_counter()
    problem = checkpoint.verify(written)
    warm = time.perf_counter() - started
    cold = None
    if _drop_page_cache():
        started = time.perf_counter()
        checkpoint.verify(written)
        cold = time.perf_counter() - started
    print(
        json.dumps(
            {
                "model": args.model,
                "checkpoint_bytes": size,
                "files": len(json.loads((written / checkpoint.MANIFEST).read_text())["files"]),
                "save_seconds": saves[0],
                "seal_seconds": seals[0],
                "seal_share_of_save": seals[0] / saves[0],
                "verify_warm_seconds": warm,
                "verify_cold_seconds": cold,
                "verify_gb_per_second_warm": size / warm / 1e9,
                "verified": problem is None,
                "cpu_count": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
