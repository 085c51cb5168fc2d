"""One run per output folder: a training run holds `train.output_dir` while it runs, and a second one is refused
with who holds it (two runs in one folder overwrite each other's checkpoints and metrics).

The hold is an advisory `flock` on `<output_dir>/.difftune.lock`, which the kernel releases when the holder exits,
however it exits: a SIGKILLed or crashed run cannot leave the folder locked. The file keeps the holder's pid,
host, start time and command, to name it; left behind after a run, it locks nothing. Under several processes
(DDP, FSDP) the global main process (RANK 0) holds it. Where `fcntl` does not exist (Windows), no hold is taken.

A flock belongs to the open file, and a forked process shares it: data-loader workers forked during the run would
keep the folder locked after a SIGKILL until they noticed their parent was gone (seconds), and a resume started at
once was refused. So every process forked while the folder is held drops its copy of the lock file at once
(`_release_in_forked_child`): the holder alone holds it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from difftune.errors import DifftuneError

LOCK_FILE = ".difftune.lock"
_held_descriptors: set[int] = set()  # the lock files' descriptors this process holds the folder through


@contextmanager
def hold_output_dir(output_dir: Path) -> Iterator[None]:
    """Hold `output_dir` (created if missing) for the duration of the block, or refuse, naming the holder."""
    output_dir = Path(output_dir)
    try:
        import fcntl
    except ImportError:
        yield
        return
    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / LOCK_FILE, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DifftuneError(f"train.output_dir {output_dir}: {_holder(handle)}") from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                                 "command": " ".join(sys.argv)}))
        handle.flush()
        _held_descriptors.add(handle.fileno())
        try:
            yield
        finally:
            _held_descriptors.discard(handle.fileno())
            fcntl.flock(handle, fcntl.LOCK_UN)


def _release_in_forked_child() -> None:
    """In a forked child, point each held lock file's descriptor at /dev/null: the child no longer shares the open
    file (closing the descriptor instead would let the child's file object close whatever took its number later)."""
    if not _held_descriptors:
        return
    null = os.open(os.devnull, os.O_RDWR)
    for descriptor in _held_descriptors:
        os.dup2(null, descriptor)
    os.close(null)
    _held_descriptors.clear()


if hasattr(os, "register_at_fork"):  # POSIX, where fcntl's flock is
    os.register_at_fork(after_in_child=_release_in_forked_child)


def _holder(handle) -> str:
    handle.seek(0)
    try:
        holder = json.loads(handle.read())
        who = (f"pid {holder['pid']} on {holder['host']}, started "
               f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['started']))}: `{holder['command']}`")
    except (ValueError, KeyError, TypeError):
        who = "a process that has not said which yet"
    return (f"another run is using this folder ({who}); wait for it to end, stop it, or choose another "
            "train.output_dir")
