"""scripts/gpu_suite.sh is run where a GPU is lent, rarely: its dry run keeps it runnable between leases. One
section here (the rest by hand: `bash scripts/gpu_suite.sh --dry-run`, docs/contributing/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_suite_dry_run_runs_a_section_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    environment = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", "scripts/gpu_suite.sh", "--dry-run", "flux"],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    assert summary.split()[:2] == ["flux-1024-b1", "rc=0"], summary
    (row,) = [json.loads(line) for line in (out / "gpu.jsonl").read_text().splitlines()]
    # The job as it ran: shrunk to the tiny Flux at 64 px on the CPU, with its measurements.
    assert (row["model"], row["resolution"], row["dry_run"], row["device"]) == ("tiny-flux", 64, True, "cpu")
    assert row["seconds_per_step"] > 0 and row["peak_memory_bytes"] > 0
