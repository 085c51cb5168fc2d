"""Writing results safely: a file or folder replaced whole or not at all, and telling a full disk from other
write errors (so the message can say what is intact)."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def out_of_space(err: BaseException, folder: Path) -> bool:
    """Whether a failed write into `folder` ran out of disk: ENOSPC anywhere in the exception's chain, or no room
    left afterwards (torch's writer says only "basic_ios::clear: iostream error" or "unexpected pos")."""
    seen = err
    while seen is not None:
        if getattr(seen, "errno", None) == errno.ENOSPC or "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(folder).free < 64 * 2**20
    except OSError:
        return False


def replace_atomically(path: Path, write: Callable[[Path], object]) -> Path:
    """`write` a file (or folder) to a temporary sibling, then put it in place in one rename: `path` is either the
    old whole thing or the new whole thing, never a half-written one (a crash or a full disk mid-write)."""
    path = Path(path)
    staging = path.with_name(f".{path.name}.tmp")
    _remove(staging)
    try:
        write(staging)
        if path.is_dir() and staging.is_dir():
            _remove(path)
        os.replace(staging, path)
    finally:
        _remove(staging)
    return path


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
