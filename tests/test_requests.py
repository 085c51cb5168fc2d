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
from difftune.training.run_requests import REQUESTS_DIR, RunRequests, ask
from difftune.training.train import train

from conftest import REPO


@pytest.fixture
def asked_as_it_trains(monkeypatch):
    """`ask(out, what)` for each of `whats` while the run holds its folder, just before its first step's boundary
    (as `difftune request` or the UI's buttons ask a run that trains)."""

    def ask_first(out, *whats):
        agreed, asked = RunRequests.agreed, []

        def asking(self, *args, **kwargs):
            if not asked:
                asked.extend(ask(out, what) for what in whats)
            return agreed(self, *args, **kwargs)

        monkeypatch.setattr(RunRequests, "agreed", asking)

    return ask_first


def test_a_job_samples_and_saves_when_asked_and_goes_on(make_config, tmp_path, asked_as_it_trains):
    out = tmp_path / "run"
    asked_as_it_trains(out, "sample", "save")  # answered at its first step boundary
    config = make_config(train__max_steps=3, sample__prompts=["a red circle"], sample__steps=2)
    train(config)
    assert (out / "samples" / "step-000001" / "grid.png").is_file()  # the samples, now
    assert not (out / "samples" / "step-000002").exists()  # once: the file was removed as it was answered
    assert (out / "checkpoints" / "step-000001" / "COMPLETE").is_file()  # a checkpoint to resume from
    snapshot = load_file(out / "snapshots" / "step-000001.safetensors")  # and the result so far, as a file
    assert snapshot and not list((out / REQUESTS_DIR).iterdir())
    assert [row["step"] for row in read_metrics(out)] == [1, 2, 3]  # it went on


def test_samples_asked_of_a_run_that_released_its_encoders_are_drawn_as_with_them(
    make_config, tmp_path, asked_as_it_trains
):
    """A run with every encoder's output cached and no previews planned drops its encoders; asked to draw, it loads
    them for that draw: the samples are those of the same run that kept its encoders, and it goes on."""
    drawn = {}
    for cached in ("on", "off"):
        out = tmp_path / cached
        asked_as_it_trains(out, "sample")
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


def test_the_request_command_refuses_a_folder_without_a_running_run(make_config, tmp_path, capsys):
    """A folder with no run, or whose run has ended (its folder not held), is refused: before, the finished run was
    told "asked ... to save at its next step" and the stale request fired on a later resume. A request left there all
    the same (a run killed before answering) is dropped by the next run, which says so."""
    command = [sys.executable, "-m", "difftune.cli", "request"]
    refused = subprocess.run([*command, "save", str(tmp_path)], capture_output=True, text=True, cwd=REPO)
    assert refused.returncode != 0 and "no run there" in refused.stderr
    train(make_config(train__max_steps=1, sample__prompts=[]))
    ended = subprocess.run([*command, "sample", str(tmp_path / "run")], capture_output=True, text=True, cwd=REPO)
    assert ended.returncode == 2 and "no run is training there now" in ended.stderr, ended.stderr
    assert "Traceback" not in ended.stderr and not (tmp_path / "run" / REQUESTS_DIR / "sample").exists()
    with pytest.raises(DifftuneError, match="a running job can be asked to sample or save"):
        ask(tmp_path / "run", "stop")

    left = tmp_path / "run" / REQUESTS_DIR / "save"
    left.parent.mkdir(exist_ok=True)
    left.touch()
    capsys.readouterr()
    train(make_config(train__max_steps=2, sample__prompts=[]), resume="auto")
    assert "a request to save left from before this run is dropped" in capsys.readouterr().out
    assert not left.exists() and not (tmp_path / "run" / "snapshots").exists()  # not answered


def test_requests_that_is_a_link_or_a_file_is_one_line_and_nothing_outside_is_touched(
    make_config, tmp_path, asked_as_it_trains
):
    """A `requests` planted as a link to a folder elsewhere, or a request file planted as a link to a file elsewhere:
    asking never writes there, and answering never deletes there; a `requests` that is a plain file is one line."""
    from difftune.training.output_lock import hold_output_dir

    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    with hold_output_dir(out):  # planted while the run trains (a run refuses to start with it: test_reliability)
        (out / REQUESTS_DIR).symlink_to(elsewhere, target_is_directory=True)
        with pytest.raises(DifftuneError, match="is a symbolic link"):
            ask(out, "save")
        assert sorted(path.name for path in elsewhere.iterdir()) == ["keep.txt"]
        (out / REQUESTS_DIR).unlink()
        (out / REQUESTS_DIR).write_text("not a folder")
        with pytest.raises(DifftuneError, match="not a folder"):
            ask(out, "save")
    (out / REQUESTS_DIR).unlink()
    (out / REQUESTS_DIR).mkdir()
    (out / REQUESTS_DIR / "save").symlink_to(elsewhere / "keep.txt")  # answering removes the link, not the file
    asked_as_it_trains(out, "sample")
    train(make_config(train__max_steps=1, sample__prompts=["a red circle"], sample__steps=2, train__overwrite=True))
    assert (elsewhere / "keep.txt").read_text() == "mine" and not (out / REQUESTS_DIR / "save").is_symlink()
