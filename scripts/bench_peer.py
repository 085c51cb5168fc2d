"""difftune side by side with diffusers' LoRA example, through the shared harness (../shared/peer-bench).

    python scripts/bench_peer.py --peer-script PEER_DIR/train_text_to_image_lora.py [--scenario NAME ...]
    python scripts/bench_peer.py --table        # only rewrite the benchmarks page's table from the JSONL
    python scripts/bench_peer.py --peer-script P --harness H --results OUT.jsonl --scenario identical-sd15-512-bf16-cuda
                                                # on a GPU machine, the harness carried beside the repository

Each scenario runs the harness's `run_peer.py` and `run_difftune.py` one after the other (peer first, so the
two trainers alternate across scenarios), appends both JSON lines to benchmarks/peer.jsonl, and rewrites the
table between the `peer-bench` markers of the benchmarks page (docs/benchmarks.md): per scenario, the medians over
its sittings at the newest sitting's settings, and the spread of the speed ratio between sittings. The numbers are
never typed by hand. The harness README says how to get the peer script; it is never copied here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT.parent / "shared" / "peer-bench"
RESULTS = ROOT / "benchmarks" / "peer.jsonl"
MARKERS = ("<!-- peer-bench:start -->", "<!-- peer-bench:end -->")
# The harness spells the peer's settings for difftune; caches `off` makes the work per step identical (the
# peer encodes every image and caption every step). The `recommended` pair is each trainer's own way to the
# same job: the peer's README command (its flags that run on a CPU), difftune's defaults (caches on); and the
# same with difftune's frozen UNet stored in fp16 and computed in fp32, its low-memory setting on a CPU.
IDENTICAL = ["cache.latents=off", "cache.text=off"]
GPU_COMMON = [
    "--size",
    "sd15",
    "--resolution",
    "512",
    "--batch",
    "4",
    "--steps",
    "10",
    "160",
    "--mixed-precision",
    "bf16",
]
SCENARIOS = {
    "identical-sd15-fp32": dict(
        what="identical settings, SD1.5-shaped, 256 px, batch 1, fp32",
        common=["--size", "sd15", "--resolution", "256", "--batch", "1", "--steps", "3", "12"],
        peer=[],
        difftune=IDENTICAL,
    ),
    "identical-sd15-bf16": dict(
        what="identical settings, SD1.5-shaped, 256 px, batch 1, bf16 autocast",
        common=[
            "--size",
            "sd15",
            "--resolution",
            "256",
            "--batch",
            "1",
            "--steps",
            "3",
            "12",
            "--mixed-precision",
            "bf16",
        ],
        peer=[],
        difftune=IDENTICAL,
    ),
    "identical-tiny-fp32": dict(
        what="identical settings, tiny model, 64 px, batch 2, fp32",
        common=["--size", "tiny", "--resolution", "64", "--batch", "2", "--steps", "20", "520", "--repeats", "2"],
        peer=[],
        difftune=IDENTICAL,
    ),
    "recommended-sd15": dict(
        what="each trainer's recommended LoRA job (random flips), SD1.5-shaped, 256 px, batch 1",
        common=["--size", "sd15", "--resolution", "256", "--batch", "1", "--steps", "3", "12"],
        peer=["--peer-arg=--random_flip"],
        difftune=["data.random_flip=true"],
    ),
    "recommended-sd15-fp16-stored": dict(
        what="the same, difftune's UNet stored in fp16 and computed in fp32 (less memory, slower)",
        common=["--size", "sd15", "--resolution", "256", "--batch", "1", "--steps", "3", "12"],
        peer=["--peer-arg=--random_flip"],
        difftune=["data.random_flip=true", "model.weight_dtype=fp16"],
    ),
    # On a GPU: the peer runs as `python launch.py` (the harness's accelerate launcher passes --cpu) and picks the
    # device as its Accelerator does; 512 px, batch 4, bf16, the settings a GPU user runs. 150 steps between the two
    # runs: at 0.15 s a step, the 40 of the first sitting (2026-12-04) were inside the processes' start-up noise.
    "identical-sd15-512-bf16-cuda": dict(
        what="identical settings, SD1.5-shaped, 512 px, batch 4, bf16 autocast, one GPU",
        common=GPU_COMMON,
        peer=["--launcher", "python"],
        difftune=IDENTICAL,
    ),
    # The suspect for the 9% the identical pair left in 2026-12: channels-last, which the peer does without.
    "identical-sd15-512-bf16-cuda-channels-first": dict(
        what="identical settings, SD1.5-shaped, 512 px, batch 4, bf16 autocast, one GPU, difftune channels-first",
        common=GPU_COMMON,
        peer=["--launcher", "python"],
        difftune=[*IDENTICAL, "train.channels_last=off"],
    ),
    # The suspect left (2026-12-04): difftune leaves SDPA's cuDNN kernel out on CUDA, the peer lets torch pick it.
    "identical-sd15-512-bf16-cuda-cudnn-attention": dict(
        what="identical settings, SD1.5-shaped, 512 px, batch 4, bf16 autocast, one GPU, difftune with cuDNN attention",
        common=GPU_COMMON,
        peer=["--launcher", "python"],
        difftune=[*IDENTICAL, "train.attention=sdpa_cudnn"],
    ),
    "recommended-sd15-512-bf16-cuda": dict(
        what="each trainer's recommended LoRA job (random flips), SD1.5-shaped, 512 px, batch 4, bf16, one GPU",
        common=GPU_COMMON,
        peer=["--launcher", "python", "--peer-arg=--random_flip"],
        difftune=["data.random_flip=true"],
    ),
}


def run_pair(name: str, peer_script: str, harness: Path) -> list[dict]:
    scenario = SCENARIOS[name]
    # The environment's own command, else the one on PATH (a machine where the project is not installed)
    difftune = Path(sys.executable).with_name("difftune")
    if not difftune.exists() and shutil.which("difftune") is None:  # found before the peer's minutes, not after
        sys.exit(
            "bench_peer: no `difftune` command beside this Python or on PATH; install the project, or put on PATH "
            "a script that runs difftune.cli.main (scripts/gpu_suite.sh writes one)"
        )
    sides = {  # trainer -> (harness command, its own arguments)
        "diffusers-example": ([str(harness / "run_peer.py"), "--peer-script", peer_script], scenario["peer"]),
        "difftune": (
            [str(harness / "run_difftune.py"), "--difftune", str(difftune) if difftune.exists() else "difftune"],
            scenario["difftune"],
        ),
    }
    records = []
    for trainer, (command, own) in sides.items():
        print(f"{name}: {trainer}", file=sys.stderr, flush=True)
        done = subprocess.run(
            [sys.executable, *command, *scenario["common"], *own], stdout=subprocess.PIPE, text=True, check=True
        )
        result = json.loads(done.stdout.strip().splitlines()[-1])
        records.append(
            {
                "scenario": name,
                "trainer": trainer,
                "what": scenario["what"],
                "args": scenario["common"] + own,
                "date": time.strftime("%Y-%m-%d %H:%M"),
                **result,
            }
        )
    return records


def sittings(records: list[dict]) -> dict[str, list[tuple[dict, dict]]]:
    """Per scenario, its sittings as (peer, difftune) pairs: each difftune line with the peer line run just before
    it. Only the sittings with the newest sitting's settings count (the steps of a scenario may change)."""
    pairs: dict[str, list[tuple[dict, dict]]] = {}
    waiting: dict[str, dict] = {}
    for record in records:
        if record["trainer"] == "diffusers-example":
            waiting[record["scenario"]] = record
        elif (peer := waiting.pop(record["scenario"], None)) is not None:
            pairs.setdefault(record["scenario"], []).append((peer, record))

    def settings(pair: tuple[dict, dict]) -> tuple:
        return tuple(record.get("args") for record in pair)

    return {name: [pair for pair in found if settings(pair) == settings(found[-1])] for name, found in pairs.items()}


def machine(record: dict) -> str:
    """Where a sitting ran, as its record says: a CUDA scenario on the leased GPU machine, the others on this CPU."""
    kind = "GPU machine" if record["scenario"].endswith("cuda") or "-cuda-" in record["scenario"] else "CPU"
    return f"{kind}, {record['threads']} threads" if record.get("threads") else kind


def markdown_table(records: list[dict]) -> str:
    lines = [
        "| scenario | sittings | peer s/step (in-run) | difftune s/step (in-run) | "
        "speed ratio (range) | peer peak RSS MB | difftune peak RSS MB | RSS ratio | newest | machine | command |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    found = sittings(records)
    for name, scenario in SCENARIOS.items():
        if name not in found:
            continue
        pairs = found[name]
        # Steps per second, difftune over peer (>1: difftune faster), from the in-run timing (the start-up
        # noise of two whole processes is ±20% here), per sitting; the median and the spread over sittings
        # say how far one sitting can be trusted. RSS difftune over peer (<1: difftune leaner).
        speed = sorted(peer["sec_per_step_inrun"] / ours["sec_per_step_inrun"] for peer, ours in pairs)
        rss = statistics.median(ours["peak_rss_mb"] / peer["peak_rss_mb"] for peer, ours in pairs)

        def median(trainer: int, key: str, pairs: list = pairs) -> float:
            return statistics.median(pair[trainer][key] for pair in pairs)

        lines.append(
            f"| {scenario['what']} | {len(pairs)} | {median(0, 'sec_per_step'):.3g} "
            f"({median(0, 'sec_per_step_inrun'):.3g}) | "
            f"{median(1, 'sec_per_step'):.3g} ({median(1, 'sec_per_step_inrun'):.3g}) | "
            f"{statistics.median(speed):.2f}x ({speed[0]:.2f}-{speed[-1]:.2f}) | "
            f"{median(0, 'peak_rss_mb'):.0f} | {median(1, 'peak_rss_mb'):.0f} | {rss:.2f}x | "
            f"{pairs[-1][1].get('date', '')[:10]} | {machine(pairs[-1][1])} | "
            f"`python scripts/bench_peer.py --peer-script PEER --scenario {name}` |"
        )
    return "\n".join(lines)


def write_table(benchmarks: Path = ROOT / "docs" / "benchmarks.md") -> None:
    records = [json.loads(line) for line in RESULTS.read_text(encoding="utf-8").splitlines() if line.strip()]
    text = benchmarks.read_text(encoding="utf-8")
    start, end = (text.index(marker) for marker in MARKERS)
    table = f"{MARKERS[0]}\n{markdown_table(records)}\n"
    benchmarks.write_text(text[:start] + table + text[end:], encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-script", help="your copy of diffusers' train_text_to_image_lora.py")
    parser.add_argument("--scenario", action="append", choices=SCENARIOS, help="default: all, in order")
    parser.add_argument("--table", action="store_true", help="only rewrite the benchmarks page's table from the JSONL")
    parser.add_argument("--harness", type=Path, default=HARNESS, help=f"the peer-bench folder (default {HARNESS})")
    parser.add_argument("--results", type=Path, default=RESULTS, help=f"the JSONL to append to (default {RESULTS})")
    args = parser.parse_args()
    if not args.table:
        if not args.peer_script or not os.path.isfile(args.peer_script):
            parser.error(
                f"--peer-script {args.peer_script!r} is not a file; {args.harness / 'README.md'} says how to get it"
            )
        for name in args.scenario or SCENARIOS:
            records = run_pair(name, os.path.abspath(args.peer_script), args.harness.resolve())
            with open(args.results, "a", encoding="utf-8") as out:
                out.writelines(json.dumps(record) + "\n" for record in records)
    if args.results == RESULTS:
        write_table()


if __name__ == "__main__":
    main()
