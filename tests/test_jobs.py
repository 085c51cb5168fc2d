"""Jobs as the UI runs them: child processes in their own folders, found again, stopped with a checkpoint,
resumed; and the form that turns the config schema into widgets and back."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from difftune.config import Config, load_config
from difftune.errors import DifftuneError
from difftune.training.checkpoint import complete_checkpoints
from difftune.webui import jobs
from difftune.webui.form import config_from_widgets, form_fields, parse_adapter_lines, widget_values

REPO = Path(__file__).resolve().parents[1]


def _wait_for(condition, seconds: float, job: jobs.Job) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; log:\n{jobs.log_tail(job)}")
        time.sleep(0.2)


@pytest.mark.slow
def test_a_job_is_found_again_stopped_with_a_checkpoint_and_resumed(make_config, tmp_path):
    jobs_dir = tmp_path / "jobs"
    job = jobs.launch_job(make_config(train__max_steps=300), jobs_dir, "long")
    assert job.config().train.output_dir == str(job.dir)
    _wait_for(lambda: len(jobs.read_progress(job)) >= 5, 120, job)

    # A restarted UI knows nothing but the folder: the job is found and seen running.
    child = jobs._children.pop(job.state()["pid"])
    [found] = jobs.find_jobs(jobs_dir)
    assert found == job and found.status() == "running"
    with pytest.raises(DifftuneError, match="is running"):
        jobs.resume_job(found)

    jobs.stop_job(found)
    assert child.wait(timeout=600) == 0
    steps = [row["step"] for row in jobs.read_progress(found)]
    assert found.status() == "stopped" and found.resumable()
    assert 5 <= steps[-1] < 300 and steps == list(range(1, steps[-1] + 1))
    assert [path.name for path in complete_checkpoints(found.dir)] == [f"step-{steps[-1]:06d}"]
    with pytest.raises(DifftuneError, match="not running"):
        jobs.stop_job(found)

    jobs.resume_job(found)
    _wait_for(lambda: not found.is_running(), 300, found)
    assert found.status() == "finished", jobs.log_tail(found)
    assert [row["step"] for row in jobs.read_progress(found)] == list(range(1, 301))
    assert "--resume auto" in " ".join(found.state()["command"])


def test_a_job_that_cannot_start_is_failed_with_its_error_in_the_log(make_config, tmp_path):
    job = jobs.launch_job(make_config(data__path=str(tmp_path / "no-such-folder")), tmp_path / "jobs", "broken")
    _wait_for(lambda: not job.is_running(), 120, job)
    assert job.status() == "failed" and not job.resumable()
    assert "no-such-folder" in jobs.log_tail(job)
    assert (
        jobs.failure_reason(job)
        == f"data.path {tmp_path / 'no-such-folder'}: does not exist; point it at a folder of captioned images"
    )


def test_a_crash_is_explained_by_the_exception_it_ended_with(tmp_path):
    job = jobs.Job(tmp_path)
    (tmp_path / jobs.JOB_LOG).write_text(
        "difftune: 16 images, 1 trained parameters (lora), 1 process(es) on cpu\n"
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
        "train:  40%|####      | 4/10 [00:01<00:01]\n"
    )
    assert jobs.failure_reason(job) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"


def test_job_names_are_plain(make_config, tmp_path):
    for name in ("../up", "a/b", "", "-flag", "x" * 65):
        with pytest.raises(DifftuneError, match="job name"):
            jobs.launch_job(make_config(), tmp_path, name)
    assert not list(tmp_path.iterdir())


def test_log_tail_shows_the_last_state_of_progress_bars(tmp_path):
    job = jobs.Job(tmp_path)
    (tmp_path / jobs.JOB_LOG).write_text("start\ntrain: 1/3\rtrain: 2/3\rtrain: 3/3\ndone\n")
    assert jobs.log_tail(job).splitlines() == ["start", "train: 3/3", "done"]
    # A long run: its bar redrawn 100,000 times on one line (4 MB) after the lines that say what it is doing.
    redraws = "".join(f"\rtrain: {step}/100000 [loss 0.1234]" for step in range(1, 100_001))
    (tmp_path / jobs.JOB_LOG).write_text("".join(f"line {i}\n" for i in range(1000)) + redraws)
    assert jobs.log_tail(job, max_chars=200).splitlines()[-3:] == [
        "line 998",
        "line 999",
        "train: 100000/100000 [loss 0.1234]",
    ]


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda path: path.name)
def test_every_shipped_config_survives_the_form(path):
    fields = form_fields()
    config = load_config(path)
    assert config_from_widgets(fields, widget_values(config, fields)) == config


def test_the_form_has_every_schema_field_and_reports_in_schema_words():
    fields = form_fields()
    assert {field.key for field in fields} == {
        f"{section}.{name}" for section, model in Config.model_fields.items() for name in model.annotation.model_fields
    }
    values = widget_values(Config(), fields)
    keys = [field.key for field in fields]

    def with_values(**changes):
        edited = list(values)
        for key, value in changes.items():
            edited[keys.index(key.replace("__", "."))] = value
        return config_from_widgets(fields, edited)

    config = with_values(
        train__max_steps=250.0, validation__timesteps="100\n 700\n", adapter__alpha="", optim__betas="0.9, 0.99"
    )
    assert config.train.max_steps == 250 and config.validation.timesteps == [100, 700]
    assert config.adapter.alpha == config.adapter.rank and config.optim.betas == (0.9, 0.99)
    assert with_values(adapter__alpha="4").adapter.alpha == 4.0
    with pytest.raises(DifftuneError, match=r"train\.max_steps: Input should be greater than or equal to 1"):
        with_values(train__max_steps=0)
    with pytest.raises(DifftuneError, match=r"validation\.timesteps\.1: Input should be a valid integer"):
        with_values(validation__timesteps="100\nlate")
    with pytest.raises(DifftuneError, match=r"train\.max_steps: Input should be a valid integer"):
        with_values(train__max_steps=2.5)


def test_adapter_lines():
    assert parse_adapter_lines("a.safetensors\n\n b.safetensors:0.5 \nC:/x/c.safetensors") == [
        (Path("a.safetensors"), 1.0),
        (Path("b.safetensors"), 0.5),
        (Path("C:/x/c.safetensors"), 1.0),
    ]


def test_the_sample_tab_offers_only_fields_that_apply_outside_training():
    from difftune.config import TRAINING_ONLY_SAMPLE_FIELDS, SampleConfig
    from difftune.webui.app import build_app

    app = build_app(Path("jobs-that-do-not-exist"), REPO / "configs")
    ids = {block.elem_id for block in app.blocks.values() if getattr(block, "elem_id", None)}
    offered = {name for name in SampleConfig.model_fields if f"sample-sample-{name}" in ids}
    assert offered == set(SampleConfig.model_fields) - set(TRAINING_ONLY_SAMPLE_FIELDS)


# The UI's trust in its jobs folder, and what it says.


def test_a_preset_edited_in_the_form_makes_the_job_the_cli_makes(tmp_path):
    """Loaded from `tiny_lora.toml` and edited (rank, learning rate, resolution), the form's job is the CLI's job
    with the same edits: alpha, the text encoders' rate and the sample size follow the edits (they stayed at the
    preset's resolved 16, 1e-3 and 32 before, training the adapter at 4x the scale). Saved and reloaded: the same."""
    from difftune.webui.form import file_widget_values, form_toml

    preset = REPO / "configs" / "tiny_lora.toml"
    fields = form_fields()
    values = file_widget_values(preset, fields)
    edits = {"adapter.rank": 4, "optim.learning_rate": 2e-4, "data.resolution": 64}
    for i, field in enumerate(fields):
        if field.key in edits:
            values[i] = edits[field.key]
    ui = config_from_widgets(fields, values)
    cli = load_config(preset, [f"{key}={value}" for key, value in edits.items()])
    assert (ui.adapter.alpha, ui.optim.text_encoder_learning_rate, ui.sample.resolution) == (4.0, 2e-4, 64)
    assert ui == cli
    saved = tmp_path / "saved.toml"
    saved.write_text(form_toml(fields, values))
    assert load_config(saved) == cli
    assert file_widget_values(saved, fields)[[field.key for field in fields].index("adapter.alpha")] == ""


def _fake_job(folder: Path, pid: int, started: float, command: list[str]) -> jobs.Job:
    folder.mkdir(parents=True)
    (folder / jobs.JOB_CONFIG).write_text(Config().to_toml())
    (folder / jobs.JOB_STATE).write_text(
        json.dumps({"pid": pid, "started": started, "command": command, "cwd": str(folder)})
    )
    return jobs.Job(folder)


def test_the_ui_shows_and_signals_only_what_is_the_jobs_own(tmp_path):
    """A jobs folder written by someone else: a train.log or grid.png that links out of the job folder is not shown,
    and a job.json naming another process (its pid, its start time, even our command) gets it no signal."""
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the log box")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        started = psutil.Process(other.pid).create_time()
        job = _fake_job(
            tmp_path / "jobs" / "20260101-000000-fake",
            other.pid,
            started,
            [sys.executable, "-m", "difftune.cli", "train", "--config", str(tmp_path / "jobs" / "x" / "job.toml")],
        )
        (job.dir / jobs.JOB_LOG).symlink_to(secret)
        (job.dir / "metrics.jsonl").symlink_to(secret)
        (job.dir / "samples").mkdir()
        (job.dir / "samples" / "grid.png").symlink_to(secret)
        assert jobs.log_tail(job) == "" and jobs.read_progress(job) == [] and jobs.preview_grids(job) == []
        assert not job.is_running()
        with pytest.raises(DifftuneError, match="is not running"):
            jobs.stop_job(job)
        assert other.poll() is None  # never signalled
        (job.dir / jobs.JOB_LOG).unlink()
        (job.dir / jobs.JOB_LOG).write_text("difftune: the job's own log\n")
        assert "the job's own log" in jobs.log_tail(job)
    finally:
        other.kill()
        other.wait()


def test_a_job_started_here_is_running_before_its_command_line_is_its_own(make_config, tmp_path, monkeypatch):
    """Between fork and exec (long on a loaded machine) the kernel shows the parent's command line for the child: a
    job launched here is known running all the same (it looked failed as it started: `test_resume_says_why_it_cannot`
    failed so under two pytest workers)."""
    job = jobs.launch_job(make_config(train__max_steps=2), tmp_path / "jobs", "short")
    monkeypatch.setattr(psutil.Process, "cmdline", lambda self: [sys.executable, "-c", "the parent's"])
    assert job.is_running() and job.status() == "running"
    monkeypatch.undo()
    _wait_for(lambda: not job.is_running(), 120, job)
    assert job.status() == "finished"


def test_resume_says_why_it_cannot(make_config, tmp_path):
    jobs_dir = tmp_path / "jobs"
    job = jobs.launch_job(make_config(train__max_steps=2), jobs_dir, "short")
    _wait_for(lambda: not job.is_running(), 120, job)
    assert job.status() == "finished"
    with pytest.raises(DifftuneError, match=r"has finished: its result is written\. To train it further"):
        jobs.resume_job(job)
    (job.dir / "pytorch_lora_weights.safetensors").unlink()
    for checkpoint in complete_checkpoints(job.dir):
        shutil.rmtree(checkpoint)
    with pytest.raises(DifftuneError, match=r"is failed and wrote no checkpoint to resume from; launch it again"):
        jobs.resume_job(job)


def _interrupted_job(make_config, jobs_dir: Path) -> jobs.Job:
    """A job that stopped with a checkpoint at step 2 of 4 (as a killed one leaves its folder), never running now."""
    from difftune.training.train import train

    folder = jobs_dir / "20260101-000000-interrupted"
    config = make_config(train__max_steps=2, checkpoint__every_steps=2, train__output_dir=str(folder))
    train(config)
    for result in folder.glob("*.safetensors"):
        result.unlink()
    config.train.max_steps = 4
    (folder / jobs.JOB_CONFIG).write_text(config.to_toml())
    (folder / jobs.JOB_STATE).write_text(json.dumps({"pid": 0, "started": 0, "command": [], "cwd": str(REPO)}))
    (folder / jobs.JOB_LOG).write_text("difftune: the job's own log\n")
    job = jobs.Job(folder)
    assert job.status() == "failed" and job.resumable()
    return job


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_resume_never_writes_through_a_linked_log(make_config, tmp_path, link):
    """Resume appended the trainer's output to a train.log that was a symbolic link (the text landed in the file it
    pointed to); a hard-linked one (a file outside the jobs folder) is refused too, and neither is shown."""
    job = _interrupted_job(make_config, tmp_path / "jobs")
    outside = tmp_path / "outside.txt"
    outside.write_text("someone else's file\n")
    (job.dir / jobs.JOB_LOG).unlink()
    if link == "symbolic":
        (job.dir / jobs.JOB_LOG).symlink_to(outside)
    else:
        (job.dir / jobs.JOB_LOG).hardlink_to(outside)
    assert jobs.log_tail(job) == ""
    with pytest.raises(DifftuneError, match=rf"its train\.log is a {link}"):
        jobs.resume_job(job)
    assert outside.read_text() == "someone else's file\n" and not job.is_running()


@pytest.mark.slow
def test_a_job_whose_working_folder_is_gone_resumes_in_its_own(make_config, tmp_path):
    """The recorded working folder deleted since: Resume failed with an unhandled FileNotFoundError. The job's config
    holds absolute paths, so it resumes in the job's folder and finishes."""
    job = _interrupted_job(make_config, tmp_path / "jobs")
    state = job.state() | {"cwd": str(tmp_path / "deleted-checkout")}
    (job.dir / jobs.JOB_STATE).write_text(json.dumps(state))
    jobs.resume_job(job)
    _wait_for(lambda: not job.is_running(), 300, job)
    assert job.status() == "finished", jobs.log_tail(job)
    assert job.state()["cwd"] == str(job.dir)


def test_a_job_folder_linked_in_from_elsewhere_is_not_listed(make_config, tmp_path):
    elsewhere = _fake_job(tmp_path / "elsewhere" / "20260101-000000-theirs", 0, 0, [])
    jobs_dir = tmp_path / "jobs"
    mine = _fake_job(jobs_dir / "20260101-000001-mine", 0, 0, [])
    (jobs_dir / "20260101-000002-link").symlink_to(elsewhere.dir)
    assert jobs.find_jobs(jobs_dir) == [jobs.Job(mine.dir.resolve())]
