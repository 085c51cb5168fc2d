"""Benchmark training speed: `python scripts/bench.py --model sd15 --resolution 256 --compare cache`.

Prints one JSON line per run (seconds per step, samples/s, peak memory, MFU on GPU). With --compare,
runs the option off and on, each in its own process (so peak memories do not mix), and prints a
last line with the on/off ratios measured in this invocation.
"""

import argparse
import dataclasses
import json
import subprocess
import sys

from difftune.toy.bench import BenchOptions, measure

TOGGLES = ("cache", "channels_last", "compile", "gradient_checkpointing")  # compile: CUDA only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(BenchOptions):
        flag = "--" + field.name.replace("_", "-")
        if field.type in (bool, "bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default)
    parser.add_argument("--compare", choices=TOGGLES, help="run with this toggle off and on, and print the ratios")
    args = parser.parse_args()
    options = BenchOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(BenchOptions)})
    if not args.compare:
        print(json.dumps(measure(options)))
        return
    results = {}
    for value in (False, True):
        argv = [a for a in sys.argv[1:] if a not in ("--compare", args.compare)]
        flag = "--" + args.compare.replace("_", "-")
        run = subprocess.run(
            [sys.executable, __file__, *argv, flag if value else "--no-" + flag[2:]], capture_output=True, text=True
        )
        if run.returncode:
            sys.exit(run.stderr)
        results[value] = json.loads(run.stdout.strip().splitlines()[-1])
        print(json.dumps(results[value]))
    off, on = results[False], results[True]
    print(
        json.dumps(
            {
                "compare": args.compare,
                "seconds_per_step_ratio": on["seconds_per_step"] / off["seconds_per_step"],
                "peak_memory_ratio": on["peak_memory_bytes"] / off["peak_memory_bytes"],
            }
        )
    )


if __name__ == "__main__":
    main()
