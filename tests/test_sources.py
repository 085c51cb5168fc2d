"""Training data from webdataset tar shards: on disk, and on a real S3-compatible server (moto's, on loopback)."""

import io
import json
import os
import sys
import tarfile
from pathlib import Path

import fsspec
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from difftune.config import DataConfig
from difftune.data.clips import FrameWindows
from difftune.data.dataset import CaptionedImages, scan_examples, training_sizes
from difftune.data.sources import Member
from difftune.errors import DifftuneError
from difftune.toy.tiny import moving_shape_clips, write_clip_folder
from difftune.training.metrics import read_metrics
from difftune.training.train import train

from conftest import REPO, run_whole_killed_and_resumed


def write_shards(folder: Path, out: Path, per_shard: int) -> Path:
    """The folder's captioned files as tar shards of `per_shard` records, in the folder's sorted order."""
    out.mkdir(parents=True)
    media = sorted(path for path in folder.iterdir() if path.suffix != ".txt")
    for number, start in enumerate(range(0, len(media), per_shard)):
        with tarfile.open(out / f"train-{number:04d}.tar", "w") as tar:
            for path in media[start : start + per_shard]:
                tar.add(path, arcname=path.name)
                tar.add(path.with_suffix(".txt"), arcname=path.with_suffix(".txt").name)
    return out


def folder_records(folder: Path) -> list[tuple[bytes, str, str]]:
    """The folder's captioned images as (bytes, file name, caption), in its sorted order."""
    images = sorted(path for path in folder.iterdir() if path.suffix != ".txt")
    return [(path.read_bytes(), path.name, path.with_suffix(".txt").read_text()) for path in images]


def write_parquet(folder: Path, out: Path, rows_per_group: int) -> Path:
    """The folder's captioned images as one parquet file: a plain bytes column `jpg` and a `caption` column (the
    img2dataset kind of table), in row groups of `rows_per_group`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = folder_records(folder)
    table = pa.table({"jpg": [data for data, _, _ in records], "caption": [caption for _, _, caption in records]})
    out.mkdir(parents=True)
    pq.write_table(table, out / "train-0000.parquet", row_group_size=rows_per_group)
    return out / "train-0000.parquet"


def save_dataset(folder: Path, out: Path) -> Path:
    """The folder's captioned images as a `datasets` Dataset (an Image feature and a `text` column), saved to disk."""
    import datasets

    records = folder_records(folder)
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    rows = {
        "image": [{"bytes": data, "path": name} for data, name, _ in records],
        "text": [text for _, _, text in records],
    }
    datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(out))
    return out


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def png(color, size=(32, 32)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def _losses(output_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(output_dir)}


def _same_adapters(a: Path, b: Path) -> bool:
    first, second = (load_file(path / "pytorch_lora_weights.safetensors") for path in (a, b))
    return first.keys() == second.keys() and all(torch.equal(first[key], second[key]) for key in first)


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on loopback, and the AWS environment pointing at it (what a user of an S3-compatible store
    sets); yields a filesystem on it."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    settings = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_S3": f"http://{host}:{port}",
    }
    before = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir("shards")
    yield fs
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    server.stop()


def test_shards_train_exactly_as_their_folder(make_config, shapes, tmp_path):
    shards = write_shards(shapes, tmp_path / "shards", per_shard=3)
    train(make_config(train__output_dir=str(tmp_path / "folder")))
    train(
        make_config(
            data__path=str(shards), train__output_dir=str(tmp_path / "sharded"), cache__dir=str(tmp_path / "cache")
        )
    )
    assert _losses(tmp_path / "sharded") == _losses(tmp_path / "folder")
    assert _same_adapters(tmp_path / "sharded", tmp_path / "folder")


def test_parquet_files_and_saved_datasets_train_exactly_as_their_folder(make_config, shapes, tmp_path):
    sources = {
        "parquet": write_parquet(shapes, tmp_path / "parquet", rows_per_group=3),
        "dataset": save_dataset(shapes, tmp_path / "dataset"),
    }
    train(make_config(train__output_dir=str(tmp_path / "folder")))
    for name, source in sources.items():
        train(
            make_config(
                data__path=str(source), train__output_dir=str(tmp_path / name), cache__dir=str(tmp_path / "cache")
            )
        )
        assert _losses(tmp_path / name) == _losses(tmp_path / "folder"), name
        assert _same_adapters(tmp_path / name, tmp_path / "folder"), name


def test_table_rows_without_images_and_unknown_columns_are_named(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"image": [png((200, 0, 0)), None, b"not an image"], "text": ["a red square", "none", "garbage"]})
    pq.write_table(table, tmp_path / "rows.parquet")
    examples, bad = scan_examples(DataConfig(path=str(tmp_path / "rows.parquet")))
    assert [(str(e.path), e.caption) for e in examples] == [(f"{tmp_path / 'rows.parquet'}:0.png", "a red square")]
    reasons = {str(b.path): b.reason for b in bad}
    assert reasons[f"{tmp_path / 'rows.parquet'}:row 1"] == "no image bytes in column 'image'"
    assert "cannot be decoded" in reasons[f"{tmp_path / 'rows.parquet'}:2.bin"]
    with pytest.raises(DifftuneError, match=r"data.image_column = 'photo' is not one of its columns \(image, text\)"):
        scan_examples(DataConfig(path=str(tmp_path / "rows.parquet"), image_column="photo"))
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})})
    splits.save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(DifftuneError, match=r"a DatasetDict .*point it at one split's folder, e.g. .*splits/train"):
        scan_examples(DataConfig(path=str(tmp_path / "splits")))


def test_parquet_row_groups_are_kept_within_their_budget(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from difftune.data import sources

    rows = [png((10 * i, 0, 0)) for i in range(9)]
    pq.write_table(pa.table({"image": rows}), tmp_path / "rows.parquet", row_group_size=3)
    reads = []
    monkeypatch.setattr(sources, "_library", lambda name: reads.append(name) or __import__("pyarrow.parquet").parquet)
    kept_all, kept_one = sources._RowGroups(budget=1 << 20), sources._RowGroups(budget=1)
    order = [4, 0, 8, 1, 5, 7, 2, 6, 3]  # shuffled, as training draws them
    for groups in (kept_all, kept_one):
        assert [groups.get(str(tmp_path / "rows.parquet"), row // 3, "image")[row % 3] for row in order] == [
            rows[r] for r in order
        ]
    assert len(kept_all.groups) == 3 and len(kept_one.groups) == 1
    # Within the budget each group is read once; past it, each change of group reads again (every draw here).
    assert len(reads) == 3 + 9


def test_a_cached_run_never_reads_the_shards_again(make_config, shapes, tmp_path, monkeypatch):
    shards = write_shards(shapes, tmp_path / "shards", per_shard=4)
    settings = {
        "data__path": str(shards),
        "cache__latents": True,
        "cache__text": True,
        "cache__dir": str(tmp_path / "cache"),
        "train__max_steps": 12,
    }
    train(make_config(**settings, train__output_dir=str(tmp_path / "first")))
    reads = []
    original = Member.read
    monkeypatch.setattr(Member, "read", lambda self: reads.append(self) or original(self))
    train(make_config(**settings, train__output_dir=str(tmp_path / "second")))
    # 12 steps of 2 (3 epochs) without a read: the scan's index and the latent cache hold all a run needs.
    assert reads == []
    assert _losses(tmp_path / "second") == _losses(tmp_path / "first")


def test_the_scan_is_kept_and_made_again_when_a_file_changes(shapes, tmp_path, monkeypatch):
    shards = write_shards(shapes, tmp_path / "shards", per_shard=4)
    reads = []
    original = Member.read
    monkeypatch.setattr(Member, "read", lambda self: reads.append(self) or original(self))
    config, index = DataConfig(path=str(shards)), tmp_path / "scans"
    first, _ = scan_examples(config, index_folder=index)
    assert len(reads) == len(first) == 8  # each image decoded once
    again, _ = scan_examples(config, index_folder=index)
    assert again == first and [e.path.displayed for e in again] == [e.path.displayed for e in first] == [(32, 32)] * 8
    assert len(reads) == 8 and len(list(index.iterdir())) == 1
    with tarfile.open(shards / "train-0001.tar", "w") as tar:  # the second shard rewritten with one record
        add_member(tar, "new.png", png((0, 0, 200)))
        add_member(tar, "new.txt", b"a blue square")
    changed, _ = scan_examples(config, index_folder=index)
    assert [e.caption for e in changed] == [e.caption for e in first[:4]] + ["a blue square"]
    assert len(reads) == 8 + 5 and len(list(index.iterdir())) == 2


def shard_records(out: Path, records: list[list[tuple[str, bytes]]]) -> Path:
    """One shard of the given records, each a list of (member name, bytes)."""
    out.mkdir(parents=True)
    with tarfile.open(out / "train-0000.tar", "w") as tar:
        for members in records:
            for name, data in members:
                add_member(tar, name, data)
    return out


def test_masks_and_controls_in_shard_records_train_as_their_folders(make_config, shapes, pairs, kontext_base, tmp_path):
    from conftest import edit_settings

    masks = tmp_path / "masks"
    masks.mkdir()
    images = sorted(path for path in shapes.iterdir() if path.suffix == ".png")
    for path in images:
        mask = Image.new("L", Image.open(path).size, 0)
        mask.paste(255, (0, 0, mask.width // 2, mask.height))
        mask.save(masks / path.name)
    masked = shard_records(
        tmp_path / "masked",
        [
            [
                (path.name, path.read_bytes()),
                (f"{path.stem}.mask.png", (masks / path.name).read_bytes()),
                (f"{path.stem}.txt", path.with_suffix(".txt").read_bytes()),
            ]
            for path in images
        ],
    )
    common = {"cache__dir": str(tmp_path / "cache"), "train__max_steps": 3}
    train(
        make_config(data__masks="folder", data__mask_path=str(masks), train__output_dir=str(tmp_path / "m1"), **common)
    )
    train(make_config(data__path=str(masked), data__masks="record", train__output_dir=str(tmp_path / "m2"), **common))
    assert _losses(tmp_path / "m2") == _losses(tmp_path / "m1")
    unmasked = tmp_path / "m3"
    train(make_config(data__path=str(masked), train__output_dir=str(unmasked), **common))
    assert _losses(unmasked) != _losses(tmp_path / "m1")  # the masks were read, not ignored

    targets = sorted(path for path in pairs.iterdir() if path.suffix == ".png")
    paired = shard_records(
        tmp_path / "paired",
        [
            [
                (path.name, path.read_bytes()),
                (f"{path.stem}.control.png", (pairs / "control" / path.name).read_bytes()),
                (f"{path.stem}.txt", path.with_suffix(".txt").read_bytes()),
            ]
            for path in targets
        ],
    )
    train(make_config(**edit_settings(kontext_base, pairs, tmp_path / "p1", **common)))
    train(make_config(**edit_settings(kontext_base, paired, tmp_path / "p2", **common)))
    assert _losses(tmp_path / "p2") == _losses(tmp_path / "p1")


def test_a_record_with_controls_numbered_with_a_gap_is_left_out(tmp_path):
    shard = shard_records(
        tmp_path / "gap",
        [
            [
                ("0001.png", png((200, 0, 0))),
                ("0001.control_0.png", png((0, 0, 200))),
                ("0001.control_2.png", png((0, 200, 0))),
                ("0001.txt", b"make it red"),
            ],
            [
                ("0002.png", png((200, 0, 0))),
                ("0002.control_1.png", png((0, 200, 0))),
                ("0002.control_0.png", png((0, 0, 200))),
                ("0002.txt", b"make it red"),
            ],
        ],
    )
    examples, bad = scan_examples(DataConfig(path=str(shard)))
    assert [[c.name for c in e.control_paths] for e in examples] == [["0002.control_0.png", "0002.control_1.png"]]
    assert [str(b.path) for b in bad] == [f"{shard / 'train-0000.tar'}:0001"]
    assert "numbered control_0, control_1... without gaps" in bad[0].reason


def test_shard_members_are_keyed_and_read_by_their_byte_range(tmp_path):
    shard = tmp_path / "train-0000.tar"
    with tarfile.open(shard, "w") as tar:
        add_member(tar, "part/0001.seg.png", png((200, 0, 0)))  # webdataset's key: up to the name's first dot
        add_member(tar, "part/0001.txt", b"a red square")
        add_member(tar, "0002.png", png((0, 0, 200)))
        add_member(tar, "0002.json", json.dumps({"text": "a blue square", "width": 32}).encode())
    examples, bad = scan_examples(DataConfig(path=str(shard)))
    assert bad == []
    assert [(str(e.path), e.caption) for e in examples] == [
        (f"{shard}:part/0001.seg.png", "a red square"),
        (f"{shard}:0002.png", "a blue square"),
    ]
    assert examples[0].path.stem == "0001" and examples[0].path.suffix == ".png"
    assert examples[1].path.read() == png((0, 0, 200))


def test_bad_records_and_damaged_shards_are_reported_by_shard_and_key(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    with tarfile.open(folder / "train-0000.tar", "w") as tar:
        add_member(tar, "good.png", png((0, 200, 0)))
        add_member(tar, "good.txt", b"a green square")
        add_member(tar, "corrupt.png", b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
        add_member(tar, "corrupt.txt", b"a broken image")
        add_member(tar, "orphan.txt", b"a caption with no image")
        add_member(tar, "latin1.png", png((0, 0, 200)))
        add_member(tar, "latin1.txt", "caf\u00e9".encode("latin-1"))
        add_member(tar, "twice.png", png((9, 9, 9)))
        add_member(tar, "twice.jpg", png((9, 9, 9)))
        add_member(tar, "twice.txt", b"two images")
        add_member(tar, "tiny.png", png((9, 9, 9), size=(4, 4)))
        add_member(tar, "tiny.txt", b"too small")
    with tarfile.open(tmp_path / "whole.tar", "w") as tar:
        for number in range(3):
            add_member(tar, f"{number}.png", png((200, 0, 0)))
            add_member(tar, f"{number}.txt", b"a red square")
    whole = (tmp_path / "whole.tar").read_bytes()
    # Each record is four 512-byte blocks (a header and a data block per member): this ends inside the third image.
    (folder / "train-0001.tar").write_bytes(whole[: 512 * 9 + 50])

    examples, bad = scan_examples(DataConfig(path=str(folder), min_image_size=8))
    assert sorted((str(e.path), e.caption) for e in examples) == [
        (f"{folder / 'train-0000.tar'}:good.png", "a green square"),
        (f"{folder / 'train-0001.tar'}:0.png", "a red square"),
        (f"{folder / 'train-0001.tar'}:1.png", "a red square"),
    ]
    reasons = {str(b.path): b.reason for b in bad}
    first, second = folder / "train-0000.tar", folder / "train-0001.tar"
    assert "cannot be decoded" in reasons[f"{first}:corrupt.png"]
    assert "no image or clip" in reasons[f"{first}:orphan"]
    assert "not UTF-8" in reasons[f"{first}:latin1"]
    assert "more than one image or clip" in reasons[f"{first}:twice"]
    assert "smaller than data.min_image_size" in reasons[f"{first}:tiny.png"]
    assert "cannot be read past its first 2 records" in reasons[str(second)]


def test_a_record_without_a_caption_is_named(tmp_path):
    shard = tmp_path / "train-0000.tar"
    with tarfile.open(shard, "w") as tar:
        add_member(tar, "0001.png", png((200, 0, 0)))
    with pytest.raises(DifftuneError, match=r"train-0000\.tar:0001\.png has no caption .*missing_caption"):
        scan_examples(DataConfig(path=str(shard)))
    examples, _ = scan_examples(DataConfig(path=str(shard), missing_caption="empty"))
    assert [e.caption for e in examples] == [""]


def test_shards_that_are_not_there_are_named(tmp_path, s3):
    with pytest.raises(DifftuneError, match=r"data.path .*missing\.tar: not found"):
        scan_examples(DataConfig(path=str(tmp_path / "missing.tar")))
    with pytest.raises(DifftuneError, match=r"data.path s3://shards/none-\*\.tar: holds no \.tar shards"):
        scan_examples(DataConfig(path="s3://shards/none-*.tar"))


def test_clips_in_shards_are_cut_into_windows_like_the_folders(tmp_path):
    folder = tmp_path / "clips"
    write_clip_folder(folder, moving_shape_clips(2, seed=1, colors=("red",)))
    shards = write_shards(folder, tmp_path / "shards", per_shard=1)
    windows = FrameWindows.of(DataConfig(path=str(folder), target_frames=[5]), (4, 1))
    config = DataConfig(path=str(folder), resolution=32, random_flip=True)
    from_folder, _ = scan_examples(config, windows=windows)
    from_shards, bad = scan_examples(config.model_copy(update={"path": str(shards)}), windows=windows)
    assert bad == [] and [e.frames for e in from_shards] == [e.frames for e in from_folder] == [(0, 5), (0, 5)]
    tokenize = lambda captions: {"ids": torch.zeros(len(captions), 4, dtype=torch.long)}  # noqa: E731
    for index in range(2):
        items = [
            CaptionedImages(examples, config, tokenize, train_seed=3, sizes=training_sizes(examples, config))[0, index]
            for examples in (from_folder, from_shards)
        ]
        assert items[0]["pixel_values"].shape == (3, 5, 32, 32)
        assert torch.equal(items[0]["pixel_values"], items[1]["pixel_values"])


def test_shards_on_s3_train_as_on_disk(make_config, shapes, tmp_path, s3):
    shards = write_shards(shapes, tmp_path / "shards", per_shard=3)
    s3.put(f"{shards}/", "shards/disk-test/", recursive=True)
    parquet = write_parquet(shapes, tmp_path / "parquet", rows_per_group=3)
    s3.put(str(parquet), "shards/parquet/train-0000.parquet")
    on_disk, _ = scan_examples(DataConfig(path=str(parquet)))
    on_s3, bad = scan_examples(DataConfig(path="s3://shards/parquet"))
    assert bad == [] and [(e.path.read(), e.caption) for e in on_s3] == [(e.path.read(), e.caption) for e in on_disk]
    settings = {"cache__dir": str(tmp_path / "cache")}
    train(make_config(data__path=str(shards), train__output_dir=str(tmp_path / "disk"), **settings))
    train(
        make_config(data__path="s3://shards/disk-test/train-*.tar", train__output_dir=str(tmp_path / "s3"), **settings)
    )
    assert _losses(tmp_path / "s3") == _losses(tmp_path / "disk")
    assert _same_adapters(tmp_path / "s3", tmp_path / "disk")


def test_a_cache_on_s3_serves_as_a_local_one(make_config, shapes, tmp_path, s3):
    shards = write_shards(shapes, tmp_path / "shards", per_shard=4)
    s3.put(f"{shards}/", "shards/cached/", recursive=True)
    settings = {"data__path": "s3://shards/cached", "cache__latents": True, "cache__text": True, "train__max_steps": 4}
    train(make_config(**settings, cache__dir=str(tmp_path / "cache"), train__output_dir=str(tmp_path / "local")))
    train(make_config(**settings, cache__dir="s3://shards/cache", train__output_dir=str(tmp_path / "remote")))
    local = sorted(
        str(path.relative_to(tmp_path / "cache")) for path in (tmp_path / "cache").rglob("*") if path.is_file()
    )
    assert sorted(name.removeprefix("shards/cache/") for name in s3.find("shards/cache")) == local
    reads = []
    original = Member.read
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Member, "read", lambda self: reads.append(self) or original(self))
        train(make_config(**settings, cache__dir="s3://shards/cache", train__output_dir=str(tmp_path / "again")))
    assert reads == []  # the scan's index and every entry came from the bucket
    assert _losses(tmp_path / "remote") == _losses(tmp_path / "local") == _losses(tmp_path / "again")


@pytest.mark.slow
def test_a_run_from_s3_shards_killed_and_resumed_is_bit_identical(tmp_path, s3):
    shards = write_shards(REPO / "examples" / "purple", tmp_path / "shards", per_shard=5)
    s3.put(f"{shards}/", "shards/purple/", recursive=True)
    common = [
        sys.executable,
        "-m",
        "difftune.cli",
        "train",
        "--config",
        "configs/tiny_lora.toml",
        "train.max_steps=40",
        "data.path=s3://shards/purple",
        "checkpoint.every_steps=5",
        "sample.prompts=[]",
        "log.progress_bar=false",
        "log.tensorboard=false",
        f"cache.dir={tmp_path / 'cache'}",
        "cache.latents=off",
        "data.num_workers=2",  # each draw read from the server, in loader worker processes
    ]
    whole, killed = run_whole_killed_and_resumed(common, tmp_path, kill_at_rows=17, steps=40)
    assert _losses(killed) == _losses(whole)
    assert _same_adapters(killed, whole)


def test_where_data_path_points_is_one_type_every_reader_asks(shapes, tmp_path):
    """A folder of files and stored records (shards, parquet, a saved dataset) are the two sources; what start-up,
    the scan index and the plan need to know of one is asked of its type."""
    from difftune.data.sources import FolderOfFiles, StoredRecords, data_source

    shards = write_shards(shapes, tmp_path / "shards", per_shard=4)
    stored = [shards, shards / "train-0000.tar", write_parquet(shapes, tmp_path / "parquet", 4)]
    stored.append(save_dataset(shapes, tmp_path / "saved"))
    assert all(type(data_source(str(path))) is StoredRecords for path in stored)
    assert all(data_source(str(path)).scan_is_kept and data_source(str(path)).may_hold_clips() for path in stored)
    folder = data_source(str(shapes))
    assert type(folder) is FolderOfFiles and not folder.scan_is_kept and not folder.may_hold_clips()
    folder.check_present("data.path", "captioned images")  # a folder that is there
    with pytest.raises(DifftuneError, match=r"^data\.path .*missing: does not exist; point it at a folder of images"):
        data_source(str(tmp_path / "missing")).check_present("data.path", "images")
    (tmp_path / "clips").mkdir()
    write_clip_folder(tmp_path / "clips", moving_shape_clips(1, seed=0, frames=5))
    assert data_source(str(tmp_path / "clips")).may_hold_clips()
