"""Where a run's peak RSS comes from: anonymous memory (tensors, activations) or mapped files (weights that
safetensors memory-maps), sampled over the whole run of a command (Linux /proc only).

    python scripts/rss_trace.py --out benchmarks/rss-trace.jsonl -- difftune train --config configs/X.toml

Writes one JSON line per sample ({"t": s, "anon_mib": .., "file_mib": ..}) and a last line with the peak; prints
the peak. GNU time's "maximum resident set size", which the peer bench reports, is the peak of anon + file.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

FIELDS = {"anon_mib": re.compile(r"RssAnon:\s+(\d+) kB"), "file_mib": re.compile(r"RssFile:\s+(\d+) kB")}


def sample(pid: int) -> dict | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None  # the process ended between poll and read
    found = {name: pattern.search(status) for name, pattern in FIELDS.items()}
    if not all(found.values()):
        return None  # a zombie has no memory lines
    return {name: round(int(match[1]) / 1024) for name, match in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSONL file for the samples (overwritten)")
    parser.add_argument("--every", type=float, default=0.2, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to trace after --")
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    samples = []
    while process.poll() is None:
        if (memory := sample(process.pid)) is not None:
            samples.append({"t": round(time.monotonic() - started, 1), **memory})
        time.sleep(args.every)
    if process.returncode or not samples:
        sys.exit(f"rss_trace: {command[0]} exited with {process.returncode} after {len(samples)} samples")
    peak = max(samples, key=lambda s: s["anon_mib"] + s["file_mib"])
    summary = {
        "peak_mib": peak["anon_mib"] + peak["file_mib"],
        **{f"peak_{k}": v for k, v in peak.items()},
        "command": command,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(s) + "\n" for s in [*samples, summary]))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
