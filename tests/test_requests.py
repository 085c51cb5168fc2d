"""A running job asked to draw its samples or save now (`difftune request`, the UI's buttons) does so at its next
step boundary and goes on; the request files are removed as they are answered."""

import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from safetensors.torch import load_file

from difftune.errors import DifftuneError
from difftune.training.metrics import read_metrics
from difftune.training.requests import REQUESTS_DIR, ask
from difftune.training.train import train

from conftest import REPO


def test_a_job_samples_and_saves_when_asked_and_goes_on(make_config, tmp_path):
    out = tmp_path / "run"
    ask(out, "sample")  # asked before its first step: answered at its first step boundary
    ask(out, "save")
    config = make_config(train__max_steps=3, sample__prompts=["a red circle"], sample__steps=2)
    train(config)
    assert (out / "samples" / "step-000001" / "grid.png").is_file()  # the samples, now
    assert not (out / "samples" / "step-000002").exists()  # once: the file was removed as it was answered
    assert (out / "checkpoints" / "step-000001" / "COMPLETE").is_file()  # a checkpoint to resume from
    snapshot = load_file(out / "snapshots" / "step-000001.safetensors")  # and the result so far, as a file
    assert snapshot and not list((out / REQUESTS_DIR).iterdir())
    assert [row["step"] for row in read_metrics(out)] == [1, 2, 3]  # it went on


def test_samples_asked_of_a_run_that_released_its_encoders_are_drawn_as_with_them(make_config, tmp_path):
    """A run with every encoder's output cached and no previews planned drops its encoders; asked to draw, it loads
    them for that draw: the samples are those of the same run that kept its encoders, and it goes on."""
    drawn = {}
    for cached in ("on", "off"):
        out = tmp_path / cached
        ask(out, "sample")
        config = make_config(
            train__output_dir=str(out),
            train__max_steps=2,
            sample__prompts=["a red circle"],
            sample__steps=2,
            cache__latents=cached,
            cache__text=cached,
        )
        train(config)
        with Image.open(out / "samples" / "step-000001" / "000.png") as image:
            drawn[cached] = np.asarray(image.convert("RGB"), dtype=np.int16)
        assert [row["step"] for row in read_metrics(out)] == [1, 2]
    assert np.abs(drawn["on"] - drawn["off"]).max() <= 2


def test_the_request_command_asks_a_run_and_refuses_a_folder_without_one(make_config, tmp_path):
    command = [sys.executable, "-m", "difftune.cli", "request"]
    refused = subprocess.run([*command, "save", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert refused.returncode != 0 and "no run there" in refused.stderr
    train(make_config(train__max_steps=1, sample__prompts=[]))
    asked = subprocess.run([*command, "sample", str(tmp_path / "run")], capture_output=True, text=True, cwd=REPO)
    assert asked.returncode == 0, asked.stderr
    assert (tmp_path / "run" / REQUESTS_DIR / "sample").is_file()
    with pytest.raises(DifftuneError, match="a running job can be asked to sample or save"):
        ask(tmp_path / "run", "stop")
