"""Files difftune creates, replaces or removes in the folders it owns (a run's output folder, a job's folder, the
jobs folder), written and removed without following a symbolic link: a link planted there (by another user of a
shared folder, or a careless `ln -s`) never makes difftune write, truncate or delete a file elsewhere.

- The folder is opened once: a folder difftune made (`requests/`, a job's folder) with `O_NOFOLLOW`, so one that is
  itself a link is refused, naming the setting it comes from; a folder the user named (`train.output_dir`, the UI's
  jobs folder) as it is, a link to a larger disk included. Every name in it is then reached through that descriptor
  (`dir_fd`), so a folder swapped for a link after the check is not followed either.
- A file is written under a fresh temporary name (`O_CREAT | O_EXCL`, which never follows a link) and renamed over
  the name: a link there is replaced, not written through. Its mode is the umask's, as `open()` gives.
- Removing a name removes it, a link included (never what the link points to); a folder is removed only when it is a
  real folder, and through descriptors the whole way down (`shutil.rmtree` with `dir_fd`).
- Opening a file to read or lock refuses a link (`O_NOFOLLOW`).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

from difftune.errors import DifftuneError

NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)  # absent on Windows, which has no such links to plant without privilege


def open_folder(folder: Path, setting: str, create: bool = True, ours: bool = True) -> int:
    """A descriptor of `folder` (made, with its parents, if missing and `create`); one difftune made (`ours`) is
    refused where it is a link."""
    folder = Path(folder)
    if create and not folder.is_symlink():
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise DifftuneError(f"{setting} {folder}: is a file, not a folder; remove it") from None
    try:
        return os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | (NO_FOLLOW if ours else 0))
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR) or folder.is_symlink():
            raise DifftuneError(
                f"{setting} {folder}: is a symbolic link{' or not a folder' if err.errno == errno.ENOTDIR else ''}; "
                "difftune writes only into a real folder there: remove the link, or choose another folder"
            ) from None
        raise


def write_file(path: Path, content: str | bytes, setting: str, ours: bool = True) -> None:
    """`content` written whole at `path`, replacing a file or a link there, in the folder `setting` names (`ours`:
    made by difftune, see `open_folder`)."""
    path = Path(path)
    data = content.encode("utf-8") if isinstance(content, str) else content
    folder = open_folder(path.parent, setting, ours=ours)
    staging = f".{path.name}.{os.getpid()}.tmp"
    try:
        _unlink(staging, folder)
        handle = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_FOLLOW, 0o666, dir_fd=folder)
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(data)
            os.replace(staging, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        finally:
            _unlink(staging, folder)
    finally:
        os.close(folder)


def touch_file(path: Path, setting: str, ours: bool = True) -> None:
    """An empty file at `path` unless a file is there already; a link there is replaced by one."""
    path = Path(path)
    folder = open_folder(path.parent, setting, ours=ours)
    try:
        try:
            os.close(os.open(path.name, os.O_WRONLY | os.O_CREAT | NO_FOLLOW, 0o666, dir_fd=folder))
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            os.unlink(path.name, dir_fd=folder)
            os.close(os.open(path.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_FOLLOW, 0o666, dir_fd=folder))
    finally:
        os.close(folder)


def remove(path: Path, setting: str, ours: bool = True) -> None:
    """Remove the name `path`: a file or a link (the link itself), or a real folder and all in it; nothing there is
    no error. A folder's contents are removed through descriptors, never through a link inside it."""
    path = Path(path)
    try:
        folder = open_folder(path.parent, setting, create=False, ours=ours)
    except FileNotFoundError:
        return
    try:
        try:
            found = os.stat(path.name, dir_fd=folder, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(found.st_mode):
            shutil.rmtree(path.name, dir_fd=folder)
        else:
            os.unlink(path.name, dir_fd=folder)
    finally:
        os.close(folder)


def open_for_lock(path: Path, setting: str, ours: bool = True) -> int:
    """A descriptor of the file at `path` (created if missing) to lock, refusing a link there: locking opens it for
    writing, which would create or truncate whatever a link points to."""
    path = Path(path)
    folder = open_folder(path.parent, setting, ours=ours)
    try:
        return os.open(path.name, os.O_RDWR | os.O_CREAT | NO_FOLLOW, 0o666, dir_fd=folder)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise DifftuneError(
                f"{setting}: {path} is a symbolic link; difftune keeps its own file there: remove the link"
            ) from None
        raise
    finally:
        os.close(folder)


def open_append(path: Path, setting: str, ours: bool = False):
    """The file at `path` opened to append text (created if missing); a link there is removed and a file of the run's
    own made in its place, so the lines never land where it points."""
    path = Path(path)
    folder = open_folder(path.parent, setting, ours=ours)
    try:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | NO_FOLLOW
        try:
            handle = os.open(path.name, flags, 0o666, dir_fd=folder)
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            os.unlink(path.name, dir_fd=folder)
            handle = os.open(path.name, flags | os.O_EXCL, 0o666, dir_fd=folder)
    finally:
        os.close(folder)
    return os.fdopen(handle, "a", encoding="utf-8")


def read_text(path: Path) -> str:
    """A file's text, refusing a link (`OSError`, as for a missing file): what difftune reads back from its own
    folders is never another file's."""
    handle = os.open(path, os.O_RDONLY | NO_FOLLOW)
    with os.fdopen(handle, encoding="utf-8") as file:
        return file.read()


def _unlink(name: str, folder: int) -> None:
    try:
        os.unlink(name, dir_fd=folder)
    except FileNotFoundError:
        pass
