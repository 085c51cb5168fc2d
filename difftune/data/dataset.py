"""Captioned images -> training batches.

Two folder layouts: images with same-stem caption files (kohya), or a `metadata.jsonl` with
`file_name` and `text` (Hugging Face imagefolder). Subfolders named `N_name` repeat N times. Or stored records, local
or on object storage (sources.py): webdataset tar shards, parquet files, a saved `datasets` folder; each record's
image or clip a `Stored` locator, standing where a file's path stands here.

Edit bases train on pairs: a target image, its instruction caption and one or more control (source) images, found
in a `control` folder beside the images (`data.control_path` for another) by the target's stem (`cat.png`), or
numbered for several (`cat_0.png`, `cat_1.png`: musubi-tuner's and ai-toolkit's layout), or listed as a
metadata line's `control_files`. A control is cut at the same relative place as its target and flipped with it,
at the size the family's rule gives (`Family.control_size`). Targets without controls train in the same run.

Video bases (`Family.reads_clips`: Wan) also train on clips, captioned as images are: each clip gives windows of
frames (clips.py, `data.target_frames` and `data.frame_extraction`), each window an example whose pixels are
(3, T, H, W), all its frames cut at one place and flipped together; images in the same run train as they are (the
family reads them as one-frame clips), and a batch never mixes frame counts.

Sound bases (`Family.reads_sound`: ACE-Step) train on sound files alone, captioned as images are: each file gives
windows of time (sound_files.py), each window an example whose "pixels" are its waveform one row high (2, 1, samples),
never flipped or cropped.

Captions can be dressed (a prefix and suffix), varied per draw (tag shuffle and tag dropout, kohya's), and
dropped (caption dropout); `CaptionDrawer` does all three.

Every sample's randomness (crop, flip, caption draws here; timestep and noise in the loop) comes
from a seed derived from (train seed, epoch, index). A run is then the same whatever the batch split,
gradient accumulation, worker count or number of processes, and resuming means starting the sampler
at a position: nothing else needs restoring.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import singledispatch
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm.auto import tqdm

from difftune.config import DataConfig
from difftune.data.cache_folders import read_tensors, write_text
from difftune.data.clips import BadClip, FrameWindows, frame_rate, frame_size, probe, read_frames
from difftune.data.sound_files import SoundWindows, read_window, sound_length, window_geometry
from difftune.data.sources import (
    CLIP_SUFFIXES,
    IMAGE_EXTENSIONS,
    REPEATS_FOLDER,
    SOUND_SUFFIXES,
    DataSource,
    FolderOfFiles,
    Stored,
    StoredRecords,
    data_source,
    is_clip,
    is_sound,
    is_timed,
    no_media,
    read_source,
    readable,
    source_identity,
    stored_fields,
    stored_from_fields,
)
from difftune.errors import DifftuneError

NUMBERED_CONTROL = re.compile(r"^(.+)_(\d+)$")
CONTROL_FOLDER = "control"


@dataclass(frozen=True)
class Example:
    path: Path | Stored  # the image, or the clip a window of frames is cut from
    caption: str
    loss_weight: float = 1.0  # prior preservation's class images train at `prior.loss_weight`
    # An edit pair's control images, in the order the base reads them; a layered base's layers (Qwen-Image-Layered)
    control_paths: tuple[Path, ...] = ()
    # a clip's window: (first frame, frame count); a sound's: (first sample, sample count); None for an image
    frames: tuple[int, int] | None = None
    sound_rate: int = 0  # a sound's: the samples a second its window counts (its base's autoencoder's rate)
    dataset: int = 0  # the settings it is read with: an index into `DataConfig.each_dataset()`


@dataclass(frozen=True)
class BadFile:
    path: Path | Stored | str  # a file, a stored record's media, or a file or record of a source (`file:key`)
    reason: str


class BadImage(Exception):
    """An image that cannot be trained on; the message is the reason."""


def scan_examples(
    config: DataConfig,
    key: str = "data.path",
    windows: FrameWindows | SoundWindows | None = None,
    index_folder: Path | None = None,
    layers: bool = False,
) -> tuple[list[Example], list[BadFile]]:
    """Every usable (image, caption) pair under `config.path`, each listed as often as its folder repeats,
    and the files left out with their reasons. Every image is decoded once here, so a bad one is found
    before the first step, not at step 9,000. `key`: the setting the folder came from, as messages name it.
    `windows`: how a base that reads clips or sounds cuts them (`Family.frame_windows`): each window of a clip or
    sound is an example, every one decoded once here too; None: clips and sounds are left out and reported.
    `layers`: a layered base's folders (Qwen-Image-Layered, musubi-tuner's layout): each image's layers lie beside it,
    numbered `stem_1.png`, `stem_2.png`... (or from `_0`), and are its `control_paths`, not examples of their own.

    `index_folder`: where the scan of stored records (sources.py) is kept, keyed by every file's size and version and
    the data settings: the first process to scan writes it, and later runs and processes read it instead of reading
    every record again (N processes on object storage would fetch the dataset N times)."""
    source = data_source(config.path)
    if index_folder is None or not source.scan_is_kept:
        return _scan(source, config, key, windows, layers)
    identity = {
        "format": SCAN_INDEX_FORMAT,
        # what `scan_datasets` does with a scan is not the scan's: indexes written before datasets stay valid
        "data": config.model_dump(mode="json", exclude={"repeats", "loss_weight", "datasets"}),
        "windows": repr(windows),
        "layers": layers,
        "files": source_identity(config.path, key),
    }
    index = index_folder / f"{hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()}.json"
    if index.is_file():
        kept = json.loads(index.read_text(encoding="utf-8"))
        return (
            [
                Example(
                    stored_from_fields(e["path"]),
                    e["caption"],
                    frames=tuple(e["frames"]) if e["frames"] else None,
                    control_paths=tuple(stored_from_fields(c) for c in e["controls"]),
                )
                for e in kept["examples"]
            ],
            [BadFile(b["path"], b["reason"]) for b in kept["bad"]],
        )
    examples, bad = _scan(source, config, key, windows, layers)
    write_text(
        index,
        json.dumps(
            {  # whole or not at all: readers never see half of it
                "examples": [
                    {
                        "path": stored_fields(e.path),
                        "caption": e.caption,
                        "frames": e.frames,
                        "controls": [stored_fields(c) for c in e.control_paths],
                    }
                    for e in examples
                ],
                "bad": [{"path": str(b.path), "reason": b.reason} for b in bad],
            }
        ),
    )
    return examples, bad


SCAN_INDEX_FORMAT = "1"  # bumped when what the index holds changes


def scan_datasets(
    config: DataConfig,
    windows: Callable[[DataConfig], FrameWindows | SoundWindows | None] = lambda data: None,
    index_folder: Path | None = None,
    layers: bool = False,
) -> tuple[list[Example], list[BadFile]]:
    """Every dataset's examples (`scan_examples`), each marked with its `dataset` (its settings:
    `config.each_dataset()`), listed `repeats` times and trained at its `loss_weight`; and the files left out, each
    once. A folder several datasets read alike (one dataset at several resolutions) is scanned once. `windows`: how
    the base cuts a dataset's clips (`Family.frame_windows` of its settings)."""
    examples: list[Example] = []
    bad: list[BadFile] = []
    scans: dict[str, list[Example]] = {}
    for number, (data, key) in enumerate(zip(config.each_dataset(), config.dataset_keys(), strict=True)):
        data_windows = windows(data)
        scanned = data.model_dump_json(exclude={"resolution", "repeats", "loss_weight"}) + repr(data_windows)
        if scanned not in scans:
            scans[scanned], left_out = scan_examples(data, key, data_windows, index_folder, layers)
            bad += left_out
        examples += [
            replace(example, dataset=number, loss_weight=example.loss_weight * data.loss_weight)
            for example in scans[scanned]
            for _ in range(data.repeats)
        ]
    return examples, bad


def _scan(
    source: DataSource,
    config: DataConfig,
    key: str,
    windows: FrameWindows | SoundWindows | None,
    layers: bool = False,
) -> tuple[list[Example], list[BadFile]]:
    root = config.path
    bad: list[BadFile] = []
    examples = listed_examples(source, config, key, bad, layers)
    if not examples and not bad:
        raise DifftuneError(no_media(key, root))
    examples = _cut_timed(examples, windows, bad)
    controls = {c for e in examples for c in e.control_paths}
    images = {e.path for e in examples if e.frames is None}
    unusable, sizes = _find_unusable_images(images | controls, config, controls)
    reasons = {b.path: b.reason for b in unusable}
    left_out: dict[Path, str] = {}  # a pair with a bad control is left out whole, under its target's name
    for example in examples:
        control = next((c for c in example.control_paths if c in reasons), None)
        if example.path in reasons:
            left_out[example.path] = reasons[example.path]
        elif control is not None:
            left_out[example.path] = f"control {control}: {reasons[control]}"
    bad += [BadFile(path, reason) for path, reason in sorted(left_out.items())]
    examples = [e for e in examples if e.path not in left_out]
    # A stored image's size, known from its decode, spares fetching it again for its header (buckets, geometry).
    examples = [
        replace(
            e,
            path=replace(e.path, displayed=sizes[e.path]),
            control_paths=tuple(replace(c, displayed=sizes[c]) for c in e.control_paths),
        )
        if isinstance(e.path, Stored) and e.path in sizes
        else e
        for e in examples
    ]
    if not examples:
        reasons = "; ".join(f"{getattr(b.path, 'name', b.path)}: {b.reason}" for b in bad[:5])
        raise DifftuneError(f"{key} {root}: no usable image ({len(bad)} left out: {reasons})")
    return examples, bad


BAD_FILES_REPORT = "bad_files.jsonl"


def report_bad_files(bad: list[BadFile], report: Path | None, print_fn=print) -> None:
    """Each left-out file once, in the log and (when given) in a JSONL report."""
    for item in bad:
        print_fn(f"difftune: skipping {item.path}: {item.reason}")
    if report is not None:
        report.write_text(
            "".join(json.dumps({"file": str(b.path), "reason": b.reason}) + "\n" for b in bad), encoding="utf-8"
        )


@singledispatch
def listed_examples(
    source: DataSource, config: DataConfig, key: str, bad: list[BadFile], layers: bool = False
) -> list[Example]:
    """Every example `source` lists, each as often as its folder repeats; what cannot be read goes to `bad`.
    `layers`: `scan_examples`'."""
    raise NotImplementedError(f"{source}: how its examples are listed")


@listed_examples.register
def _(source: FolderOfFiles, config: DataConfig, key: str, bad: list[BadFile], layers: bool = False) -> list[Example]:
    root = Path(source.path)
    if not root.is_dir():
        raise DifftuneError(
            f"{key} {root} is not a folder; point it at a folder of captioned images, shards or parquet files"
        )
    examples = _scan_folder(root, config, bad, layers=layers)
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        match = REPEATS_FOLDER.match(sub.name)
        if match:
            examples += _scan_folder(sub, config, bad, match.group(2), layers) * int(match.group(1))
    return examples


@listed_examples.register
def _(source: StoredRecords, config: DataConfig, key: str, bad: list[BadFile], layers: bool = False) -> list[Example]:
    return _scan_stored(config, key, bad)  # a record's layers are its `controls`, as an edit pair's


def _scan_folder(
    folder: Path, config: DataConfig, bad: list[BadFile], folder_caption: str | None = None, layers: bool = False
) -> list[Example]:
    """The folder's images and captions; `folder_caption` (an `N_name` folder's name) for `missing_caption =
    "folder"`; `layers`: `scan_examples`'."""
    metadata = folder / "metadata.jsonl"
    if metadata.is_file():
        return _read_metadata(metadata, bad)
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS or is_timed(p))
    found_layers = _layer_files(files) if layers else {}
    layer_files = {path for numbered in found_layers.values() for _, path in numbered}
    files = [path for path in files if path not in layer_files]
    examples = []
    for source in files:
        caption_path = source.with_suffix(config.caption_extension)
        if caption_path.is_file():
            try:
                caption = caption_path.read_text(encoding="utf-8-sig").strip()
            except UnicodeDecodeError as err:
                bad.append(
                    BadFile(
                        caption_path, f"caption is not UTF-8 ({err.reason} at byte {err.start}); re-save it as UTF-8"
                    )
                )
                continue
        elif caption_path.exists():  # a folder (or a device) where its caption file should be: not "no caption"
            bad.append(BadFile(caption_path, "its caption is not a file (a folder?); make it the image's caption file"))
            continue
        elif config.missing_caption == "empty":
            caption = ""
        elif config.missing_caption == "folder" and folder_caption is not None:
            caption = folder_caption
        elif config.missing_caption == "folder":
            raise DifftuneError(
                f"{source} has no caption file {caption_path.name} and is not in an `N_name` folder to take its "
                f'caption from (data.missing_caption = "folder"); add a caption file or move it into one'
            )
        else:
            raise DifftuneError(
                f"{source} has no caption file {caption_path.name}; add one, or set "
                f'data.missing_caption = "empty" to train it uncaptioned'
            )
        examples.append(Example(source, caption))
    if layers:
        return _with_layers(examples, found_layers, bad)
    return _with_controls(examples, Path(config.control_path) if config.control_path else folder / CONTROL_FOLDER, bad)


def _layer_files(files: list[Path]) -> dict[str, list[tuple[int, Path]]]:
    """The layers among a folder's `files`, by the stem of the image they belong to: `stem_<n>` beside `stem`, with
    their numbers."""
    stems = {path.stem for path in files}
    found: dict[str, list[tuple[int, Path]]] = {}
    for path in files:
        numbered = NUMBERED_CONTROL.match(path.stem)
        if numbered and numbered.group(1) in stems:
            found.setdefault(numbered.group(1), []).append((int(numbered.group(2)), path))
    return found


def _with_layers(
    examples: list[Example], found: dict[str, list[tuple[int, Path]]], bad: list[BadFile]
) -> list[Example]:
    """The examples with their layers (`found`: stem -> (number, file)), numbered from 0 or 1 without gaps; an image
    with none, or with a gap, is left out and reported."""
    layered = []
    for example in examples:
        numbered = sorted(found.get(example.path.stem, []))
        numbers = [number for number, _ in numbered]
        if not numbers or numbers != list(range(numbers[0], numbers[0] + len(numbers))) or numbers[0] > 1:
            names = ", ".join(path.name for _, path in numbered) or "none"
            bad.append(
                BadFile(
                    example.path,
                    f"a layered base trains an image with its layers beside it, numbered {example.path.stem}_1"
                    f"{example.path.suffix}, {example.path.stem}_2{example.path.suffix}... without gaps (found: "
                    f"{names})",
                )
            )
            continue
        layered.append(replace(example, control_paths=tuple(path for _, path in numbered)))
    return layered


def _scan_stored(config: DataConfig, key: str, bad: list[BadFile]) -> list[Example]:
    """Every record of the shards, parquet files or saved dataset `config.path` names, in file order (sources.py)."""
    records, left_out = read_source(
        config.path,
        IMAGE_EXTENSIONS | set(CLIP_SUFFIXES),
        config.caption_extension,
        config.image_column,
        config.caption_column,
        key,
    )
    bad += [BadFile(where, reason) for where, reason in left_out]
    uncaptioned = next((record for record in records if record.caption is None), None)
    if uncaptioned is not None and config.missing_caption != "empty":
        raise DifftuneError(
            f"{uncaptioned.media} has no caption (a {config.caption_extension} member "
            "or a .json member's `text` in a shard, a caption column in a table); "
            'add one, or set data.missing_caption = "empty" to train it uncaptioned'
        )
    return [Example(record.media, record.caption or "", control_paths=record.controls) for record in records]


def _with_controls(examples: list[Example], control_folder: Path, bad: list[BadFile]) -> list[Example]:
    """The examples with their control images from `control_folder` (same stem, or `stem_0`, `stem_1`...); an
    example whose controls are ambiguous or numbered with a gap is left out and reported."""
    if not control_folder.is_dir():
        return examples
    stems = {example.path.stem for example in examples}
    found: dict[str, list[tuple[int, Path]]] = {}  # target stem -> (number, file); -1 for an unnumbered one
    for path in sorted(p for p in control_folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS):
        numbered = NUMBERED_CONTROL.match(path.stem)
        if path.stem in stems:
            found.setdefault(path.stem, []).append((-1, path))
        elif numbered and numbered.group(1) in stems:
            found.setdefault(numbered.group(1), []).append((int(numbered.group(2)), path))
    paired = []
    for example in examples:
        controls = sorted(found.get(example.path.stem, []))
        numbers = [number for number, _ in controls]
        if numbers and numbers != [-1] and numbers != list(range(len(numbers))):
            names = ", ".join(path.name for _, path in controls)
            bad.append(
                BadFile(
                    example.path,
                    f"its controls in {control_folder} ({names}) must be one file named "
                    f"{example.path.stem}.* or files numbered _0, _1... without gaps",
                )
            )
            continue
        paired.append(replace(example, control_paths=tuple(path for _, path in controls)))
    return paired


def _cut_timed(
    examples: list[Example], windows: FrameWindows | SoundWindows | None, bad: list[BadFile]
) -> list[Example]:
    """The examples with each clip's (a sound base's: each sound's) replaced by one per window; what cannot be read, is
    shorter than every window or is not what the base trains (a clip or sound for an image base, a sound for a video
    base, anything but a sound for a sound base) is reported. Each file is decoded once (in threads: FFmpeg releases
    the GIL)."""
    sounds = isinstance(windows, SoundWindows)
    trained = is_sound if sounds else is_clip
    bad += [BadFile(path, reason) for path, reason in _untrained(examples, windows).items()]
    timed = sorted({example.path for example in examples if trained(example.path)} if windows else set())

    def cut(path: Path) -> list[tuple[int, int]] | str:
        try:
            length = sound_length(path, windows.rate) if sounds else probe(path).frames
        except BadClip as err:
            return str(err)
        found = windows.windows(length)
        if found or sounds:
            return found
        lengths = ", ".join(str(windows.rounded(frames)) for frames in windows.target_frames)
        return f"{length} frames: shorter than every window of data.target_frames ({lengths} frames)"

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        what = "reading sounds" if sounds else "reading clips"
        found = tqdm(pool.map(cut, timed), total=len(timed), desc=what, disable=len(timed) < 50)
        cuts = dict(zip(timed, found, strict=True))
    bad += [BadFile(path, reason) for path, reason in cuts.items() if isinstance(reason, str)]
    out = []
    for example in examples:
        if example.path not in cuts:
            out += [example] if not sounds and not is_timed(example.path) else []
        elif not isinstance(cuts[example.path], str):
            rate = windows.rate if sounds else 0
            out += [replace(example, frames=window, sound_rate=rate) for window in cuts[example.path]]
    return out


def _untrained(examples: list[Example], windows: FrameWindows | SoundWindows | None) -> dict[Path, str]:
    """The files of `examples` the base does not train, each with why (`_cut_timed`)."""
    if isinstance(windows, SoundWindows):
        return {
            example.path: "not a sound: this base trains sound files alone (" + ", ".join(sorted(SOUND_SUFFIXES)) + ")"
            for example in examples
            if not is_sound(example.path)
        }
    found = {}
    for example in examples:
        if is_sound(example.path):
            found[example.path] = "a sound: this base trains pictures (a sound base such as ACE-Step reads sounds)"
        elif is_clip(example.path) and windows is None:
            found[example.path] = "a clip: this base trains still images (a video base such as Wan reads clips)"
    return found


def _find_unusable_images(
    paths: set[Path], config: DataConfig, controls: set[Path] = frozenset()
) -> tuple[list[BadFile], dict[Path, tuple[int, int]]]:
    """Decode each image once (in threads: PIL releases the GIL while decoding); `controls` have no masks. Returns
    those left out, and the others' (width, height) as displayed."""

    def check(path: Path) -> BadFile | tuple[int, int]:
        try:
            size = open_image(path, config).size
            if config.masks != "off" and path not in controls:
                open_mask(path, config, size)
        except BadImage as err:
            return BadFile(path, str(err))
        return size

    ordered = sorted(paths)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        results = list(
            tqdm(pool.map(check, ordered), total=len(ordered), desc="checking images", disable=len(ordered) < 500)
        )
    return (
        [result for result in results if isinstance(result, BadFile)],
        {path: result for path, result in zip(ordered, results, strict=True) if not isinstance(result, BadFile)},
    )


def _byte_count(path: Path | Stored) -> int:
    if isinstance(path, Stored):
        return path.size
    try:
        return path.stat().st_size
    except OSError as err:  # a dangling symlink, a symlink loop, a file gone since the folder was listed
        target = f"a symbolic link to {os.readlink(path)}, which " if path.is_symlink() else ""
        reason = {errno.ENOENT: "does not exist", errno.ELOOP: "leads back to itself (a loop)"}.get(
            err.errno, err.strerror
        )
        raise BadImage(f"cannot be read: {target}{reason}") from None


def open_image(path: Path | Stored, config: DataConfig) -> Image.Image:
    """Decode an image fully into 8-bit RGB: EXIF orientation applied, 16-bit scaled down, palette and
    transparency composited onto `alpha_background` (or, with `keep_alpha`, kept: 8-bit RGBA). Raises BadImage for
    anything that cannot be trained on."""
    if _byte_count(path) == 0:
        raise BadImage("empty file (0 bytes)")
    too_large = BadImage(f"more than data.max_image_pixels = {config.max_image_pixels} pixels")
    # PIL refuses images over twice its module-wide limit as it opens them; the size check below, made before
    # anything is decoded, refuses the rest. (Turning PIL's warning into an error with warnings.catch_warnings
    # is not thread-safe: images are checked by a thread pool, and a bomb got through.)
    Image.MAX_IMAGE_PIXELS = config.max_image_pixels
    try:
        with Image.open(readable(path)) as raw:
            if raw.width * raw.height > config.max_image_pixels:
                raise too_large
            frames = getattr(raw, "n_frames", 1)
            if frames > 1:  # PIL would hand over the first frame, as if the file were that still image
                raise BadImage(
                    f"animated ({frames} frames): difftune trains still images; save the frame to train as a PNG"
                )
            raw.load()  # a truncated file fails here; it is never padded (LOAD_TRUNCATED_IMAGES stays off)
            image = ImageOps.exif_transpose(raw)
    except BadImage:
        raise
    except Image.DecompressionBombError:
        raise too_large from None
    except Exception as err:  # PIL raises many kinds for corrupt data: OSError, SyntaxError, ValueError...
        raise BadImage(f"cannot be decoded: {type(err).__name__}: {err}") from None
    if min(image.size) < config.min_image_size:
        raise BadImage(f"{image.width}x{image.height} is smaller than data.min_image_size = {config.min_image_size}")
    return image.convert("RGBA") if config.keep_alpha else _to_rgb(image, config.alpha_background)


def mask_file(path: Path | Stored, config: DataConfig) -> Path | Stored | None:
    """An image's mask: its shard record's mask member (`data.masks = "record"`), or in `data.mask_path` the file of the
    same stem, any image extension; None without one."""
    if config.masks == "record":
        return path.mask if isinstance(path, Stored) else None
    for candidate in sorted(Path(config.mask_path).glob(f"{path.stem}.*")):
        if candidate.suffix.lower() in IMAGE_EXTENSIONS:
            return candidate
    return None


def open_mask(path: Path | Stored, config: DataConfig, known_size: tuple[int, int] | None = None) -> Image.Image | None:
    """The image's mask as 8-bit grayscale of the image's size (EXIF orientation applied): its alpha channel, or its
    file in `mask_path`; None where it has none (it trains whole). Raises BadImage for one that cannot be used.
    `known_size`: the image's (width, height) when the caller has it, else `image_size` reads the header."""
    if config.masks == "alpha":
        with Image.open(readable(path)) as raw:
            image = ImageOps.exif_transpose(raw)
            if image.mode == "P" and "transparency" in image.info:
                image = image.convert("RGBA")
            return image.getchannel("A").copy() if "A" in image.getbands() else None
    source = mask_file(path, config)
    if source is None:
        return None
    try:
        with Image.open(readable(source)) as raw:
            mask = ImageOps.exif_transpose(raw).convert("L")
    except Exception as err:  # as in open_image: PIL raises many kinds for corrupt data
        raise BadImage(f"mask {source.name} cannot be decoded: {type(err).__name__}: {err}") from None
    size = known_size or image_size(path)
    if mask.size != size:
        raise BadImage(
            f"mask {source} is {mask.width}x{mask.height}, the image {size[0]}x{size[1]}; masks must match their image"
        )
    if not mask.getbbox():
        raise BadImage(f"mask {source} is all black: nothing of the image would train")
    return mask


def mask_view(mask: Image.Image | None, crop: Crop, size: tuple[int, int], flipped: bool) -> torch.Tensor:
    """A mask cut and flipped as its image was: (1, H, W) in [0, 1]; all ones for an image without a mask."""
    if mask is None:
        return torch.ones(1, size[1], size[0])
    view = mask.resize(crop.scaled, Image.Resampling.BILINEAR).crop(
        (crop.left, crop.top, crop.left + size[0], crop.top + size[1])
    )
    if flipped:
        view = view.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.asarray(view, dtype=np.float32) / 255.0)[None]


def centered_view_mask(
    path: Path | Stored, config: DataConfig, size: tuple[int, int], flipped: bool, original: tuple[int, int]
) -> torch.Tensor:
    """The mask of an image's cached view (center-cropped to `size` from its `original` size, maybe flipped), as
    `mask_view` makes it: all ones where the image has none."""
    return mask_view(open_mask(path, config, original), place_crop(original, size, "center"), size, flipped)


def _to_rgb(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    if image.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        # 16-bit (and 32-bit) grayscale: PIL's own convert("L") clips at 255; scale the range instead.
        array = np.asarray(image, dtype=np.float64)
        top = 65535.0 if image.mode.startswith("I;16") or array.max() > 255 else 255.0
        image = Image.fromarray(np.clip(array / top * 255.0 + 0.5, 0, 255).astype(np.uint8), "L")
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, tuple(background))
        flat.paste(rgba, mask=rgba.getchannel("A"))
        return flat
    return image.convert("RGB")


def _read_metadata(path: Path, bad: list[BadFile]) -> list[Example]:
    examples = []
    for line_number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            file_name, text = record["file_name"], record["text"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise DifftuneError(
                f"{path}:{line_number}: each line must be a JSON object with `file_name` and `text` ({err!r})"
            ) from None
        if Path(file_name).is_absolute() or ".." in Path(file_name).parts:
            raise DifftuneError(
                f"{path}:{line_number}: file_name {file_name!r} leads outside {path.parent}; data.path must hold its "
                f"images (copy or link them into it and name them relative to it)"
            )
        source = path.parent / file_name
        if not source.is_file():
            raise DifftuneError(f"{path}:{line_number}: image {file_name} does not exist next to it")
        control_files = record.get("control_files", [])
        control_files = [control_files] if isinstance(control_files, str) else control_files
        if not isinstance(control_files, list) or not all(isinstance(name, str) for name in control_files):
            raise DifftuneError(
                f"{path}:{line_number}: control_files must be a file name or a list of them, got {control_files!r}"
            )
        outside = [name for name in control_files if Path(name).is_absolute() or ".." in Path(name).parts]
        if outside:
            raise DifftuneError(
                f"{path}:{line_number}: control file {outside[0]!r} leads outside {path.parent}; name it "
                f"relative to the folder, as file_name"
            )
        missing = [name for name in control_files if not (path.parent / name).is_file()]
        if missing:
            bad.append(BadFile(source, f"control {missing[0]} (line {line_number} of {path.name}) does not exist"))
            continue
        examples.append(Example(source, str(text).strip(), control_paths=tuple(path.parent / n for n in control_files)))
    return examples


SAMPLE_STREAM, ORDER_STREAM, CAPTION_STREAM = 0, 1, 3  # validation.py's is 2


def derive_seed(stream: int, *words: int) -> int:
    """A well-mixed 63-bit seed from non-negative integers; `stream` keeps different uses apart."""
    return int(np.random.SeedSequence([stream, *words]).generate_state(1, np.uint64)[0] >> 1)


def sample_seed(train_seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's randomness in one epoch."""
    return derive_seed(SAMPLE_STREAM, train_seed, epoch, index)


@dataclass(frozen=True)
class Crop:
    """Where a training image comes from in its source: the source is resized to `scaled` (width, height) to cover
    the training size, and the training size is cut out at (`left`, `top`), in resized pixels."""

    scaled: tuple[int, int]
    left: int
    top: int


def place_crop(original: tuple[int, int], size: tuple[int, int], crop: str, rng: random.Random | None = None) -> Crop:
    """The crop of an `original` (width, height) image for training `size` (width, height): at random (from `rng`)
    for `random`, else centered."""
    width, height = size
    scale = max(width / original[0], height / original[1])
    scaled = (max(width, round(original[0] * scale)), max(height, round(original[1] * scale)))
    spare_x, spare_y = scaled[0] - width, scaled[1] - height
    if crop == "random":
        return Crop(scaled, rng.randint(0, spare_x), rng.randint(0, spare_y))
    return Crop(scaled, spare_x // 2, spare_y // 2)


def cut(image: Image.Image, crop: Crop, size: tuple[int, int]) -> Image.Image:
    image = image.resize(crop.scaled, Image.Resampling.BICUBIC)
    return image.crop((crop.left, crop.top, crop.left + size[0], crop.top + size[1]))


def resize_and_crop(
    image: Image.Image, size: tuple[int, int], crop: str, rng: random.Random | None = None
) -> Image.Image:
    """Resize to cover `size` (width, height) and crop it out (at random, from `rng`, for `random`)."""
    return cut(image, place_crop(image.size, size, crop, rng), size)


def image_geometry(original: tuple[int, int], crop: Crop, size: tuple[int, int], flipped: bool) -> torch.Tensor:
    """A training image's micro-conditioning facts (6,): original height and width (before resizing), the crop's
    top and left in resized pixels, and the training height and width: SDXL's "time ids", in its order. Under a
    flip the crop's left is mirrored (the image's left edge is what was the crop's right), as kohya computes it."""
    left = crop.scaled[0] - crop.left - size[0] if flipped else crop.left
    return torch.tensor([original[1], original[0], crop.top, left, size[1], size[0]])


def bucket_sizes(config: DataConfig) -> list[tuple[int, int]]:
    """Kohya-style buckets: (width, height) pairs in multiples of `bucket_step` within the side limits, each
    with at most resolution^2 pixels, both orientations."""
    area, step = config.resolution**2, config.bucket_step
    sizes = set()
    for width in range(config.bucket_min_side, config.bucket_max_side + 1, step):
        height = min(config.bucket_max_side, area // width // step * step)
        if height >= config.bucket_min_side:
            sizes |= {(width, height), (height, width)}
    return sorted(sizes)


def image_size(path: Path) -> tuple[int, int]:
    """(width, height) as displayed (EXIF orientation applied), or a clip's frames', from the header alone."""
    if isinstance(path, Stored) and path.displayed:
        return path.displayed
    if is_clip(path):
        return frame_size(path)
    with Image.open(readable(path)) as image:
        width, height = image.size
        return (height, width) if image.getexif().get(0x0112) in (5, 6, 7, 8) else (width, height)


def training_sizes(examples: list[Example], config: DataConfig) -> list[tuple[int, int]]:
    """The (width, height) each example trains at: its dataset's square resolution, or its closest-aspect bucket
    there."""
    datasets = config.each_dataset()
    buckets = [bucket_sizes(data) if data.buckets else [] for data in datasets]
    ratios = [np.log([w / h for w, h in sizes]) if sizes else None for sizes in buckets]
    aspects: dict[Path | Stored, float] = {}  # each image's header read once, whatever its datasets

    def size_of(example: Example) -> tuple[int, int]:
        if example.sound_rate:  # a sound, one row high
            return example.frames[1], 1
        if not buckets[example.dataset]:
            side = datasets[example.dataset].resolution
            return side, side
        if example.path not in aspects:
            width, height = image_size(example.path)
            aspects[example.path] = np.log(width / height)
        closest = np.argmin(np.abs(ratios[example.dataset] - aspects[example.path]))
        return buckets[example.dataset][int(closest)]

    return [size_of(example) for example in examples]


def draw_flip(config: DataConfig, rng: random.Random) -> bool:
    return config.random_flip and rng.random() < 0.5


Size = tuple[int, int]  # (width, height)


def check_one_control_each(examples: list[Example], key: str, control: str, trains: str) -> None:
    """Every example a pair: exactly one control image (what `trains`, the setting that reads it, calls a `control`:
    a ControlNet's control image, a preference pair's rejected image), else a `DifftuneError` naming the first
    example without."""
    unpaired = next((example for example in examples if len(example.control_paths) != 1), None)
    if unpaired is not None:
        found = len(unpaired.control_paths)
        raise DifftuneError(
            f"{key}: {unpaired.path} has {found or 'no'} {control}{'s' if found > 1 else ''}; {trains} trains pairs: "
            "put one same-stem image in the `control` folder beside it (or data.control_path, or its metadata line's "
            "control_files)"
        )


def control_sizes(
    examples: list[Example], sizes: list[Size], rule: Callable[[Size, Size], Size]
) -> list[tuple[Size, ...]]:
    """Each example's controls' training sizes: `rule(target's training size, control's own size)`, the family's
    (`Family.control_size`). Reads each control's header once."""
    originals = {path: image_size(path) for path in {c for example in examples for c in example.control_paths}}
    return [
        tuple(rule(size, originals[c]) for c in example.control_paths)
        for example, size in zip(examples, sizes, strict=True)
    ]


def batch_groups(
    sizes: list[Size],
    controls: list[tuple[Size, ...]],
    buckets: bool,
    frame_counts: list[int] | None = None,
    frame_rates: list[float] | None = None,
) -> list | None:
    """What a batch must share (`TrainingOrder`'s buckets): with buckets (or datasets of several resolutions), the
    training size; with controls, also the count and sizes of the controls (their tensors stack); where clips of
    several lengths (or clips and images: 0 frames) train, also the frame count (frame-count buckets); where clips
    train with their sound (`frame_rates` given) at several frame rates, also the rate (a window's sound is as long as
    its frames last, and the transformer places a batch's video at one rate); None: any samples batch together."""
    if any(controls):
        return list(zip(sizes, controls, strict=True))
    if frame_rates and len(set(frame_rates)) > 1:
        frame_counts = list(zip(frame_counts or [0] * len(sizes), frame_rates, strict=True))
    if frame_counts and len(set(frame_counts)) > 1:
        return list(zip(sizes, frame_counts, strict=True))
    return sizes if buckets or len(set(sizes)) > 1 else None


def frame_counts(examples: list[Example]) -> list[int]:
    """Each example's frame count (`batch_groups`): its window's, or 0 for an image (whose tensors have no time
    axis)."""
    return [example.frames[1] if example.frames else 0 for example in examples]


def frame_rates(examples: list[Example]) -> list[float]:
    """Each example's frame rate (`batch_groups`, `fill_latents`): its clip's, from the container's header; 0 for an
    image."""
    clips = sorted({example.path for example in examples if example.frames})
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        rates = dict(zip(clips, pool.map(frame_rate, clips), strict=True))
    return [rates[example.path] if example.frames else 0.0 for example in examples]


def place_like(crop: Crop, size: Size, control_original: Size, control_size: Size, mode: str) -> Crop:
    """A control's crop at the place its target's `crop` (at training `size`) takes: the same fractions of the spare
    width and height, so that a pair stays aligned under random crops; centered for center crops."""
    centered = place_crop(control_original, control_size, "center")
    if mode == "center":
        return centered

    def at(offset: int, spare: int, control_spare: int) -> int:
        return round(control_spare * offset / spare) if spare else control_spare // 2

    return Crop(
        centered.scaled,
        at(crop.left, crop.scaled[0] - size[0], centered.scaled[0] - control_size[0]),
        at(crop.top, crop.scaled[1] - size[1], centered.scaled[1] - control_size[1]),
    )


class View(NamedTuple):
    """One sample's pixels as training sees them."""

    pixels: torch.Tensor  # (3, H, W) in [-1, 1]; a clip's (3, T, H, W)
    geometry: torch.Tensor  # (6,): `image_geometry`
    mask: torch.Tensor | None  # (1, H, W) with `data.masks`, else None
    controls: list[torch.Tensor]  # each control (3, h, w), cut and flipped as the image was
    flipped: bool


def load_image(
    path: Path,
    config: DataConfig,
    rng: random.Random,
    size: Size | None = None,
    controls: Sequence[tuple[Path, Size]] = (),
) -> View:
    """Decode, resize, crop to `size` (default: the square resolution), maybe flip; with `data.masks` the mask cut
    the same way (`mask_view`); `controls` ((file, training size) pairs) cut at the same place (`place_like`) and
    flipped with it. The controls draw nothing from `rng`: a run's other draws are the same with or without them."""
    size = size or (config.resolution, config.resolution)
    source = open_image(path, config)
    crop = place_crop(source.size, size, config.crop, rng)
    image = cut(source, crop, size)
    flipped = draw_flip(config, rng)
    if flipped:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    mask = mask_view(open_mask(path, config, source.size), crop, size, flipped) if config.masks != "off" else None
    return View(
        image_to_tensor(image, config.keep_alpha),
        image_geometry(source.size, crop, size, flipped),
        mask,
        [
            image_to_tensor(load_control(control, config, control_size, crop, size, flipped), config.keep_alpha)
            for control, control_size in controls
        ],
        flipped,
    )


def load_clip(path: Path, window: tuple[int, int], config: DataConfig, rng: random.Random, size: Size) -> View:
    """A clip's window of frames as `load_image` loads an image: every frame resized and cut at one place (drawn from
    the first frame's size) and flipped together. Clips train whole (masks are images'), with no controls."""
    frames = read_frames(path, *window)
    crop = place_crop(frames[0].size, size, config.crop, rng)
    flipped = draw_flip(config, rng)
    return View(
        clip_to_tensor(frames, crop, size, flipped),
        image_geometry(frames[0].size, crop, size, flipped),
        None,
        [],
        flipped,
    )


def load_sound(path: Path, window: tuple[int, int], rate: int) -> View:
    """A sound's window as `load_image` loads an image: its waveform (2, 1, samples), never cut or flipped."""
    return View(read_window(path, window, rate), window_geometry(window), None, [], False)


def clip_to_tensor(frames: list[Image.Image], crop: Crop, size: Size, flipped: bool) -> torch.Tensor:
    """A clip's frames cut at `crop` to `size` (and mirrored) -> (3, T, H, W) in [-1, 1]."""
    cuts = [cut(frame, crop, size) for frame in frames]
    return torch.stack(
        [image_to_tensor(c.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flipped else c) for c in cuts], dim=1
    )


def load_control(
    path: Path, config: DataConfig, control_size: Size, crop: Crop, size: Size, flipped: bool
) -> Image.Image:
    """A control image at `control_size`, cut where its target's `crop` (at `size`) was and flipped with it."""
    source = open_image(path, config)
    image = cut(source, place_like(crop, size, source.size, control_size, config.crop), control_size)
    return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flipped else image


class Prompt(NamedTuple):
    """What a sample's text conditioning depends on (a text-cache entry's key): its caption and, where the base's text
    encoder reads an edit pair's controls (`Family.prompts_see_controls`), those controls (file, training size) and
    whether the pair was flipped."""

    caption: str
    controls: tuple[tuple[Path, Size], ...] = ()
    flipped: bool = False


def prompt_of(
    example: Example, control_sizes: tuple[Size, ...], caption: str, flipped: bool, sees_controls: bool
) -> Prompt:
    """The `Prompt` of a draw of `example` (its controls' training sizes `control_sizes`)."""
    if not (sees_controls and example.control_paths):
        return Prompt(caption)
    return Prompt(caption, tuple(zip(example.control_paths, control_sizes, strict=True)), flipped)


def prompt_controls(prompt: Prompt, config: DataConfig) -> list[Image.Image]:
    """The controls as the text encoder sees them: each at its training size, cut at the center (whatever
    `data.crop`: the text encoder sees the whole picture, so its states can be cached) and flipped with the pair."""
    images = [resize_and_crop(open_image(path, config), size, "center") for path, size in prompt.controls]
    return [image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) for image in images] if prompt.flipped else images


def possible_prompts(
    examples: list[Example],
    control_sizes: list[tuple[Size, ...]],
    config: DataConfig,
    train_seed: int,
    sees_controls: bool,
) -> set[Prompt]:
    """Every `Prompt` training can draw (what the text cache holds): each example's possible captions (as its dataset
    draws them), with its controls in each view where the text encoder sees them."""
    datasets = config.each_dataset()
    drawers = [CaptionDrawer(data, train_seed) for data in datasets]
    return {
        prompt_of(example, sizes, caption, flipped, sees_controls)
        for example, sizes in zip(examples, control_sizes, strict=True)
        for caption in drawers[example.dataset].possible({example.caption})
        for flipped in ((False, True) if datasets[example.dataset].random_flip and sees_controls else (False,))
    }


def image_to_tensor(image: Image.Image, alpha: bool = False) -> torch.Tensor:
    """PIL RGB image -> (3, H, W) float in [-1, 1]; with `alpha` (`data.keep_alpha`) RGBA -> (4, H, W)."""
    array = np.asarray(image.convert("RGBA" if alpha else "RGB"), dtype=np.float32)
    return torch.from_numpy(array).permute(2, 0, 1) / 127.5 - 1.0


def vary_caption(caption: str, config: DataConfig, rng: random.Random) -> str:
    """One draw of a caption's tags: the first `keep_tokens` in place, each later one left out with probability
    `tag_dropout`, the rest shuffled with `shuffle_tags`; rejoined with the separator (and a space after a comma)."""
    tags = [tag.strip() for tag in caption.split(config.tag_separator) if tag.strip()]
    kept, rest = tags[: config.keep_tokens], tags[config.keep_tokens :]
    if config.tag_dropout:
        rest = [tag for tag in rest if rng.random() >= config.tag_dropout]
    if config.shuffle_tags:
        rng.shuffle(rest)
    joiner = config.tag_separator + " " if config.tag_separator.strip() else config.tag_separator
    return joiner.join(kept + rest)


class CaptionDrawer:
    """What a caption becomes each time a sample is drawn, from the sample's own generator: empty (caption dropout),
    or dressed in `caption_prefix`/`caption_suffix` after its tags are varied. With `caption_variants` the varied
    forms are a fixed set per caption (seeded by the train seed and the caption's text), which `possible` lists for
    the text cache; without it each draw varies afresh."""

    def __init__(self, config: DataConfig, train_seed: int):
        self.config = config
        self.train_seed = train_seed
        self._variants: dict[str, list[str]] = {}

    def dress(self, caption: str) -> str:
        return self.config.caption_prefix + caption + self.config.caption_suffix

    def variants(self, caption: str) -> list[str]:
        if caption not in self._variants:
            text_id = int(hashlib.sha256(caption.encode()).hexdigest()[:15], 16)
            self._variants[caption] = [
                self.dress(
                    vary_caption(
                        caption, self.config, random.Random(derive_seed(CAPTION_STREAM, self.train_seed, text_id, k))
                    )
                )
                for k in range(self.config.caption_variants)
            ]
        return self._variants[caption]

    def draw(self, caption: str, rng: random.Random) -> str:
        # The dropout draw comes first, as it did before captions varied: runs without tag options are unchanged.
        if rng.random() < self.config.caption_dropout:
            return ""
        if not self.config.varies_captions:
            return self.dress(caption)
        if self.config.caption_variants:
            return self.variants(caption)[rng.randrange(self.config.caption_variants)]
        return self.dress(vary_caption(caption, self.config, rng))

    def possible(self, captions: set[str]) -> set[str]:
        """Every text `draw` can give for these captions (`caption_variants` or no varying: a finite set)."""
        if self.config.varies_captions:
            drawn = {variant for caption in captions for variant in self.variants(caption)}
        else:
            drawn = {self.dress(caption) for caption in captions}
        return drawn | {""}


class CaptionedImages(Dataset):
    """Indexed by (epoch, index) keys from `TrainingOrder`; returns one sample with its seed, its geometry
    (`image_geometry`, what SDXL's size and crop conditioning reads) and, with `data.masks`, its loss mask.

    An edit pair's controls come as pixels (`control_pixels`), or with the cache as their posteriors' means
    (`control_latents`; pixels still where `control_entries` is None: a ControlNet reads them so), each a list with
    one (C, ...) tensor per control.
    With `latent_entries` (each example's cache file per view) it returns the cached posterior instead of pixels,
    and with `text_entries` (`Prompt` -> cache file) the cached text conditioning instead of token ids
    (`tokenize`: captions [and their controls] -> token ids per text encoder, the family's; `uncached_conditioning`: a
    stored entry as the family's encoder made it; `sees_controls`: the family's `prompts_see_controls`, whose token
    inputs hold the controls as `prompt_controls` shows them). The per-sample random draws happen in
    the same order either way, so cached and uncached runs match.
    Cache entries read once stay in RAM up to `memory_bytes`, and each caption is tokenized once: on a small
    model those reads and tokenizer calls were 13% of a training step (measured on the tiny base).
    """

    def __init__(
        self,
        examples: list[Example],
        config: DataConfig,
        tokenize: Callable[[list[str]], dict[str, torch.Tensor]],
        train_seed: int,
        latent_entries: list[dict[str, Path]] | None = None,
        text_entries: dict[str, Path] | None = None,
        sizes: list[tuple[int, int]] | None = None,  # `training_sizes`, when the caller has them already
        memory_bytes: int = 0,
        uncached_conditioning: Callable[[dict], dict] | None = None,  # the family's: a text entry as encoded
        control_sizes: list[tuple[Size, ...]]
        | None = None,  # each example's controls' training sizes (`control_sizes`)
        # with `latent_entries`: each control's cache files (None: controls read as pixels)
        control_entries: list[list[dict[str, Path]]] | None = None,
        sees_controls: bool = False,
    ):
        self.examples = examples
        self.config = config  # the run-wide settings; each example is read with its dataset's (`datasets`)
        self.datasets = config.each_dataset()
        self.tokenize = tokenize
        self.train_seed = train_seed
        self.latent_entries = latent_entries
        self.text_entries = text_entries
        self.uncached_conditioning = uncached_conditioning
        self.sizes = sizes if sizes is not None else training_sizes(examples, config)
        self.control_sizes = control_sizes or [()] * len(examples)
        self.control_entries = control_entries
        self.sees_controls = sees_controls
        self.captions = [CaptionDrawer(data, train_seed) for data in self.datasets]
        self._memory_left = memory_bytes
        self._in_memory: dict[Path, dict[str, torch.Tensor]] = {}
        self._token_ids: dict[str, dict[str, torch.Tensor]] = {}
        self._original_sizes: dict[Path, tuple[int, int]] = {}
        self._masks: dict[tuple, torch.Tensor] = {}  # cached views' masks, cut once

    def _read(self, entry: Path) -> dict[str, torch.Tensor]:
        """A cache entry's tensors, from RAM when read before and the budget allowed keeping them."""
        tensors = self._in_memory.get(entry)
        if tensors is None:
            tensors = read_tensors(entry)
            size = sum(t.nbytes for t in tensors.values())
            if size <= self._memory_left:
                self._in_memory[entry] = tensors
                self._memory_left -= size
        return tensors

    def _token_ids_of(self, prompt: Prompt) -> dict[str, torch.Tensor]:
        if prompt.controls:  # a control's patches are large and its views many: tokenized each time
            return {
                name: ids[0]
                for name, ids in self.tokenize([prompt.caption], [prompt_controls(prompt, self.config)]).items()
            }
        if prompt.caption not in self._token_ids:
            self._token_ids[prompt.caption] = {
                name: ids[0] for name, ids in self.tokenize([prompt.caption]).items()
            }  # (L,) each
        return self._token_ids[prompt.caption]

    def _cached_geometry(self, path: Path, size: tuple[int, int], flipped: bool) -> torch.Tensor:
        """A cached view's geometry: cached images are center-cropped, so the header's size says it all."""
        original = self._original_size(path)
        return image_geometry(original, place_crop(original, size, "center"), size, flipped)

    def _original_size(self, path: Path) -> tuple[int, int]:
        if path not in self._original_sizes:
            self._original_sizes[path] = image_size(path)
        return self._original_sizes[path]

    def _cached_mask(self, path: Path, data: DataConfig, size: tuple[int, int], flipped: bool) -> torch.Tensor:
        """A cached view's mask (its dataset's `data`), center-cropped as the view was; decoded once per view (as
        uint8: a quarter of the floats' memory)."""
        key = (path, data.masks, data.mask_path, size, flipped)
        if key not in self._masks:
            mask = centered_view_mask(path, data, size, flipped, self._original_size(path))
            self._masks[key] = (mask * 255).round().to(torch.uint8)
        return self._masks[key].float() / 255

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        epoch, index = key
        example = self.examples[index]
        data = self.datasets[example.dataset]
        seed = sample_seed(self.train_seed, epoch, index)
        rng = random.Random(seed)
        item = {"seed": seed, "epoch": epoch, "path": str(example.path), "loss_weight": example.loss_weight}
        if self.latent_entries:
            # Cached images were center-cropped: the only image draw left is the flip, as in load_image (a sound's:
            # none, as in load_sound).
            flipped = not example.sound_rate and draw_flip(data, rng)
            posterior = self._read(self.latent_entries[index]["flipped" if flipped else "plain"])
            item["latent_mean"], item["latent_std"] = posterior["mean"], posterior["std"]  # (C, [t,] h, w)
            from_pixels = {name: value for name, value in posterior.items() if name not in ("mean", "std")}
            if from_pixels:  # the family's `pixel_conditioning`, made with it
                item["pixel_conditioning"] = from_pixels
            item["geometry"] = (
                window_geometry(example.frames)
                if example.sound_rate
                else self._cached_geometry(example.path, self.sizes[index], flipped)
            )  # (6,)
            if data.masks != "off" and example.frames is None:
                item["mask"] = self._cached_mask(example.path, data, self.sizes[index], flipped)  # (1, H, W)
            if example.control_paths and self.control_entries is not None:
                # their posteriors' means: edit bases read a control's mode, never a draw
                item["control_latents"] = [
                    self._read(views["flipped" if flipped else "plain"])["mean"]
                    for views in self.control_entries[index]
                ]
            elif example.control_paths:  # read as pixels (a ControlNet's): cut where the cached view was
                size = self.sizes[index]
                crop = place_crop(self._original_size(example.path), size, "center")
                item["control_pixels"] = [
                    image_to_tensor(load_control(control, data, control_size, crop, size, flipped), data.keep_alpha)
                    for control, control_size in zip(example.control_paths, self.control_sizes[index], strict=True)
                ]
        else:
            view = (
                load_sound(example.path, example.frames, example.sound_rate)
                if example.sound_rate
                else load_clip(example.path, example.frames, data, rng, self.sizes[index])
                if example.frames
                else load_image(
                    example.path,
                    data,
                    rng,
                    self.sizes[index],
                    list(zip(example.control_paths, self.control_sizes[index], strict=True)),
                )
            )
            item["pixel_values"], item["geometry"], flipped = view.pixels, view.geometry, view.flipped  # (3, [T,] H, W)
            if view.mask is not None:
                item["mask"] = view.mask
            if view.controls:
                item["control_pixels"] = view.controls  # each (3, h, w)
        caption = self.captions[example.dataset].draw(example.caption, rng)
        prompt = prompt_of(example, self.control_sizes[index], caption, flipped, self.sees_controls)
        if self.text_entries:
            stored = self._read(self.text_entries[prompt])  # name -> (L, D) or (P,)
            item["conditioning"] = self.uncached_conditioning(stored) if self.uncached_conditioning else stored
        else:
            item["token_ids"] = self._token_ids_of(prompt)  # text encoder -> (L,), and an edit's patches
        return item


class TrainingOrder(Sampler):
    """An endless stream of (epoch, index) keys, reshuffled each epoch, cut into this process's batches.

    Without buckets, global micro-batch g covers stream positions [g * B * P, (g + 1) * B * P) for batch
    size B and P processes; process r takes its r-th slice. Epochs run on without a gap, so no sample is
    dropped. With buckets (a bucket id per example), each epoch shuffles every bucket, cuts it into global
    batches (the last one filled by wrapping round that bucket), and shuffles the batches: no batch mixes
    buckets. Either way the order is a function of the seed, and the batch number alone says where a run is.
    """

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        start_batch: int = 0,
        buckets: list | None = None,
    ):
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.start_batch = start_batch
        self.buckets = buckets

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(derive_seed(ORDER_STREAM, self.seed, epoch))
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    def _bucket_batches(self, epoch: int) -> list[list[int]]:
        """One epoch's global batches, each from a single bucket."""
        global_batch = self.batch_size * self.world_size
        generator = torch.Generator().manual_seed(derive_seed(ORDER_STREAM, self.seed, epoch))
        members: dict = {}
        for index, bucket in enumerate(self.buckets):
            members.setdefault(bucket, []).append(index)
        batches = []
        for bucket in sorted(members):
            indices = [members[bucket][i] for i in torch.randperm(len(members[bucket]), generator=generator).tolist()]
            count = -(-len(indices) // global_batch)
            padded = [indices[i % len(indices)] for i in range(count * global_batch)]
            batches += [padded[b * global_batch : (b + 1) * global_batch] for b in range(count)]
        return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        if self.buckets is not None:
            yield from self._iter_buckets()
            return
        global_batch = self.batch_size * self.world_size
        position = self.start_batch * global_batch + self.rank * self.batch_size
        epoch, order = -1, []
        while True:
            batch = []
            for p in range(position, position + self.batch_size):
                if p // self.dataset_size != epoch:
                    epoch = p // self.dataset_size
                    order = self._permutation(epoch)
                batch.append((epoch, order[p % self.dataset_size]))
            yield batch
            position += global_batch

    def _iter_buckets(self) -> Iterator[list[tuple[int, int]]]:
        batches_per_epoch = len(self._bucket_batches(0))  # the same every epoch: it depends on bucket sizes only
        number = self.start_batch
        epoch, batches = -1, []
        while True:
            if number // batches_per_epoch != epoch:
                epoch = number // batches_per_epoch
                batches = self._bucket_batches(epoch)
            chunk = batches[number % batches_per_epoch][self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
            yield [(epoch, index) for index in chunk]
            number += 1


def build_dataloader(dataset: CaptionedImages, order: TrainingOrder, num_workers: int, pin_memory: bool) -> DataLoader:
    return DataLoader(
        dataset,
        batch_sampler=order,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        # Its own generator: a DataLoader draws its workers' base seed when iterated, and from the global RNG
        # that would shift adapter dropout after a resume. Samples never use it (they carry their own seeds).
        generator=torch.Generator().manual_seed(order.seed),
    )
