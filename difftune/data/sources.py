"""Where `data.path` (or `validation.path`) points, as one type the code that reads it asks (`data_source`): a
`FolderOfFiles`, or `StoredRecords`: webdataset tar shards, parquet files (Hugging Face datasets on the hub among
them) and datasets saved by the `datasets` library, each on local disk or on object storage. The type says whether
the path must be a folder before a run starts, whether its scan is costly enough to keep (and so done by one process
a machine), and whether it may hold clips; dataset.py lists its examples, once per type.

- **Tar shards** (`.tar`): members grouped into records by key, as webdataset writes them: `0001.jpg`, `0001.txt`
  (and `0001.json`) are one record, its key the member's path up to the first dot of its name. Its caption is the
  `data.caption_extension` member, else a `.json` member's `text` or `caption`.
- **Parquet** (`.parquet`): a row per record, its image in `data.image_column` (bytes, or the `{bytes, path}` of
  the `datasets` library's Image feature) and its caption in `data.caption_column`. A dataset on the Hugging Face
  hub is parquet files: `hf://datasets/<owner>/<name>/data/train-*.parquet`.
- **A `datasets` folder** (`Dataset.save_to_disk`), read with `datasets.load_from_disk`, the library that wrote it:
  Arrow files it maps from disk, whatever its features' layout.

`data.missing_caption` decides for a record without a caption. Storage goes through fsspec, so `data.path` can be
`s3://`, `gs://`, `hf://` or any URL fsspec reads (credentials and endpoints as its filesystems take them: for S3 and
S3-compatible stores, the AWS environment variables, e.g. `AWS_ENDPOINT_URL_S3`).

Training needs random access, not a stream: the global sample order (data.TrainingOrder) is one permutation over
every record of every file, the same in every process and after a resume. So each record is a `Stored` locator that
stands where a file's Path stands in dataset.py: a tar member is read by its byte range (one ranged GET on object
storage), a parquet row from its row group. webdataset's and `datasets`' streaming readers go through files in order
with a shuffle buffer, whose position a resume cannot restore exactly; they are not used.

Each file is read once from start to end at the scan, which lists its records, hashes each one's media (the latent
cache's key, so cached runs never read them again) and reads the captions.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import io
import json
import re
import tarfile
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from itertools import chain
from pathlib import Path, PurePosixPath
from typing import ClassVar

import fsspec
from tqdm.auto import tqdm

from difftune.errors import DifftuneError
from difftune.files import is_url

SHARD_SUFFIX, PARQUET_SUFFIX = ".tar", ".parquet"
DATASET_FILES = ("state.json", "dataset_info.json")  # what Dataset.save_to_disk writes beside its Arrow files
IMAGE_COLUMNS = ("image", "img", "jpg", "png", "webp")  # what `data.image_column = ""` looks for, in order
CAPTION_COLUMNS = ("text", "caption", "txt", "prompt")
CLIP_SUFFIXES = (".mp4", ".mov", ".mkv", ".webm", ".avi")
SOUND_SUFFIXES = (".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a")  # what a sound base (ACE-Step) trains on
IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
REPEATS_FOLDER = re.compile(r"^(\d+)_(.+)$")  # an `N_name` subfolder: its images listed N times


def is_clip(path: Path) -> bool:
    return path.suffix.lower() in CLIP_SUFFIXES


def is_sound(path: Path) -> bool:
    return path.suffix.lower() in SOUND_SUFFIXES


def is_timed(path: Path) -> bool:
    """A file cut into windows of time: a clip, or a sound."""
    return is_clip(path) or is_sound(path)


@dataclass(frozen=True)
class DataSource:
    path: str
    scan_is_kept: ClassVar[bool]  # its scan reads every record, so it is kept in an index: one process scans

    def check_present(self, key: str, holding: str) -> None:
        """Before anything loads: refuse a path that cannot be this source, naming `key` and what it should hold."""

    def may_hold_clips(self) -> bool:
        raise NotImplementedError


class FolderOfFiles(DataSource):
    """A local folder of images or clips with their captions (and `N_name` subfolders): listed in a moment."""

    scan_is_kept = False

    def check_present(self, key: str, holding: str) -> None:
        if not Path(self.path).is_dir():
            what = "does not exist" if not Path(self.path).exists() else "is a file"
            raise DifftuneError(f"{key} {self.path}: {what}; point it at a folder of {holding}")

    def check_holds_media(self, key: str) -> None:
        """Refuse a folder with no image or clip in it or under it, before anything loads (the scan, after the base
        has loaded, says the same of a folder whose files it cannot use); stops at the first one found."""
        suffixes = IMAGE_EXTENSIONS | set(CLIP_SUFFIXES) | set(SOUND_SUFFIXES)
        if not any(path.suffix.lower() in suffixes for path in Path(self.path).rglob("*")):
            raise DifftuneError(no_media(key, self.path))

    def may_hold_clips(self) -> bool:
        return any(is_clip(path) for path in Path(self.path).rglob("*"))

    def most_examples(self) -> int | None:
        """The most examples the folder can list (each image once, an `N_name` folder's N times: what is unusable only
        lowers it), from the names alone, in milliseconds; None where the names cannot tell (clips, cut into a number
        of windows; a metadata.jsonl, which may name files anywhere)."""
        root, total = Path(self.path), 0
        repeated = [
            (sub, int(match.group(1)))
            for sub in sorted(root.iterdir())
            if (match := REPEATS_FOLDER.match(sub.name)) and sub.is_dir()
        ]
        for folder, times in [(root, 1), *repeated]:
            files = [path for path in folder.iterdir() if path.is_file()]
            if (folder / "metadata.jsonl").is_file() or any(is_timed(path) for path in files):
                return None
            total += times * sum(path.suffix.lower() in IMAGE_EXTENSIONS for path in files)
        return total


class StoredRecords(DataSource):
    """Shards, parquet files or a saved dataset: listed, and a missing one named, as the data is read."""

    scan_is_kept = True

    def may_hold_clips(self) -> bool:
        return True  # known only once every record is read


def no_media(key: str, folder) -> str:
    return (
        f"{key} {folder} holds no images ({', '.join(sorted(IMAGE_EXTENSIONS))}), clips ({', '.join(CLIP_SUFFIXES)})"
        f" or sounds ({', '.join(SOUND_SUFFIXES)}) directly or in `N_name` subfolders"
    )


def data_source(path: str) -> DataSource:
    return StoredRecords(path) if is_stored_source(path) else FolderOfFiles(path)


def is_stored_source(path: str) -> bool:
    """Whether `data.path` names stored records rather than a folder of files: a URL, a `.tar` or `.parquet` file or
    a glob of them, a local folder holding only such files, or a folder `save_to_disk` wrote."""
    if is_url(path) or str(path).endswith((SHARD_SUFFIX, PARQUET_SUFFIX)):
        return True
    folder = Path(path)
    if not folder.is_dir():
        return False
    if all((folder / name).is_file() for name in DATASET_FILES) or (folder / "dataset_dict.json").is_file():
        return True
    # Lazily: an image folder (asked about at each step of start-up) answers at its first image, unlisted.
    entries = (entry for entry in folder.iterdir() if not entry.name.startswith("."))
    first = next(entries, None)
    return first is not None and all(
        entry.suffix in (SHARD_SUFFIX, PARQUET_SUFFIX) for entry in chain([first], entries)
    )


def _filesystem(path: str, key: str):
    try:
        return fsspec.core.url_to_fs(str(path))
    except (ImportError, ValueError) as err:  # fsspec names the package a protocol needs (s3fs, gcsfs...)
        raise DifftuneError(f"{key} {path}: {err}") from None


def source_files(path: str, key: str = "data.path") -> tuple[str, list[str]]:
    """What `path` holds, and its files sorted: ("shards", tars), ("parquet", files) or ("dataset", [the folder]).
    `path` is one file, a glob (`s3://bucket/train-*.tar`), or a folder or prefix holding them."""
    kind, files, _ = _listing(path, key)
    return kind, files


def _listing(path: str, key: str) -> tuple[str, list[str], dict[str, dict]]:
    """`source_files`, and what the store says of each file it reads (size, version: a saved dataset's every file),
    from one listing."""
    fs, root = _filesystem(path, key)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]

    def url(found: str) -> str:
        return found if protocol == "file" else fs.unstrip_protocol(found)

    try:
        if any(char in root for char in "*?["):
            found = fs.glob(root, detail=True)
        elif fs.isdir(root):
            if all(fs.isfile(f"{root.rstrip('/')}/{name}") for name in DATASET_FILES):
                return "dataset", [url(root)], {url(name): info for name, info in fs.find(root, detail=True).items()}
            if fs.isfile(f"{root.rstrip('/')}/dataset_dict.json"):
                raise DifftuneError(
                    f"{key} {path}: a DatasetDict (several splits); point it at one split's folder, "
                    f"e.g. {path.rstrip('/')}/train"
                )
            found = fs.find(root, detail=True)
        elif fs.isfile(root):
            found = {root: fs.info(root)}
        else:
            raise DifftuneError(
                f"{key} {path}: not found; point it at a folder of captioned images, .tar shards, "
                f".parquet files (a file, a glob or a folder of them) or a saved `datasets` folder"
            )
    except (OSError, PermissionError) as err:
        raise DifftuneError(f"{key} {path}: cannot be listed: {err}") from None
    kinds = {
        kind: {url(name): found[name] for name in sorted(found) if name.endswith(suffix)}
        for kind, suffix in (("shards", SHARD_SUFFIX), ("parquet", PARQUET_SUFFIX))
    }
    present = [kind for kind, files in kinds.items() if files]
    if len(present) != 1:
        what = "both .tar shards and .parquet files: keep one kind" if present else "no .tar shards or .parquet files"
        raise DifftuneError(f"{key} {path}: holds {what}")
    return present[0], list(kinds[present[0]]), kinds[present[0]]


def source_identity(path: str, key: str = "data.path") -> list[list[str]]:
    """Each file `path` holds (a saved dataset: every file in its folder), with its size and version (an object
    store's ETag, a file's modification time, a hub file's blob id): what a scan of it depends on, from one listing."""
    identity = []
    for name, info in sorted(_listing(path, key)[2].items()):
        version = next(
            (
                info[field]
                for field in ("ETag", "etag", "blob_id", "mtime", "LastModified", "last_modified")
                if info.get(field) is not None
            ),
            "",
        )
        identity.append([name, str(info.get("size")), str(version)])
    return identity


def stored_fields(item: Stored) -> dict:
    """A locator as JSON, for the scan's index."""
    fields = {name: getattr(item, name) for name in item.__dataclass_fields__}
    return {"kind": type(item).__name__} | fields | {"mask": stored_fields(item.mask) if item.mask else None}


def stored_from_fields(fields: dict) -> Stored:
    kinds = {kind.__name__: kind for kind in (Member, Row, DatasetRow)}
    fields = dict(fields)
    kind = kinds[fields.pop("kind")]
    fields["displayed"] = tuple(fields["displayed"]) if fields.get("displayed") else None
    fields["mask"] = stored_from_fields(fields["mask"]) if fields.get("mask") else None
    return kind(**fields)


@dataclass(frozen=True, order=True)
class Stored:
    """A record's media read from storage, standing where a file's Path stands in dataset.py (`name`, `stem`,
    `suffix`, `open`); messages name it as `file:name`."""

    source: str  # the file (or dataset folder) it is read from
    name: str  # its name there: a tar member's path, or a row's number and its image's suffix
    size: int  # bytes
    digest: str  # SHA-256 of its bytes
    displayed: tuple[int, int] | None = field(default=None, compare=False)  # (width, height), once decoded
    mask: Stored | None = field(default=None, compare=False)  # a shard record's mask member

    @property
    def stem(self) -> str:
        return PurePosixPath(record_key(self.name)[0]).name

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.name).suffix

    def read(self) -> bytes:
        raise NotImplementedError

    def open(self, mode: str = "rb") -> io.BytesIO:
        if mode != "rb":
            raise ValueError(f"{self} is read only")
        return io.BytesIO(self.read())

    def __str__(self) -> str:
        return f"{self.source}:{self.name}"


@dataclass(frozen=True, order=True)
class Member(Stored):
    """A tar shard's member, read by its byte range."""

    offset: int = 0  # where its bytes start in the shard

    def read(self) -> bytes:
        fs, path = fsspec.core.url_to_fs(self.source)
        return fs.cat_file(path, start=self.offset, end=self.offset + self.size)


@dataclass(frozen=True, order=True)
class Row(Stored):
    """A parquet file's row, read from its row group (the least parquet can read; `_RowGroups` keeps those read)."""

    group: int = 0
    index: int = 0  # within the group
    column: str = ""

    def read(self) -> bytes:
        return _image_bytes(_ROW_GROUPS.get(self.source, self.group, self.column)[self.index])


@dataclass(frozen=True, order=True)
class DatasetRow(Stored):
    """A row of a folder `Dataset.save_to_disk` wrote."""

    index: int = 0
    column: str = ""

    def read(self) -> bytes:
        return _image_bytes(_saved_table(self.source).column(self.column)[self.index].as_py())


def _library(name: str):
    """An optional library the source needs, or a message saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise DifftuneError(
            f"reading parquet files and saved datasets needs {name.split('.')[0]}: pip install difftune[datasets]"
        ) from None


class _RowGroups:
    """Parquet row groups read, the least recently used dropped past `budget` bytes. Training draws rows in a shuffled
    order, and a row costs its whole group: with 4 of 10 groups kept, 1000 rows read in a shuffled order took 10x
    their bytes from storage (10 rows a second from moto's S3, docs/benchmarks.md); kept within a budget, a dataset that
    fits it is read once."""

    def __init__(self, budget: int):
        self.budget = budget
        self.groups: OrderedDict[tuple[str, int, str], list] = OrderedDict()
        self.sizes: dict[tuple[str, int, str], int] = {}
        self.lock = threading.Lock()

    def get(self, url: str, group: int, column: str) -> list:
        key = (url, group, column)
        with self.lock:
            if key in self.groups:
                self.groups.move_to_end(key)
                return self.groups[key]
        fs, path = fsspec.core.url_to_fs(url)
        with fs.open(path, "rb") as file:
            table = _library("pyarrow.parquet").ParquetFile(file).read_row_group(group, columns=[column])
        rows = table.column(0).to_pylist()
        with self.lock:
            self.groups[key], self.sizes[key] = rows, table.nbytes
            while sum(self.sizes.values()) > self.budget and len(self.groups) > 1:
                oldest, _ = self.groups.popitem(last=False)
                del self.sizes[oldest]
        return rows


# Per process (each loader worker holds its own): a quarter of a GiB.
_ROW_GROUPS = _RowGroups(budget=256 << 20)


@functools.lru_cache(maxsize=4)
def _saved_table(url: str):
    """A saved dataset's Arrow table (its files mapped from disk by the library that wrote them), undecoded: images
    are their stored bytes, not PIL images."""
    return _library("datasets").load_from_disk(url).data.table


def _image_bytes(value) -> bytes | None:
    """A column's image: bytes, or the datasets library's `{bytes, path}` (a path alone is a file beside it, which a
    saved dataset with embedded images never has)."""
    if isinstance(value, dict):
        value = value.get("bytes")
    return value if isinstance(value, (bytes, bytearray)) and value else None


def readable(path: Path | Stored) -> Path | io.BytesIO:
    """What PIL and PyAV open: a file's path, or a stored record's bytes."""
    return path.open("rb") if isinstance(path, Stored) else path


@dataclass(frozen=True)
class Record:
    """A record's media (an image or clip) and its caption, None where it has none; in a shard, its edit controls."""

    media: Stored
    caption: str | None
    controls: tuple[Stored, ...] = ()


def record_key(name: str) -> tuple[str, str]:
    """A member's (record key, extension): its path up to the first dot of its file name, and the rest (webdataset's
    rule: `a/0001.seg.png` is record `a/0001`'s `seg.png`)."""
    folder, _, file_name = name.rpartition("/")
    key, _, extension = file_name.partition(".")
    return f"{folder}/{key}" if folder else key, extension.lower()


def read_source(
    path: str,
    media_suffixes: set[str],
    caption_extension: str,
    image_column: str,
    caption_column: str,
    key: str = "data.path",
) -> tuple[list[Record], list[tuple[str, str]]]:
    """Every record `path` holds, in file order, and the (where, reason) of those left out; each file read once, in
    threads (reading is I/O, and hashing releases the GIL)."""
    kind, files = source_files(path, key)
    if kind == "shards":
        read = functools.partial(read_shard, media_suffixes=media_suffixes, caption_extension=caption_extension)
    else:
        read = functools.partial(
            read_table, image_column=image_column, caption_column=caption_column, saved=kind == "dataset", key=key
        )
    with ThreadPoolExecutor(max_workers=min(8, len(files))) as pool:
        results = list(tqdm(pool.map(read, files), total=len(files), desc=f"reading {kind}", disable=len(files) < 4))
    return [record for records, _ in results for record in records], [item for _, bad in results for item in bad]


def read_shard(
    url: str, media_suffixes: set[str], caption_extension: str
) -> tuple[list[Record], list[tuple[str, str]]]:
    """A shard's records, reading it once from start to end, and the (`shard:key`, reason) of those left out: a
    record without media or with two, or a caption that is not UTF-8; a shard that ends early keeps the records
    before the damage. Media bytes are hashed as they pass, never held: a shard can be larger than memory."""
    fs, path = fsspec.core.url_to_fs(url)
    caption_kind = caption_extension.lstrip(".").lower()
    groups: dict[str, dict[str, Member | bytes | None]] = {}  # key -> extension -> media, a caption's bytes, or None
    bad: list[tuple[str, str]] = []
    key = None
    try:
        with fs.open(path, "rb") as file, tarfile.open(fileobj=file, mode="r|") as tar:
            for info in tar:
                if not info.isfile() or PurePosixPath(info.name).name.startswith("."):  # macOS's `._name` forks
                    continue
                key, extension = record_key(info.name)
                if f".{extension.rsplit('.', 1)[-1]}" in media_suffixes:
                    digest = hashlib.sha256()
                    stream = tar.extractfile(info)
                    while piece := stream.read(1 << 24):
                        digest.update(piece)
                    found: Member | bytes | None = Member(
                        url, info.name, info.size, digest.hexdigest(), offset=info.offset_data
                    )
                else:  # only what can caption it is kept (other members, say .npy, can be large)
                    found = tar.extractfile(info).read() if extension in (caption_kind, "json") else None
                groups.setdefault(key, {})[extension] = found
    except (tarfile.TarError, OSError, EOFError) as err:
        groups.pop(key, None)  # the record being read when the shard broke off may have lost members
        bad.append(
            (
                url,
                f"the shard cannot be read past its first {len(groups)} "
                f"records ({type(err).__name__}: {err}); those train",
            )
        )
    records = []
    for key, members in groups.items():
        try:
            records.append(_record(members, caption_kind))
        except ValueError as err:
            bad.append((f"{url}:{key}", str(err)))
    return records, bad


CONTROL_MEMBER = re.compile(r"^control(?:_(\d+))?\.")  # `control.png`, or numbered `control_0.png`, `control_1.png`...


def _record(members: dict[str, Member | bytes | None], caption_kind: str) -> Record:
    """A shard record from its members by extension: one image or clip, a `mask.*` member (`data.masks = "record"`),
    edit controls (`control.*`, or `control_0.*`, `control_1.*`... in the order the base reads them) and a caption.
    Raises ValueError saying what is wrong with it."""
    found = {extension: member for extension, member in members.items() if isinstance(member, Member)}
    masks = [member for extension, member in found.items() if extension.startswith("mask.")]
    numbered = sorted(
        (int(match.group(1) or 0), member)
        for extension, member in found.items()
        if (match := CONTROL_MEMBER.match(extension))
    )
    media = [
        member
        for extension, member in found.items()
        if not extension.startswith("mask.") and not CONTROL_MEMBER.match(extension)
    ]
    if len(media) != 1:
        what = "no image or clip" if not media else "more than one image or clip"
        raise ValueError(f"has {what} (members: {', '.join(sorted(members))})")
    if len(masks) > 1 or [number for number, _ in numbered] != list(range(len(numbered))):
        raise ValueError(
            f"its masks or controls ({', '.join(sorted(members))}) must be one `mask.*` member and one "
            f"`control.*` member or members numbered control_0, control_1... without gaps"
        )
    return Record(
        replace(media[0], mask=masks[0] if masks else None),
        _caption(members, caption_kind),
        tuple(member for _, member in numbered),
    )


def _caption(members: dict[str, Member | bytes | None], caption_kind: str) -> str | None:
    """The record's caption: its caption member's text, else its `.json` member's `text` or `caption`."""
    if caption_kind in members:
        try:
            return members[caption_kind].decode("utf-8-sig").strip()
        except UnicodeDecodeError as err:
            raise ValueError(f"caption is not UTF-8 ({err.reason} at byte {err.start}); write it as UTF-8") from None
    if "json" in members:
        try:
            fields = json.loads(members["json"])
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"its .json member is not JSON ({err})") from None
        for name in ("text", "caption"):
            if isinstance(fields, dict) and isinstance(fields.get(name), str):
                return fields[name].strip()
    return None


def read_table(
    url: str, image_column: str, caption_column: str, saved: bool, key: str
) -> tuple[list[Record], list[tuple[str, str]]]:
    """A parquet file's records (`saved`: a `Dataset.save_to_disk` folder's), row by row; a row without image bytes
    is reported as `file:row N`."""
    with ExitStack() as opened:
        if saved:
            table = _saved_table(url)
            names, groups = table.column_names, None
        else:
            fs, path = fsspec.core.url_to_fs(url)
            parquet = _library("pyarrow.parquet").ParquetFile(opened.enter_context(fs.open(path, "rb")))
            names, groups = parquet.schema_arrow.names, range(parquet.num_row_groups)
        image = _column(url, names, image_column, IMAGE_COLUMNS, "data.image_column", key)
        caption = _column(url, names, caption_column, CAPTION_COLUMNS, "data.caption_column", key)
        columns = [image, caption] if caption else [image]
        parts = (
            [(0, table.select(columns))] if saved else ((g, parquet.read_row_group(g, columns=columns)) for g in groups)
        )
        return _table_records(url, parts, image, caption, saved)


def _table_records(
    url: str, parts, image: str, caption: str | None, saved: bool
) -> tuple[list[Record], list[tuple[str, str]]]:
    """The records of a table's parts ((row group, its rows) in order; a saved dataset is one part)."""
    records, bad, row = [], [], 0
    for group, part in parts:
        captions = part.column(caption).to_pylist() if caption else [None] * part.num_rows
        for index, (value, text) in enumerate(zip(part.column(image).to_pylist(), captions, strict=True)):
            data = _image_bytes(value)
            if data is None:
                bad.append((f"{url}:row {row}", f"no image bytes in column {image!r}"))
            else:
                common = (url, f"{row}{_suffix(value, data)}", len(data), hashlib.sha256(data).hexdigest())
                media = (
                    DatasetRow(*common, index=row, column=image)
                    if saved
                    else Row(*common, group=group, index=index, column=image)
                )
                records.append(Record(media, text.strip() if isinstance(text, str) else None))
            row += 1
    return records, bad


def _column(url: str, names: list[str], asked: str, usual: tuple[str, ...], setting: str, key: str) -> str | None:
    """The column `setting` names, else the first usual one present; an image column is needed, a caption one not."""
    if asked and asked not in names:
        raise DifftuneError(f"{key} {url}: {setting} = {asked!r} is not one of its columns ({', '.join(names)})")
    found = asked or next((name for name in usual if name in names), None)
    if found is None and setting == "data.image_column":
        raise DifftuneError(
            f"{key} {url}: no image column ({', '.join(usual)}) among {', '.join(names)}; set {setting}"
        )
    return found


def _suffix(value, data: bytes) -> str:
    """The image's suffix: its stored path's, else its format's (PIL reads the header)."""
    stored = value.get("path") if isinstance(value, dict) else None
    if stored and PurePosixPath(stored).suffix:
        return PurePosixPath(stored).suffix.lower()
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            return {"JPEG": ".jpg", "TIFF": ".tif"}.get(image.format, f".{image.format.lower()}")
    except Exception:  # not an image: the scan's decode names it
        return ".bin"
