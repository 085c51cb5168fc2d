"""Run each family's shipped job on its micro model: `python scripts/family_jobs.py [--family krea2 ...] [--steps 200]`.

For the families without a bundled tiny base (difftune/toy/family_jobs.py says what a row shows): their config file
from configs/ on the purple renders at 32 px. Prints one JSON line per family and appends it to --out
(benchmarks/family_jobs.jsonl). `--all --set train.mixed_precision=bf16 --set adapter.kind=dora` sweeps a setting
over every family's text-to-image job, a row per family, or the settings' refusal, named.
"""

import argparse
import json
import tempfile
from datetime import date
from pathlib import Path

from difftune.errors import DifftuneError
from difftune.toy.family_jobs import ALL_FAMILY_CONFIGS, FAMILY_CONFIGS, run_family_job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--family", action="append", choices=sorted(ALL_FAMILY_CONFIGS), help="default: those without a tiny base"
    )
    parser.add_argument("--all", action="store_true", help="every family with a text-to-image job")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="an override on top of each job"
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/family_jobs.jsonl"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        for family in args.family or sorted(ALL_FAMILY_CONFIGS if args.all else FAMILY_CONFIGS):
            try:
                row = run_family_job(family, Path(work), args.steps, overrides=args.set)
            except DifftuneError as err:  # the settings refused for this family, by name
                row = {"family": family, "overrides": args.set, "refused": str(err)}
            row = {"date": date.today().isoformat(), **row}
            print(json.dumps(row), flush=True)
            with args.out.open("a", encoding="utf-8") as out:
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
