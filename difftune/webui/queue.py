"""Jobs waiting for a device: one queue per device, in one file (`<jobs_dir>/queue.json`), so the queue outlives the
UI that keeps it and a restarted UI carries on with it.

A submitted job gets its folder and `job.toml` at once, then waits in its device's queue; `advance` (the UI calls it
on every refresh) starts the first job of each queue whose device runs none of the jobs. A job is started before it
leaves the queue, and a queued job whose folder says it was started (`job.json`) leaves it without being started
again: a UI that stops between the two never starts a job twice. The file is read and written under an exclusive
lock on `queue.json.lock`, so two UIs on one jobs folder take turns. Queued jobs can be moved up or down their queue,
or cancelled (their folder, which holds nothing but the config, removed). A queue file that cannot be read is kept
aside and the queues rebuilt from the job folders.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from difftune.config import Config
from difftune.errors import DifftuneError
from difftune.owned_files import open_for_lock, read_text, remove, write_file
from difftune.webui import jobs

QUEUE_FILE = "queue.json"
JOBS_SETTING = "the jobs folder"  # how messages name it
CPU = "cpu"
FOLDER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # a job folder's (`<time>-<name>`): no path in it


def devices() -> list[str]:
    """The devices jobs queue for: each CUDA device (`cuda:0`...), or the CPU where there is none."""
    import torch

    return [f"cuda:{index}" for index in range(torch.cuda.device_count())] or [CPU]


def submit(config: Config, jobs_dir: Path, name: str, device: str) -> jobs.Job:
    """A new job folder for `config`, queued on `device` behind the jobs already there; started at once where the
    device is free (`advance`)."""
    if device not in devices():
        raise DifftuneError(f"device {device!r}: this machine has {', '.join(devices())}")
    job = jobs.prepare_job(config, jobs_dir, name)
    with _queues(jobs_dir) as queues:
        queues.setdefault(device, []).append(job.name)
    advance(jobs_dir)
    return job


def advance(jobs_dir: Path) -> list[jobs.Job]:
    """Start the first queued job of every device that runs none; the jobs started."""
    started = []
    with _queues(jobs_dir) as queues:
        for device, names in queues.items():
            names[:] = [name for name in names if _waiting(jobs_dir, name)]  # started already, or gone
            if names and not _busy(jobs_dir, device):
                started.append(jobs.start_job(jobs.Job(Path(jobs_dir).resolve() / names[0]), device))
                names.pop(0)
    return started


def queued(jobs_dir: Path) -> list[tuple[str, int, str]]:
    """Every queued job as (device, position from 1, job name), in queue order."""
    with _queues(jobs_dir) as queues:
        return [(device, position, name) for device, names in queues.items() for position, name in enumerate(names, 1)]


def move(jobs_dir: Path, name: str, offset: int) -> None:
    """Move a queued job `offset` places towards the front (negative: the back) of its queue."""
    with _queues(jobs_dir) as queues:
        names = _queue_of(queues, name)
        index = names.index(name)
        names.insert(max(0, min(len(names) - 1, index - offset)), names.pop(index))


def cancel(jobs_dir: Path, name: str) -> None:
    """Take a job out of its queue before it starts, and remove its folder (its config alone)."""
    with _queues(jobs_dir) as queues:
        _queue_of(queues, name).remove(name)
        if _waiting(jobs_dir, name):
            remove(Path(jobs_dir) / name, JOBS_SETTING, ours=False)


def _queue_of(queues: dict[str, list[str]], name: str) -> list[str]:
    found = next((names for names in queues.values() if name in names), None)
    if found is None:
        raise DifftuneError(f"job {name} is not queued (it has started, or was cancelled)")
    return found


def _waiting(jobs_dir: Path, name: str) -> bool:
    """A queued job: a folder of the jobs folder itself (a plain name, not a link: the queue file is read, never
    trusted), with its config, and no process started for it yet."""
    folder = Path(jobs_dir) / name
    return (
        FOLDER_NAME.fullmatch(name) is not None
        and not folder.is_symlink()
        and (folder / jobs.JOB_CONFIG).is_file()
        and not (folder / jobs.JOB_STATE).exists()
    )


def _busy(jobs_dir: Path, device: str) -> bool:
    return any(job.is_running() and job.state().get("device", CPU) == device for job in jobs.find_jobs(jobs_dir))


@contextmanager
def _queues(jobs_dir: Path) -> Iterator[dict[str, list[str]]]:
    """The queues (device -> job folder names), read under the lock and written back (atomically) after the block.
    A queue file that cannot be read as queues (cut, garbage, another shape) is kept aside as `queue.json.bad-<time>`,
    said in the UI (`set_aside`), and the queues rebuilt from the job folders that wait (`_rebuilt`): no job waits
    unseen. The lock file, the queue file and its staging file are never followed where they are links."""
    path = Path(jobs_dir) / QUEUE_FILE
    lock = open_for_lock(path.with_name(QUEUE_FILE + ".lock"), JOBS_SETTING, ours=False)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        queues = _read(path, jobs_dir)
        yield queues
        write_file(
            path,
            json.dumps({device: names for device, names in queues.items() if names}, indent=2),
            JOBS_SETTING,
            ours=False,
        )
    finally:
        os.close(lock)


def _read(path: Path, jobs_dir: Path) -> dict[str, list[str]]:
    try:
        read = json.loads(read_text(path))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):  # cut, not JSON, or a link planted in its place
        read = None
    if isinstance(read, dict) and all(
        isinstance(names, list) and all(isinstance(name, str) for name in names) for names in read.values()
    ):
        return {str(device): list(names) for device, names in read.items()}
    kept = path.with_name(f"{QUEUE_FILE}.bad-{time.strftime('%Y%m%d-%H%M%S')}")
    os.replace(path, kept)  # the name moves, a link included: nothing it points to is touched
    set_aside.append(kept)
    return _rebuilt(jobs_dir)


def _rebuilt(jobs_dir: Path) -> dict[str, list[str]]:
    """The queues as the job folders say: every job that waits (`_waiting`), oldest first (folders are named by
    their submission time), on the first device (a job's device is chosen as it is submitted, not kept in its
    folder)."""
    waiting = sorted(folder.name for folder in Path(jobs_dir).iterdir() if _waiting(jobs_dir, folder.name))
    return {devices()[0]: waiting} if waiting else {}


# Queue files kept aside since the UI started (the UI says so once each).
set_aside: list[Path] = []
