"""Files in and out: a safetensors file someone hands difftune opened with a one-line error when it is missing or
not safetensors; results written whole or not at all; a full disk told from other write errors (so the message
can say what is intact)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from safetensors import safe_open

from difftune.errors import DifftuneError


@contextmanager
def open_safetensors(path: Path, what: str = "adapter") -> Iterator:
    """`safe_open` of `path` (a `what`: adapter, embedding...), refusing a missing file or one that is not
    safetensors with one line instead of safetensors' own exception kinds."""
    path = Path(path)
    if not path.is_file():
        raise DifftuneError(f"{what} {path}: no such file")
    try:
        handle = safe_open(path, framework="pt")
    except Exception as err:  # noqa: BLE001 - safetensors raises its own kinds for a file that is not safetensors
        raise DifftuneError(f"{what} {path}: not a readable safetensors file ({err})") from None
    with handle:
        yield handle


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
        with_umask_mode(staging)
        if path.is_dir() and staging.is_dir():
            _remove(path)
        os.replace(staging, path)
    finally:
        _remove(staging)
    return path


def umask() -> int:
    """The process's file-creation mask (Python before 3.13 can only read it by setting it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def with_umask_mode(path: Path) -> None:
    """`path` (a file, or a folder and all in it) given the modes `open()` would have: safetensors writes its files
    0600 whatever the umask, so a ComfyUI or a web server running as another user could not read an adapter."""
    path, mask = Path(path), umask()
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        if not item.is_symlink():
            item.chmod((0o777 if item.is_dir() else 0o666) & ~mask)


def _remove(path: Path) -> None:
    if path.is_symlink():  # a link planted at the staging name: it goes, never what it points to
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def refuse_folder_target(path: Path) -> None:
    """An adapter file to write named by a folder: refused before anything is read or written."""
    if Path(path).is_dir():
        raise DifftuneError(
            f"{path}: is a folder; name the adapter file to write (e.g. {Path(path) / 'lora.safetensors'})"
        )


def is_url(path: str) -> bool:
    return "://" in str(path)


def part_weight_files(folder: Path, variant: str = "") -> list[Path]:
    """A part folder's safetensors files as diffusers picks them: the variant's (`*.fp16.safetensors`), else the
    plain ones, not a variant's copy of the same weights (sorted first, `fp16` before the plain name)."""
    files = sorted(folder.glob(f"*.{variant}.safetensors" if variant else "*.safetensors"))
    if not variant:
        files = [file for file in files if file.name.count(".") == 1] or files
    return files


PIPELINE_INDEXES = ("model_index.json", "modular_model_index.json")  # a pipeline's, a modular pipeline's


def pipeline_index(folder: Path) -> dict | None:
    """A local pipeline folder's index (`model_index.json`, or a modular pipeline's `modular_model_index.json`), each
    part as `[library, class]`: a modular index's parts kept where their files are in `folder`, as `[library,
    class]` (what a plan reads), a part elsewhere left out; None where `folder` has neither file."""
    for name in PIPELINE_INDEXES:
        if (Path(folder) / name).is_file():
            index = json.loads((Path(folder) / name).read_text(encoding="utf-8"))
            break
    else:
        return None
    parts = {}
    for part, entry in index.items():
        if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], dict):  # [library, class, its spec]
            spec = entry[2]
            if (Path(folder) / (spec.get("subfolder") or "")).is_dir() and spec.get("type_hint"):
                parts[part] = list(spec["type_hint"])
        else:
            parts[part] = entry
    return parts


def hub_unavailable(name: str) -> str | None:
    """Why `name`, not a local path, cannot come from the Hugging Face hub now (offline mode on, or the hub
    unreachable), or None. Asked once, at once: the hub client would otherwise retry for about 30 s before
    failing. A copy already in the local hub cache needs no hub."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        if any(isinstance(try_to_load_from_cache(name, f), str) for f in (*PIPELINE_INDEXES, "config.json")):
            return None
    except HFValidationError:
        return None  # not a hub id at all: the loader's own error says so
    if constants.HF_HUB_OFFLINE:
        return "offline mode is on (HF_HUB_OFFLINE)"
    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=5).close()
    except OSError as err:
        return f"{constants.ENDPOINT} is unreachable ({err})"
    return None


def unreachable_base(key: str, name: str, cause: str) -> str:
    """The one line for a base that is neither on this machine nor to be had from the hub."""
    return (
        f"{key} {name}: not a local folder or file (looked at {Path(name).resolve()}), and it could not be fetched "
        f"from the Hugging Face hub (offline, or no such id). Pass a local diffusers folder or a .safetensors file. "
        f"Cause: {cause}"
    )
