"""scripts/bench_big_peer.py (difftune beside diffusers' DreamBooth LoRA scripts for FLUX.1 and Qwen-Image) runs
end to end on the CPU at toy widths, so that a GPU lease only measures. The peer's scripts are never in this
repository: with `DIFFTUNE_PEER_DIR` naming a folder that holds them the dry run runs both sides, else difftune's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, script_module


@pytest.fixture(scope="module")
def bench_big_peer():
    return script_module("bench_big_peer")


@pytest.mark.slow
def test_the_dry_run_trains_each_side_and_writes_a_line_per_trainer(bench_big_peer, tmp_path):
    peer_dir = os.environ.get("DIFFTUNE_PEER_DIR")
    results = tmp_path / "peer-big.jsonl"
    scenarios = ["--scenario", "flux-1024-low-memory", "--scenario", "qwen-1024-bf16"]
    run = subprocess.run(
        [sys.executable, "scripts/bench_big_peer.py", "--dry-run", *scenarios, "--workdir", str(tmp_path / "work")]
        + ["--results", str(results), *(["--peer-dir", peer_dir] if peer_dir else [])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in results.read_text().splitlines()]
    trainers = ["diffusers-dreambooth", "difftune"] if peer_dir else ["difftune"]
    assert [(r["scenario"], r["trainer"]) for r in records] == [
        (scenario, trainer) for scenario in ("flux-1024-low-memory", "qwen-1024-bf16") for trainer in trainers
    ]
    for record in records:
        # Shrunk to the tiny bases at 64 px, fp32, timed after the warm-up step, with the process's own host peak.
        assert (record["resolution"], record["precision"], record["dry_run"], record["device"]) == (
            64,
            "no",
            True,
            "cpu",
        )
        assert record["sec_per_step_inrun"] > 0 and record["peak_rss_mib"] > 100
        assert record["device_peak_reserved_mib"] is None
    flux = next(r for r in records if r["scenario"] == "flux-1024-low-memory" and r["trainer"] == "difftune")
    # difftune's side of the low-memory pair: fp8 frozen weights, checkpointed, latents cached, the peer's layers.
    assert {"model.weight_dtype=fp8", "train.gradient_checkpointing=true", "cache.latents=on"} <= set(flux["command"])
    assert f"adapter.target_modules={json.dumps(bench_big_peer.FLUX_TARGETS)}" in flux["command"]
    if not peer_dir:
        assert "the peer's side is left out" in run.stderr


def test_both_sides_are_given_the_same_settings(bench_big_peer, tmp_path):
    class Args:
        steps, precision, peer_dir = 20, "bf16", str(tmp_path)

    base = tmp_path / "base"
    (base / "tokenizer_2").mkdir(parents=True)
    (base / "tokenizer_2" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    peer = bench_big_peer.peer_command(Args, "flux", 1024, ["--cache_latents"], base, tmp_path / "i", tmp_path / "o")
    ours = bench_big_peer.difftune_command(Args, "flux", 1024, [], base, tmp_path / "c", tmp_path / "o")
    flags = dict(zip(peer[1::2], peer[2::2], strict=False))
    settings = dict(item.split("=", 1) for item in ours[3:])
    pairs = [  # (the peer's flag, difftune's key)
        ("--resolution", "data.resolution"),
        ("--rank", "adapter.rank"),
        ("--lora_alpha", "adapter.alpha"),
        ("--learning_rate", "optim.learning_rate"),
        ("--max_train_steps", "train.max_steps"),
        ("--mixed_precision", "train.mixed_precision"),
        ("--train_batch_size", "train.batch_size"),
    ]
    assert [flags[flag] for flag, _ in pairs] == [settings[key] for _, key in pairs]
    assert flags["--max_sequence_length"] == "512"  # the base's T5 length, which difftune pads to
    assert flags["--lr_scheduler"] == settings["optim.lr_schedule"] == "constant"
    assert json.loads(settings["adapter.target_modules"]) == bench_big_peer.FLUX_TARGETS
    assert peer[-1] == "--cache_latents"


def test_the_table_pairs_each_scenarios_newest_gpu_sitting(bench_big_peer, tmp_path):
    def record(trainer, seconds, device_mib, date, dry_run=False):
        return {
            "scenario": "flux-1024-bf16",
            "trainer": trainer,
            "what": "FLUX.1 row",
            "device": "NVIDIA H100",
            "date": date,
            "dry_run": dry_run,
            "sec_per_step_inrun": seconds,
            "device_peak_reserved_mib": device_mib,
            "peak_rss_mib": 2048,
        }

    records = [
        record("diffusers-dreambooth", 3.0, 40960, "2026-12-01 10:00"),  # an older sitting
        record("difftune", 3.0, 40960, "2026-12-01 10:05"),
        record("diffusers-dreambooth", 2.2, 51200, "2026-12-06 10:00"),
        record("difftune", 2.0, 30720, "2026-12-06 10:05"),
        record("difftune", 0.1, 1, "2026-12-07 10:00", dry_run=True),  # a dry run: never a row
    ]
    results, benchmarks = tmp_path / "peer-big.jsonl", tmp_path / "benchmarks.md"
    results.write_text("".join(json.dumps(r) + "\n" for r in records))
    benchmarks.write_text(f"before\n{bench_big_peer.MARKERS[0]}\nold\n{bench_big_peer.MARKERS[1]}\nafter\n")
    bench_big_peer.write_table(results, benchmarks)
    text = benchmarks.read_text()
    (row,) = [line for line in text.splitlines() if line.startswith("| FLUX.1 row")]
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1:6] == ["NVIDIA H100", "2026-12-06", "2.2", "2", "1.10x"]
    assert cells[6:10] == ["50.0", "30.0", "2.0", "2.0"]
    assert text.startswith("before\n") and text.endswith(f"{bench_big_peer.MARKERS[1]}\nafter\n")
