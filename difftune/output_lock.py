"""One run per output folder: a training run holds `train.output_dir` while it runs, and a second one is refused
with who holds it (two runs in one folder overwrite each other's checkpoints and metrics).

The hold is an advisory `flock` on `<output_dir>/.difftune.lock`, which the kernel releases when the holder exits,
however it exits: a SIGKILLed or crashed run cannot leave the folder locked. The file keeps the holder's pid,
host, start time and command, to name it; left behind after a run, it locks nothing. Under several processes
(DDP, FSDP) the global main process (RANK 0) holds it. Where `fcntl` does not exist (Windows), no hold is taken.
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
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


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
