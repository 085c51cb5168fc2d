"""Run each family's shipped job on its micro model: `python scripts/family_jobs.py [--family krea2 ...] [--steps 200]`.

For the families without a bundled tiny base (difftune/toy/family_jobs.py says what a row shows): their config file
from configs/ on the purple renders at 32 px. Prints one JSON line per family and appends it to --out
(benchmarks/family_jobs.jsonl).
"""

import argparse
import json
import tempfile
from datetime import date
from pathlib import Path

from difftune.toy.family_jobs import FAMILY_CONFIGS, run_family_job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", choices=sorted(FAMILY_CONFIGS), help="default: every one")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/family_jobs.jsonl"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        for family in args.family or sorted(FAMILY_CONFIGS):
            row = {"date": date.today().isoformat(), **run_family_job(family, Path(work), args.steps)}
            print(json.dumps(row), flush=True)
            with args.out.open("a", encoding="utf-8") as out:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
