"""Where the caches and the scans' index are kept: a local (or network) folder, or object storage (`cache.dir =
"s3://bucket/difftune-cache"`), so that machines without a shared file system share one cache.

A folder on object storage is universal_pathlib's `UPath` (pathlib's interface over fsspec, the library data sources
use), so the caches build their entries' names the same way for both. What differs is here: a local file is written
under a temporary name and renamed into place, an object is put whole (an object store never shows half an object);
which entries exist is one listing of the folder rather than one request per entry.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load, load_file, save, save_file

from difftune.errors import DifftuneError
from difftune.files import is_url, with_umask_mode


def folder(location: str, key: str = "cache.dir") -> Path:
    """A local folder as a Path; a URL as a UPath (universal_pathlib, the `storage` extra)."""
    if not is_url(location):
        return Path(location)
    try:
        from upath import UPath
    except ImportError:
        raise DifftuneError(
            f"{key} {location}: a folder on object storage needs universal_pathlib: pip install difftune[storage]"
        ) from None
    return UPath(location)


def is_remote(path) -> bool:
    return getattr(path, "protocol", "") not in ("", "file", "local")


def read_tensors(path) -> dict[str, torch.Tensor]:
    return load(path.read_bytes()) if is_remote(path) else load_file(path)


def write_tensors(path, tensors: dict[str, torch.Tensor]) -> None:
    tensors = {name: value.detach().to("cpu", torch.float32).contiguous() for name, value in tensors.items()}
    if is_remote(path):
        path.write_bytes(save(tensors))
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(handle)
    save_file(tensors, staging)
    with_umask_mode(staging)
    os.replace(staging, path)


def write_text(path, text: str) -> None:
    if is_remote(path):
        path.write_text(text, encoding="utf-8")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)


def existing(paths: list) -> set:
    """Which of `paths` exist: each checked locally, or on object storage by listing their common folders once."""
    remote = [path for path in paths if is_remote(path)]
    found = {path for path in paths if not is_remote(path) and path.exists()}
    if remote:
        fs = remote[0].fs
        roots = {str(path.parent.parent) for path in remote}  # <cache>/<kind>: entries sit in 256 subfolders of it
        listed = set()
        for root in roots:
            listed |= {fs.unstrip_protocol(name) for name in fs.find(root)} if fs.exists(root) else set()
        found |= {path for path in remote if str(path) in listed}
    return found
