"""What the UI's Datasets tab shows of a data folder and does to it: its images and clips with their captions, masks
and controls; caption edits (written whole, the old text kept in a history file); the scan's verdicts and the aspect
buckets a run would make, before any run.

A dataset is read as a run reads it, through `data.dataset` (the listing, the scan, the buckets) with the `[data]`
settings it comes with: a preset's or a job's, or the defaults for a folder typed in. Only folders under the UI's
data roots are read or written (`inside_roots`): a job folder's config may name any path, and is not trusted to. Stored
records (shards, parquet) are read one file at a time, never the whole source, and are not edited here.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageOps

from difftune.config import DataConfig
from difftune.data.cache_folders import write_text
from difftune.data.captioning import METADATA, CaptionReport, caption_folder, load_captioner, metadata_lines
from difftune.data.clips import FrameWindows, read_frames
from difftune.data.dataset import (
    IMAGE_EXTENSIONS,
    BadFile,
    listed_examples,
    mask_file,
    scan_examples,
    training_sizes,
)
from difftune.data.sources import (
    CLIP_SUFFIXES,
    FolderOfFiles,
    Stored,
    data_source,
    is_clip,
    read_source,
    readable,
    source_files,
)
from difftune.errors import DifftuneError
from difftune.files import is_url
from difftune.owned_files import open_append

PAGE_SIZE = 24
THUMBNAIL_SIDE = 256
HISTORY_FILE = "caption_history.jsonl"  # under the jobs folder's `datasets/`: every caption edited here, old and new
# Clips are checked as a video base of 4 frames per latent cuts them (4k + 1 frames: Wan, HunyuanVideo, LTX-Video):
# the tab knows no base; a still-image base leaves clips out, and its run says so.
CLIP_LENGTHS = (4, 1)


@dataclass(frozen=True)
class DatasetItem:
    path: Path | Stored  # the image or clip
    caption: str | None  # None: it has no caption
    caption_file: Path | None  # where its caption is written (its caption file, or its folder's metadata.jsonl)
    mask: Path | Stored | None = None
    controls: tuple = ()

    @property
    def name(self) -> str:
        return str(self.path) if isinstance(self.path, Stored) else self.path.name


def inside_roots(path: str | Path, roots: list[Path], what: str = "dataset") -> Path:
    """`path` resolved, when it lies under one of `roots` (the folders the UI reads and writes data in)."""
    resolved = Path(path).expanduser().resolve()
    if not any(resolved.is_relative_to(root.resolve()) for root in roots):
        listed = ", ".join(str(root) for root in roots)
        raise DifftuneError(
            f"{what} {path}: outside the folders this UI reads data from ({listed}); start it with "
            f"--data-root FOLDER to add one"
        )
    return resolved


def checked_source(data: DataConfig, roots: list[Path], key: str = "data.path") -> DataConfig:
    """`data` with its local paths checked to lie under `roots` (a URL is read, never written)."""
    if is_url(data.path):
        return data
    inside_roots(data.path, roots, key)
    for name in ("mask_path", "control_path"):
        if getattr(data, name):
            inside_roots(getattr(data, name), roots, f"data.{name}")
    return data


def stored_files(data: DataConfig) -> list[str]:
    """The files of stored records (shards, parquet), from one listing; [] for a folder of files."""
    if isinstance(data_source(data.path), FolderOfFiles):
        return []
    return source_files(data.path)[1]


def list_items(data: DataConfig, stored_file: str | None = None) -> list[DatasetItem]:
    """Every image and clip of `data.path` once (repeats folded), with its caption as the run reads it. Stored
    records: those of `stored_file` alone (one of `stored_files`), read-only."""
    if not isinstance(data_source(data.path), FolderOfFiles):
        records, _ = read_source(
            stored_file or stored_files(data)[0],
            IMAGE_EXTENSIONS | set(CLIP_SUFFIXES),
            data.caption_extension,
            data.image_column,
            data.caption_column,
        )
        return [DatasetItem(r.media, r.caption, None, r.media.mask, r.controls) for r in records]
    # Uncaptioned images listed too (the run's choice for them is `missing_caption`'s); read errors go to the scan.
    examples = listed_examples(FolderOfFiles(data.path), data.model_copy(update={"missing_caption": "empty"}), "", [])
    items, seen = [], set()
    for example in examples:
        if example.path in seen:
            continue
        seen.add(example.path)
        metadata = example.path.parent / METADATA
        if metadata.is_file():
            caption_file, caption = metadata, example.caption or None
        else:
            caption_file = example.path.with_suffix(data.caption_extension)
            caption = example.caption if caption_file.is_file() else None
        mask = mask_file(example.path, data) if data.masks == "folder" else None
        items.append(DatasetItem(example.path, caption, caption_file, mask, example.control_paths))
    return items


def page(items: list[DatasetItem], number: int) -> list[DatasetItem]:
    return items[number * PAGE_SIZE : (number + 1) * PAGE_SIZE]


def page_count(items: list[DatasetItem]) -> int:
    return max(1, -(-len(items) // PAGE_SIZE))


def thumbnail(path: Path | Stored, side: int = THUMBNAIL_SIDE) -> Image.Image:
    """An image, or a clip's first frame, at most `side` pixels a side; what cannot be read, a grey card saying so."""
    try:
        if is_clip(path):
            image = read_frames(path, 0, 1)[0]
        else:
            with Image.open(readable(path)) as opened:
                image = ImageOps.exif_transpose(opened).convert("RGB")
    except Exception as err:  # noqa: BLE001 - an unreadable file is shown as such; the scan says why
        card = Image.new("RGB", (side, side), "#888")
        ImageDraw.Draw(card).text((8, side // 2), f"unreadable: {type(err).__name__}", fill="white")
        return card
    image.thumbnail((side, side))
    return image


def write_caption(item: DatasetItem, text: str, roots: list[Path], history: Path) -> DatasetItem:
    """Write `item`'s caption where the run reads it (its caption file, or its line of the folder's metadata.jsonl,
    the file rewritten whole and atomically), after recording the old and new text in `history`. Returns the item
    as it now is."""
    if item.caption_file is None:
        raise DifftuneError(f"{item.name}: a stored record's caption is read-only here; edit it where it was written")
    target = inside_roots(item.caption_file, roots, "caption file")
    text = text.strip()
    if target.name == METADATA:
        listed = metadata_lines(target)
        name = Path(item.path).relative_to(target.parent).as_posix()
        listed.setdefault(name, {"file_name": name})["text"] = text
        content = "".join(json.dumps(entry) + "\n" for entry in listed.values())
    else:
        content = text + "\n"
    with open_append(history, "the jobs folder's datasets/", ours=True) as record:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "file": str(item.path), "old": item.caption, "new": text}
        record.write(json.dumps(entry) + "\n")
    write_text(target, content)
    return DatasetItem(item.path, text, item.caption_file, item.mask, item.controls)


def caption_history(history: Path, path: Path | Stored) -> list[dict]:
    """The edits made here to `path`'s caption, newest first."""
    if not history.is_file():
        return []
    entries = []
    for line in history.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash mid-write
            continue
        if isinstance(entry, dict) and entry.get("file") == str(path):
            entries.append(entry)
    return entries[::-1]


@dataclass(frozen=True)
class DatasetCheck:
    examples: int  # what a run trains on, repeats counted
    left_out: list[BadFile]  # what the run's bad_files.jsonl would list
    uncaptioned: list[Path | Stored]  # what the run stops on under `missing_caption = "error"`
    buckets: Counter  # (width, height) -> examples trained at that size

    def verdicts(self) -> dict[str, str]:
        """Each file's verdict by its path: why it is left out, or why the run would stop on it."""
        said = {str(bad.path): bad.reason for bad in self.left_out}
        for path in self.uncaptioned:
            said.setdefault(str(path), 'no caption: the run stops on it (add one, or data.missing_caption = "empty")')
        return said


def check_dataset(data: DataConfig, key: str = "data.path") -> DatasetCheck:
    """The run's scan of `data` (every image decoded, every clip probed, `scan_examples`) and its buckets, without
    stopping at the first uncaptioned image: those are listed instead (the run stops on them unless
    `missing_caption` says otherwise)."""
    # Stored records are scanned as the run scans them: an uncaptioned one stops it with the run's own message.
    stops = data.missing_caption == "error" and isinstance(data_source(data.path), FolderOfFiles)
    scanned = data.model_copy(update={"missing_caption": "empty"}) if stops else data
    examples, bad = scan_examples(scanned, key, FrameWindows.of(data, CLIP_LENGTHS))
    uncaptioned = [item.path for item in list_items(data) if item.caption is None] if stops else []
    return DatasetCheck(len(examples), bad, uncaptioned, Counter(training_sizes(examples, data)))


def caption_uncaptioned(
    data: DataConfig, model: str, overwrite: bool, roots: list[Path], max_new_tokens: int = 77
) -> CaptionReport:
    """`difftune caption` on `data`'s folder: a caption from the vision-language model `model` for each image without
    one (each with `overwrite`), written where the folder keeps its captions (caption files, or its metadata.jsonl)."""
    if stored_files(data):
        raise DifftuneError(f"{data.path}: stored records are read-only here; caption the folder they were made from")
    folder = inside_roots(data.path, roots)
    if not model.strip():
        raise DifftuneError("give the captioning model: a local folder or hub id (Florence-2, Qwen2.5-VL, Qwen3-VL...)")
    captioner = load_captioner(model.strip(), max_new_tokens=max_new_tokens)
    return caption_folder(folder, captioner, data.caption_extension, (folder / METADATA).is_file(), overwrite)
