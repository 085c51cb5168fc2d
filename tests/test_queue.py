"""The job queue (webui/queue.py): one job a device at a time, the next started when it ends, moved or cancelled
before it starts, kept in a file that a restarted UI carries on with, never starting a job twice."""

import json
import time

import pytest

from difftune.config import load_config
from difftune.errors import DifftuneError
from difftune.webui import jobs, queue

from conftest import REPO


def _config(steps: int = 2):
    return load_config(
        REPO / "configs" / "tiny_lora.toml",
        [f"train.max_steps={steps}", "sample.prompts=[]", "sample.before=false", "log.progress_bar=false"],
    )


def _wait(job: jobs.Job, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while job.status() in ("queued", "running") and time.monotonic() < deadline:
        time.sleep(0.5)
    return job.status()


def test_a_job_waits_for_its_device_and_starts_when_the_first_ends(tmp_path):
    first = queue.submit(_config(), tmp_path, "first", "cpu")
    second = queue.submit(_config(), tmp_path, "second", "cpu")
    assert first.status() == "running" and second.status() == "queued"
    assert queue.queued(tmp_path) == [("cpu", 1, second.name)]
    queue.advance(tmp_path)  # the device is busy: nothing starts
    assert second.status() == "queued"
    assert _wait(first) == "finished"
    [started] = queue.advance(tmp_path)
    assert started.name == second.name and queue.queued(tmp_path) == []
    assert second.state()["device"] == "cpu"
    assert _wait(second) == "finished"


def test_the_queue_is_a_file_a_restarted_ui_carries_on_with_and_no_job_starts_twice(tmp_path):
    running = queue.submit(_config(steps=10), tmp_path, "running", "cpu")
    waiting = queue.submit(_config(), tmp_path, "waiting", "cpu")
    pid = running.state()["pid"]
    # A UI started afresh reads the same queue from the folder; a job that a UI started before it could take it off
    # the queue (job.json written, the queue not yet) leaves the queue without a second start.
    saved = json.loads((tmp_path / queue.QUEUE_FILE).read_text())
    assert saved == {"cpu": [waiting.name]}
    (tmp_path / queue.QUEUE_FILE).write_text(json.dumps({"cpu": [running.name, waiting.name]}))
    assert queue.advance(tmp_path) == [] and running.state()["pid"] == pid
    assert queue.queued(tmp_path) == [("cpu", 1, waiting.name)]
    assert _wait(running) == "finished"
    [started] = queue.advance(tmp_path)
    assert started.name == waiting.name
    _wait(waiting)


def test_queued_jobs_move_and_are_cancelled_before_they_start(tmp_path):
    running = queue.submit(_config(steps=10), tmp_path, "running", "cpu")
    names = [queue.submit(_config(), tmp_path, name, "cpu").name for name in ("a", "b", "c")]
    queue.move(tmp_path, names[2], 1)  # up one place
    assert [name for _, _, name in queue.queued(tmp_path)] == [names[0], names[2], names[1]]
    queue.move(tmp_path, names[0], -5)  # down, at most to the back
    assert [name for _, _, name in queue.queued(tmp_path)] == [names[2], names[1], names[0]]
    queue.cancel(tmp_path, names[1])
    assert [name for _, _, name in queue.queued(tmp_path)] == [names[2], names[0]]
    assert not (tmp_path / names[1]).exists()  # its folder held its config alone
    with pytest.raises(DifftuneError, match="is not queued"):
        queue.cancel(tmp_path, running.name)
    with pytest.raises(DifftuneError, match="device 'cuda:7'"):
        queue.submit(_config(), tmp_path, "d", "cuda:7")
    _wait(running)
    for name in (names[2], names[0]):
        queue.cancel(tmp_path, name)
    assert queue.queued(tmp_path) == []


def test_a_queue_file_naming_folders_elsewhere_starts_nothing(tmp_path):
    """The queue file is read, never trusted: a name that leads out of the jobs folder, a linked-in folder or a file
    that is no queue at all starts no job and leaves the queue (or an empty one)."""
    jobs_dir = tmp_path / "jobs"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / jobs.JOB_CONFIG).write_text((REPO / "configs" / "tiny_lora.toml").read_text())
    jobs_dir.mkdir()
    (jobs_dir / "linked").symlink_to(outside)
    (jobs_dir / queue.QUEUE_FILE).write_text(json.dumps({"cpu": ["../outside", str(outside), "linked", 7]}))
    assert queue.advance(jobs_dir) == []
    assert queue.queued(jobs_dir) == [] and not (outside / jobs.JOB_STATE).exists()
    (jobs_dir / queue.QUEUE_FILE).write_text("not json")
    assert queue.advance(jobs_dir) == [] and queue.queued(jobs_dir) == []


@pytest.mark.parametrize("garbage", ['{"cpu": ["a"', "garbage", '["a", "b"]', "", '{"cpu": "x"}'])
def test_a_queue_file_that_cannot_be_read_is_kept_aside_and_the_queue_rebuilt(tmp_path, garbage):
    """A cut, garbage, list-shaped or empty queue file reset the queue without a word: the job showed "queued" forever
    and Cancel said it was not queued. It is kept aside, the UI says so (`set_aside`), and the queue is rebuilt from
    the job folders that wait, oldest first."""
    first = jobs.prepare_job(_config(), tmp_path, "first")
    second = jobs.prepare_job(_config(), tmp_path, "second")
    (tmp_path / queue.QUEUE_FILE).write_text(garbage)
    queue.set_aside.clear()
    assert queue.queued(tmp_path) == [("cpu", 1, first.name), ("cpu", 2, second.name)]
    [kept] = tmp_path.glob(f"{queue.QUEUE_FILE}.bad-*")
    assert kept.read_text() == garbage and queue.set_aside == [kept]
    queue.cancel(tmp_path, second.name)  # found in its queue: before, "not queued"
    assert queue.queued(tmp_path) == [("cpu", 1, first.name)] and not second.dir.exists()
    assert json.loads((tmp_path / queue.QUEUE_FILE).read_text()) == {"cpu": [first.name]}


def test_links_planted_in_the_jobs_folder_are_never_written_through(tmp_path):
    """The queue's lock and its file, and a queued job's job.json: a link planted at each leaves its target untouched
    (they were followed: a file elsewhere truncated, overwritten with JSON)."""
    elsewhere = tmp_path / "elsewhere.txt"
    jobs_dir = tmp_path / "jobs"
    job = jobs.prepare_job(_config(), jobs_dir, "waiting")
    (jobs_dir / f"{queue.QUEUE_FILE}.lock").symlink_to(elsewhere)
    elsewhere.write_text("secret")
    with pytest.raises(DifftuneError, match="is a symbolic link"):
        queue.queued(jobs_dir)
    (jobs_dir / f"{queue.QUEUE_FILE}.lock").unlink()
    (jobs_dir / queue.QUEUE_FILE).symlink_to(elsewhere)  # read as no queue, moved aside as a link, never written
    queue.set_aside.clear()
    assert queue.queued(jobs_dir) == [("cpu", 1, job.name)]
    assert elsewhere.read_text() == "secret" and not (jobs_dir / queue.QUEUE_FILE).is_symlink()
    (job.dir / jobs.JOB_STATE).symlink_to(elsewhere)
    jobs.write_file(job.dir / jobs.JOB_STATE, "{}", jobs.JOB_SETTING)  # as `_start` writes it
    assert elsewhere.read_text() == "secret" and (job.dir / jobs.JOB_STATE).read_text() == "{}"
