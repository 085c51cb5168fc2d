"""Training jobs as child processes, one folder each: what the UI launches, watches, stops and finds again.

A job folder is the run's `train.output_dir`. Besides what the trainer writes, it holds `job.toml` (the
config launched), `job.json` (the process: pid, start time, command, working folder) and `train.log`
(the process's stdout and stderr). The UI keeps nothing the folder does not say, so a job goes on when
the browser tab or the UI closes, and a restarted UI finds it again, running or not.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from difftune.adapters.export import result_files
from difftune.config import Config, absolute_paths, load_config
from difftune.errors import ERROR_PREFIX, DifftuneError
from difftune.owned_files import write_file
from difftune.training.checkpoint import complete_checkpoints
from difftune.training.metrics import METRICS_FILE
from difftune.training.run_requests import RunRequests, ask
from difftune.training.train import RESOLVED_CONFIG_FILE

JOB_CONFIG = "job.toml"
JOB_STATE = "job.json"
JOB_SETTING = "the job's folder"  # how messages name it
JOB_LOG = "train.log"
FINDERS_DIR = "finders"  # under the jobs folder: the finders' configs, logs and plots
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

# Children started by this process, so their exit is collected (no zombies) and their exit code known.
_children: dict[int, subprocess.Popen] = {}


@dataclass(frozen=True)
class Job:
    dir: Path

    @property
    def name(self) -> str:
        return self.dir.name

    def config(self) -> Config:
        return load_config(self.dir / JOB_CONFIG)

    def state(self) -> dict:
        return json.loads((self.dir / JOB_STATE).read_text(encoding="utf-8"))

    def process(self) -> psutil.Process | None:
        """The job's trainer while it runs, else None. `job.json` names a pid, which is trusted only when that
        process is this job's own `difftune train` (its command line, on this folder's job.toml) and started when
        the job did: a reused pid, or a job.json written to point elsewhere, never gets a signal."""
        if not (self.dir / JOB_STATE).is_file():  # queued: no process started yet
            return None
        state = self.state()
        child = _children.get(state["pid"])
        # A child started here is known by the command it was started with, not by reading its command line: until it
        # execs, a loaded machine shows the parent's there, and the job looked failed as it started. Unreaped, its pid
        # cannot be another process's.
        if child is not None:
            ours = list(child.args)[1:] == _command(self, resume="--resume" in child.args)[1:]
            return psutil.Process(child.pid) if ours and child.poll() is None else None
        try:
            process = psutil.Process(state["pid"])
            if process.status() == psutil.STATUS_ZOMBIE or abs(process.create_time() - state["started"]) >= 1:
                return None
            command = process.cmdline()
            return process if command[1:] == _command(self, resume="--resume" in command)[1:] else None
        except psutil.Error:
            return None

    def is_running(self) -> bool:
        return self.process() is not None

    def status(self) -> str:
        """`queued` (waiting for its device: queue.py), `running`, `finished` (the trained result exists), `stopped`
        (on request, resumable) or `failed`."""
        if not (self.dir / JOB_STATE).exists():
            return "queued"
        if self.is_running():
            return "running"
        resolved = self.dir / RESOLVED_CONFIG_FILE  # written as the run starts, its family named
        if resolved.exists() and all(path.exists() for path in result_files(load_config(resolved), self.dir)):
            return "finished"
        said = [line for line in log_tail(self).splitlines() if line.startswith("difftune:")]
        return "stopped" if said and said[-1].startswith(RunRequests.MESSAGE) else "failed"

    def resumable(self) -> bool:
        return self.status() in ("stopped", "failed") and bool(complete_checkpoints(self.dir))


def launch_job(config: Config, jobs_dir: Path, name: str) -> Job:
    """A new folder `<jobs_dir>/<time>-<name>` and a `difftune train` process writing into it."""
    return start_job(prepare_job(config, jobs_dir, name))


def prepare_job(config: Config, jobs_dir: Path, name: str) -> Job:
    """A new folder `<jobs_dir>/<time>-<name>` holding the job's config, its process not started (queue.py)."""
    job_dir = _new_folder(jobs_dir, name)
    config = absolute_paths(config, Path.cwd())  # job.toml lives in the job folder: its paths must not move with it
    config.train.output_dir = str(job_dir)
    write_file(job_dir / JOB_CONFIG, config.to_toml(), JOB_SETTING)
    return Job(job_dir)


def start_job(job: Job, device: str | None = None) -> Job:
    """The prepared job's `difftune train` process, on `device` (`cuda:N`: that GPU alone is visible to it)."""
    return _start(job, resume=False, cwd=Path.cwd(), device=device)


def run_finder(config: Config, jobs_dir: Path, name: str, finder: str, options: list[str]) -> tuple[dict, Path]:
    """`difftune find-batch` or `find-lr` (`finder`) on a config, as the CLI runs it, in a child process that
    works in `<jobs_dir>/finders/<time>-<name>/` (the range test's plot is written there). Waits for it; returns
    its JSON result and that folder."""
    if finder not in ("find-batch", "find-lr"):
        raise DifftuneError(f"unknown finder {finder!r}")
    folder = _new_folder(Path(jobs_dir) / FINDERS_DIR, f"{name}-{finder}")
    write_file(folder / JOB_CONFIG, absolute_paths(config, Path.cwd()).to_toml(), JOB_SETTING)
    command = [sys.executable, "-m", "difftune.cli", finder, "--config", str(folder / JOB_CONFIG), *options]
    if finder == "find-lr":
        command += ["--out", str(folder)]
    done = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    write_file(folder / JOB_LOG, done.stderr, JOB_SETTING)
    if done.returncode:
        said = [line for line in done.stderr.splitlines() if line.startswith(ERROR_PREFIX)]
        raise DifftuneError(said[-1][len(ERROR_PREFIX) :] if said else f"{finder} failed: see {folder / JOB_LOG}")
    return json.loads(done.stdout.strip().splitlines()[-1]), folder


def _new_folder(parent: Path, name: str) -> Path:
    """`<parent>/<time>-<name>`, created; the name checked first, since it becomes part of a path."""
    if not _NAME.fullmatch(name):
        raise DifftuneError(
            f"job name {name!r}: use 1-64 letters, digits, '-', '_' or '.', starting with a letter or digit"
        )
    folder = Path(parent).resolve() / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"
    if folder.exists():
        raise DifftuneError(f"job folder {folder} already exists; wait a second or choose another name")
    folder.mkdir(parents=True)
    return folder


def resume_job(job: Job) -> Job:
    """Continue a stopped or failed job from its latest complete checkpoint, in the same folder."""
    status = job.status()
    if status == "running":
        raise DifftuneError(f"job {job.name} is running; stop it first to resume it later")
    if status == "finished":
        raise DifftuneError(
            f"job {job.name} has finished: its result is written. To train it further, load its job.toml in Configure "
            "with more train.max_steps and launch it as a new job"
        )
    if not job.resumable():
        raise DifftuneError(f"job {job.name} is {status} and wrote no checkpoint to resume from; launch it again")
    # Its job.toml holds absolute paths: a working folder gone since (a deleted checkout) changes nothing it reads.
    recorded = Path(job.state()["cwd"])
    return _start(job, resume=True, cwd=recorded if recorded.is_dir() else job.dir, device=job.state().get("device"))


def stop_job(job: Job) -> None:
    """Ask the job to stop: SIGTERM to the trainer, which finishes its step and writes a checkpoint. Not to the
    process group: data-loader workers killed under the trainer would make it fail instead."""
    process = job.process()
    if process is None:
        raise DifftuneError(f"job {job.name} is not running")
    process.send_signal(signal.SIGTERM)


def ask_job(job: Job, what: str) -> None:
    """Ask a running job to draw its sample prompts ("sample") or save a checkpoint and a snapshot ("save") at its
    next step boundary (`training.requests`), going on after."""
    if job.process() is None:
        raise DifftuneError(f"job {job.name} is not running")
    ask(job.dir, what)


def find_jobs(jobs_dir: Path) -> list[Job]:
    """The job folders under `jobs_dir`, newest first."""
    if not Path(jobs_dir).is_dir():
        return []
    root = Path(jobs_dir).resolve()
    # A folder linked in from elsewhere is not a job of this folder: listing it would show and serve what it holds.
    folders = [path.parent for path in root.glob(f"*/{JOB_STATE}") if not path.parent.is_symlink()]
    return [Job(folder) for folder in sorted(folders, key=lambda path: path.name, reverse=True)]


def own_file(job: Job, path: Path) -> bool:
    """A regular file of the job's own folder: what the UI shows or serves from it. A symlink (a train.log linked to
    /etc/passwd, a grid.png to anywhere) is not one, nor anything that resolves outside the folder, nor a file with
    another name elsewhere (a hard link: a file outside the jobs folder linked in)."""
    path = Path(path)
    return (
        path.is_file()
        and not path.is_symlink()
        and path.stat().st_nlink == 1
        and path.resolve().is_relative_to(job.dir.resolve())
    )


def log_tail(job: Job, max_chars: int = 6000, max_read: int = 16 << 20) -> str:
    """The end of the job's log, at most `max_chars` of it, with progress-bar redraws (carriage returns) collapsed to
    their last state. A long run's progress bar redraws itself thousands of times on one line, so the log is read back
    from its end until what is left after collapsing fills `max_chars` (or `max_read` bytes were read)."""
    path = job.dir / JOB_LOG
    if not own_file(job, path):
        return ""
    size, window = path.stat().st_size, 1 << 16
    with open(path, "rb") as log:
        while True:
            start = max(0, size - window)
            log.seek(start)
            lines = log.read(size - start).decode("utf-8", errors="replace").split("\n")
            if start:
                lines = lines[1:]  # the first line is cut where the window begins
            text = "\n".join(line.rstrip("\r").split("\r")[-1] for line in lines)
            if not start or len(text) >= max_chars or window >= max_read:
                return text[-max_chars:]
            window *= 4


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*")


def failure_reason(job: Job) -> str:
    """Why a failed job stopped, from its log: difftune's own error line, else the exception a traceback ends
    with, else the log's last line."""
    lines = [line.strip() for line in reversed(log_tail(job, max_chars=20000).splitlines()) if line.strip()]
    said = next((line.removeprefix(ERROR_PREFIX) for line in lines if line.startswith(ERROR_PREFIX)), None)
    raised = next((line for line in lines if _EXCEPTION_LINE.match(line)), None)
    return said or raised or (lines[0] if lines else "no log was written")


def read_progress(job: Job) -> list[dict]:
    """The metrics lines written so far (one per optimizer step)."""
    path = job.dir / METRICS_FILE
    if not own_file(job, path):
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    # The last line may be half-written while the trainer runs.
    return [json.loads(line) for line in lines if line.strip().endswith("}")]


def validation_frame(rows: list[dict], best: dict[str, dict]):
    """The validation losses logged so far as (step, val_loss, series) rows, and the kept best (`best`: the run's
    `validation.read_best` records) as series "best": what the UI's validation plot shows. None before the first
    validation."""
    import pandas as pd

    points = [(row["step"], row["val_loss"], "validation") for row in rows if "val_loss" in row]
    if not points:
        return None
    record = best.get("val_loss")
    if record:
        points.append((record["step"], record["value"], "best"))
    return pd.DataFrame(points, columns=["step", "val_loss", "series"])


# A video base's samples (families/common/drawing.py), beside its grid; a sound base's.
SAMPLE_CLIPS = ("[0-9][0-9][0-9].mp4", "[0-9][0-9][0-9].webp")
SAMPLE_SOUNDS = ("[0-9][0-9][0-9].flac",)


def preview_grids(job: Job) -> list[Path]:
    """Sample grids of the job and a video base's sample clips, newest first: previews during training, before/after,
    EMA."""
    found = [path for pattern in ("grid.png", *SAMPLE_CLIPS) for path in job.dir.glob(f"samples*/**/{pattern}")]
    return sorted((path for path in found if own_file(job, path)), key=lambda path: path.stat().st_mtime, reverse=True)


def _command(job: Job, resume: bool) -> list[str]:
    """The trainer's command line: an argument list, never a shell string."""
    return [sys.executable, "-m", "difftune.cli", "train", "--config", str(job.dir / JOB_CONFIG)] + (
        ["--resume", "auto"] if resume else []
    )


def _own_log(job: Job):
    """The job's log opened to append, refusing a symbolic link (a resumed job's output landed in the file it pointed
    to) or a hard-linked file: the log is written in the job's folder only."""
    path = job.dir / JOB_LOG
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        if err.errno != errno.ELOOP:  # O_NOFOLLOW's refusal; anything else is what it says
            raise
        raise DifftuneError(
            f"job {job.name}: its {JOB_LOG} is a symbolic link, not the job's own log; remove it to resume"
        ) from None
    if os.fstat(descriptor).st_nlink != 1:
        os.close(descriptor)
        raise DifftuneError(
            f"job {job.name}: its {JOB_LOG} is a hard link to another file, not the job's own log; remove it to resume"
        )
    return os.fdopen(descriptor, "ab")


def _start(job: Job, resume: bool, cwd: Path, device: str | None = None) -> Job:
    # The child gets its own session so closing the UI leaves it running.
    command = _command(job, resume)
    gpu = {"CUDA_VISIBLE_DEVICES": device.removeprefix("cuda:")} if device and device.startswith("cuda:") else {}
    with _own_log(job) as log:
        child = subprocess.Popen(
            command,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **gpu},
        )
    _children[child.pid] = child
    state = {"pid": child.pid, "started": psutil.Process(child.pid).create_time(), "command": command, "cwd": str(cwd)}
    state |= {"device": device} if device else {}
    write_file(job.dir / JOB_STATE, json.dumps(state, indent=2), JOB_SETTING)  # a link planted there is replaced
    return job
