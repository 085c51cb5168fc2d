"""One run per output folder: a training run holds `train.output_dir` while it runs, and a second one is refused
with who holds it (two runs in one folder overwrite each other's checkpoints and metrics).

The hold is an advisory `flock` on the folder itself, which the kernel releases when the holder exits, however it
exits: a SIGKILLed or crashed run cannot leave the folder locked. It locks the folder's own inode, not a file in it:
a lock file deleted or replaced while a run trained let a second run lock the new file and train beside the first.
`<output_dir>/.difftune.lock` keeps the holder's pid, host, start time and command, to name it; it locks nothing.
Under several processes (DDP, FSDP) the global main process (RANK 0) holds it. Where `fcntl` does not exist
(Windows), no hold is taken.

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
from difftune.owned_files import write_file
from difftune.training.metrics import RUN_FOLDER

LOCK_FILE = ".difftune.lock"
_held_descriptors: set[int] = set()  # the folders' descriptors this process holds them through


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
    folder = os.open(output_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DifftuneError(f"train.output_dir {output_dir}: {_holder(output_dir / LOCK_FILE)}") from None
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "command": " ".join(sys.argv),
        }
        write_file(output_dir / LOCK_FILE, json.dumps(holder), RUN_FOLDER, ours=False)  # a link there replaced
        refuse_linked_folders(output_dir)
        _held_descriptors.add(folder)
        try:
            yield
        finally:
            _held_descriptors.discard(folder)
            fcntl.flock(folder, fcntl.LOCK_UN)
    finally:
        os.close(folder)


# The folders a run makes in its output folder and writes, prunes or removes in (checkpoints, snapshots, requests,
# retired branches, samples, TensorBoard's logs, a full fine-tune's model): one that is a symbolic link would have the
# run write or delete elsewhere, so the run refuses to start, naming it.
RUN_FOLDERS = ("checkpoints", "snapshots", "requests", "retired", "samples", "logs", "model", "controlnet")


def refuse_linked_folders(output_dir: Path) -> None:
    for name in RUN_FOLDERS:
        folder = Path(output_dir) / name
        if folder.is_symlink():
            raise DifftuneError(
                f"train.output_dir {output_dir}: its {name}/ is a symbolic link (to {os.readlink(folder)}); the run "
                "writes and removes files there, so it must be a real folder: remove the link"
            )


def is_held(output_dir: Path) -> bool:
    """Whether a run holds `output_dir` now (its folder locked; True where there is no `fcntl`: nothing can tell)."""
    try:
        import fcntl
    except ImportError:
        return True
    try:
        folder = os.open(output_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(folder, fcntl.LOCK_UN)
        return False
    finally:
        os.close(folder)


def _release_in_forked_child() -> None:
    """In a forked child, point each held folder's descriptor at /dev/null: the child no longer shares the open file
    (closing the descriptor instead could close, in the parent's code the child runs, whatever took its number)."""
    if not _held_descriptors:
        return
    null = os.open(os.devnull, os.O_RDWR)
    for descriptor in _held_descriptors:
        os.dup2(null, descriptor)
    os.close(null)
    _held_descriptors.clear()


if hasattr(os, "register_at_fork"):  # POSIX, where fcntl's flock is
    os.register_at_fork(after_in_child=_release_in_forked_child)


def _holder(record: Path) -> str:
    try:
        holder = json.loads(record.read_text(encoding="utf-8"))
        who = (
            f"pid {holder['pid']} on {holder['host']}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['started']))}: `{holder['command']}`"
        )
    except (OSError, ValueError, KeyError, TypeError):
        who = f"a process whose {LOCK_FILE} record is missing or unreadable"
    return f"another run is using this folder ({who}); wait for it to end, stop it, or choose another train.output_dir"
