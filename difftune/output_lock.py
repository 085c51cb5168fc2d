"""One run per output folder: a training run holds `train.output_dir` while it runs, and a second one is refused
with who holds it (two runs in one folder overwrite each other's checkpoints and metrics).

The hold is an advisory `flock` on `<output_dir>/.difftune.lock`, which the kernel releases when the holder exits,
however it exits: a SIGKILLed or crashed run cannot leave the folder locked. The file keeps the holder's pid,
host, start time and command, to name it; left behind after a run, it locks nothing. Under several processes
(DDP, FSDP) the global main process (RANK 0) holds it. Where `fcntl` does not exist (Windows), no hold is taken.

A flock belongs to the open file, which data-loader workers forked during the run share: after a SIGKILL they keep
the folder locked until they notice their parent is gone and exit (seconds). A run that finds the lock held by a
holder that no longer exists on this machine waits for them, up to `ORPHANS_WAIT_S`, instead of refusing.
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
ORPHANS_WAIT_S = 60.0  # a dead holder's loader workers poll their parent every 5 s (torch's MP_STATUS_CHECK_INTERVAL)


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
        if not _locked(handle, fcntl):
            raise DifftuneError(f"train.output_dir {output_dir}: {_holder(handle)}")
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                                 "command": " ".join(sys.argv)}))
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _locked(handle, fcntl) -> bool:
    """Take the lock; False where a live run holds it. Held by a holder that has exited (its forked workers still
    share the open file), wait for them to exit too."""
    deadline, said = time.monotonic() + ORPHANS_WAIT_S, False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            holder = _read_holder(handle)
            if holder is None or _alive(holder) or time.monotonic() > deadline:
                return False
            if not said:
                print(f"difftune: the run that held this folder (pid {holder['pid']}) has ended; waiting for the processes "
                      "it started (data-loader workers) to exit", flush=True)
                said = True
            time.sleep(0.2)


def _read_holder(handle) -> dict | None:
    handle.seek(0)
    try:
        holder = json.loads(handle.read())
        named = isinstance(holder.get("pid"), int) and isinstance(holder.get("started"), (int, float))
        return holder if named and {"host", "command"} <= set(holder) else None
    except (ValueError, AttributeError):
        return None


def _alive(holder: dict) -> bool:
    """Whether the holder may still run: always on another machine (it cannot be asked)."""
    if holder["host"] != socket.gethostname():
        return True
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _holder(handle) -> str:
    holder = _read_holder(handle)
    who = (f"pid {holder['pid']} on {holder['host']}, started "
           f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['started']))}: `{holder['command']}`"
           if holder else "a process that has not said which yet")
    return (f"another run is using this folder ({who}); wait for it to end, stop it, or choose another "
            "train.output_dir")
