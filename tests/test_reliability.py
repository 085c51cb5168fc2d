"""Kill it at any moment, resume, and get the same run; safe loading; clear refusals."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune import checkpoint as checkpoint_module
from difftune.checkpoint import MARKER, complete_checkpoints, find_checkpoint
from difftune.errors import DifftuneError
from difftune.metrics import read_metrics
from difftune.train import train

from conftest import REPO


def _same_files(a: Path, b: Path) -> bool:
    first, second = load_file(a), load_file(b)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def _losses(output_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(output_dir)}


def _job(make_config, out, **overrides):
    settings = {
        "train__max_steps": 8, "checkpoint__every_steps": 2, "ema__enabled": True, "adapter__dropout": 0.1,
        "train__output_dir": str(out), **overrides,
    }
    return make_config(**settings)


def test_resume_continues_exactly(make_config, tmp_path):
    """Stopped at step 4 then resumed (twice), the run matches an uninterrupted one bit for bit.

    Adapter dropout is on, so the resumed run must also restore the global torch RNG state."""
    whole = tmp_path / "whole"
    train(_job(make_config, whole))
    parts = tmp_path / "parts"
    train(_job(make_config, parts, train__max_steps=4))
    train(_job(make_config, parts, train__max_steps=6), resume="auto")
    train(_job(make_config, parts), resume="auto")
    assert _losses(parts) == _losses(whole)  # every step, the same loss
    assert list(_losses(parts)) == list(range(1, 9))  # each step once
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_ema.safetensors"):
        assert _same_files(whole / name, parts / name), name
    assert [p.name for p in complete_checkpoints(parts)] == ["step-000004", "step-000006", "step-000008"]  # keep_last 3


def test_a_crash_while_writing_a_checkpoint_loses_nothing(make_config, tmp_path, monkeypatch):
    """Dying after the files are written but before the rename: the half-written checkpoint is never used."""
    whole = tmp_path / "whole"
    train(_job(make_config, whole, ema__enabled=False))
    out = tmp_path / "crash"
    real = checkpoint_module._fsync_tree
    calls = {"n": 0}

    def die_on_third_checkpoint(root):
        calls["n"] += 1
        real(root)
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed while writing the step-6 checkpoint")

    monkeypatch.setattr(checkpoint_module, "_fsync_tree", die_on_third_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        train(_job(make_config, out, ema__enabled=False))
    monkeypatch.setattr(checkpoint_module, "_fsync_tree", real)
    assert (out / "checkpoints" / ".tmp-step-000006").is_dir()
    assert find_checkpoint(out, "auto").name == "step-000004"
    train(_job(make_config, out, ema__enabled=False), resume="auto")
    assert _losses(out) == _losses(whole)
    assert _same_files(whole / "pytorch_lora_weights.safetensors", out / "pytorch_lora_weights.safetensors")


def test_a_checkpoint_without_its_marker_is_ignored(make_config, tmp_path):
    out = tmp_path / "run"
    train(_job(make_config, out, train__max_steps=6, ema__enabled=False))
    (out / "checkpoints" / "step-000006" / MARKER).unlink()
    assert find_checkpoint(out, "auto").name == "step-000004"
    with pytest.raises(DifftuneError, match="not a complete checkpoint"):
        find_checkpoint(out, str(out / "checkpoints" / "step-000006"))


def test_resume_refuses_changes_that_make_it_another_run(make_config, tmp_path, capsys):
    out = tmp_path / "run"
    train(_job(make_config, out, train__max_steps=2))
    expected = r"cannot resume.*\n  adapter\.alpha: 4\.0 -> 8\.0\n  adapter\.rank: 4 -> 8\n  data\.resolution: 32 -> 64"
    with pytest.raises(DifftuneError, match=expected):
        train(_job(make_config, out, train__max_steps=4, data__resolution=64, adapter__rank=8), resume="auto")
    with pytest.raises(DifftuneError, match=r"global batch \(train\.batch_size x processes\): 2 -> 4"):
        train(_job(make_config, out, train__max_steps=4, train__batch_size=4), resume="auto")
    capsys.readouterr()
    train(_job(make_config, out, train__max_steps=4, optim__learning_rate=5e-4), resume="auto")
    printed = capsys.readouterr().out
    assert "resuming with a changed setting: optim.learning_rate: 0.001 -> 0.0005" in printed
    assert "resuming with a changed setting: train.max_steps: 2 -> 4" in printed


def test_resume_fails_loudly_when_a_part_is_missing(make_config, tmp_path):
    out = tmp_path / "run"
    train(_job(make_config, out, train__max_steps=2))
    (out / "checkpoints" / "step-000002" / "trained.safetensors").unlink()
    with pytest.raises(DifftuneError, match=r"step-000002 is missing trained\.safetensors"):
        train(_job(make_config, out, train__max_steps=4), resume="auto")


def test_resume_auto_without_a_checkpoint_starts_fresh(make_config, tmp_path):
    result = train(_job(make_config, tmp_path / "new", train__max_steps=2), resume="auto")
    assert len(result.losses) == 2


def test_accelerate_state_is_loaded_without_pickle_code(make_config, tmp_path, monkeypatch):
    out = tmp_path / "run"
    train(_job(make_config, out, train__max_steps=2))
    real_load = torch.load
    seen = []

    def only_weights(*args, **kwargs):
        assert kwargs.get("weights_only") is True, "torch.load without weights_only=True"
        seen.append(args[0])
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", only_weights)
    train(_job(make_config, out, train__max_steps=4), resume="auto")
    assert any("optimizer" in str(path) for path in seen) and any("random_states" in str(path) for path in seen)


def test_no_unsafe_torch_load_in_the_library():
    offenders = []
    for path in (REPO / "difftune").rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if re.search(r"torch\.load\(", line) and "weights_only=True" not in line:
                offenders.append(f"{path.relative_to(REPO)}:{number}")
    assert offenders == []


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_is_bit_identical(tmp_path):
    common = [
        sys.executable, "-m", "difftune.cli", "train", "--config", "configs/tiny_lora.toml", "train.max_steps=60",
        "checkpoint.every_steps=5", "sample.prompts=[]", "log.progress_bar=false", "log.tensorboard=false",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    whole = subprocess.run([*common, f"train.output_dir={tmp_path / 'whole'}"], cwd=REPO, env=env, capture_output=True, timeout=600)
    assert whole.returncode == 0, whole.stderr[-2000:]

    killed = tmp_path / "killed"
    process = subprocess.Popen([*common, f"train.output_dir={killed}"], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        if (killed / "metrics.jsonl").exists() and len((killed / "metrics.jsonl").read_text().splitlines()) >= 22:
            break
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    rows = read_metrics(killed)
    assert 22 <= len(rows) < 60, "the run was not killed mid-way"
    resume_point = find_checkpoint(killed, "auto").name
    resumed = subprocess.run([*common, f"train.output_dir={killed}", "--resume", "auto"], cwd=REPO, env=env, capture_output=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {killed / 'checkpoints' / resume_point}" in resumed.stdout.decode()
    assert _losses(killed) == _losses(tmp_path / "whole")
    assert _same_files(tmp_path / "whole" / "pytorch_lora_weights.safetensors", killed / "pytorch_lora_weights.safetensors")
