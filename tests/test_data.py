import json
import random
from itertools import islice, pairwise

import pytest
import torch
from PIL import Image

from difftune.config import DataConfig
from difftune.data.dataset import CaptionedImages, TrainingOrder, load_image, sample_seed, scan_examples
from difftune.errors import DifftuneError
from difftune.families import FAMILIES
from difftune.toy.tiny import build_tokenizer


def _image(path, size=(40, 32), color=(255, 0, 0)):
    Image.new("RGB", size, color).save(path)


def test_kohya_layout_with_repeat_folders(tmp_path):
    _image(tmp_path / "a.png")
    (tmp_path / "a.txt").write_text("a red thing\n")
    concept = tmp_path / "3_concept"
    concept.mkdir()
    _image(concept / "b.jpg")
    (concept / "b.txt").write_text("\ufeffsks thing", encoding="utf-8")  # BOM is stripped
    (tmp_path / "ignored_folder").mkdir()  # no N_ prefix: not part of the data set
    _image(tmp_path / "ignored_folder" / "c.png")

    examples = scan_examples(DataConfig(path=str(tmp_path)))[0]
    assert [e.caption for e in examples] == ["a red thing"] + ["sks thing"] * 3
    assert examples[1].path == concept / "b.jpg"


def test_metadata_jsonl_layout(tmp_path):
    _image(tmp_path / "x.png")
    _image(tmp_path / "y.webp")
    lines = [{"file_name": "x.png", "text": "first"}, {"file_name": "y.webp", "text": " second "}]
    (tmp_path / "metadata.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    examples = scan_examples(DataConfig(path=str(tmp_path)))[0]
    assert [(e.path.name, e.caption) for e in examples] == [("x.png", "first"), ("y.webp", "second")]


def test_metadata_errors_name_the_line(tmp_path):
    _image(tmp_path / "x.png")
    (tmp_path / "metadata.jsonl").write_text('{"file_name": "x.png", "text": "ok"}\n{"file_name": "x.png"}\n')
    with pytest.raises(DifftuneError, match=r"metadata\.jsonl:2: each line must be a JSON object"):
        scan_examples(DataConfig(path=str(tmp_path)))
    (tmp_path / "metadata.jsonl").write_text('{"file_name": "gone.png", "text": "ok"}\n')
    with pytest.raises(DifftuneError, match=r"metadata\.jsonl:1: image gone\.png does not exist"):
        scan_examples(DataConfig(path=str(tmp_path)))


def test_missing_caption_policy(tmp_path):
    _image(tmp_path / "a.png")
    with pytest.raises(DifftuneError, match=r"a\.png has no caption file a\.txt.*missing_caption = \"empty\""):
        scan_examples(DataConfig(path=str(tmp_path)))
    examples, _ = scan_examples(DataConfig(path=str(tmp_path), missing_caption="empty"))
    assert [e.caption for e in examples] == [""]


def test_non_utf8_caption_is_reported_and_skipped(tmp_path):
    _image(tmp_path / "a.png")
    (tmp_path / "a.txt").write_bytes(b"caf\xe9")
    _image(tmp_path / "b.png")
    (tmp_path / "b.txt").write_text("fine")
    examples, bad = scan_examples(DataConfig(path=str(tmp_path)))
    assert [e.path.name for e in examples] == ["b.png"]
    assert [(b.path.name, b.reason.split(" (")[0]) for b in bad] == [("a.txt", "caption is not UTF-8")]


def test_empty_or_missing_folder(tmp_path):
    with pytest.raises(DifftuneError, match="holds no images"):
        scan_examples(DataConfig(path=str(tmp_path)))
    with pytest.raises(DifftuneError, match="is not a folder"):
        scan_examples(DataConfig(path=str(tmp_path / "nope")))


def _crop(resolution, crop, flip):
    return DataConfig(path=".", resolution=resolution, crop=crop, random_flip=flip)


def _tokenize(captions):
    return FAMILIES["sd"].conditioning.tokenize({"tokenizer": build_tokenizer()}, captions)


def test_resize_and_crop(tmp_path):
    # Left half black, right half white, 64x32: resized to 32 high -> 64x32; center crop keeps both halves.
    image = Image.new("RGB", (64, 32), (0, 0, 0))
    image.paste((255, 255, 255), (32, 0, 64, 32))
    image.save(tmp_path / "halves.png")
    center, geometry, *_ = load_image(tmp_path / "halves.png", _crop(16, "center", False), random.Random(0))
    assert geometry.tolist() == [32, 64, 0, 8, 16, 16]  # 64x32 -> 32x16 resized, 16x16 cut at x = 8
    assert center.shape == (3, 16, 16)
    assert center[:, :, 0].mean() == pytest.approx(-1.0, abs=0.05)  # left column black
    assert center[:, :, -1].mean() == pytest.approx(1.0, abs=0.05)  # right column white
    assert center.min() >= -1.0 and center.max() <= 1.0

    crops = {
        load_image(tmp_path / "halves.png", _crop(16, "random", False), random.Random(s))[0].mean().item()
        for s in range(8)
    }
    assert len(crops) > 1  # random crops move
    again = load_image(tmp_path / "halves.png", _crop(16, "random", False), random.Random(3))[0]
    assert torch.equal(again, load_image(tmp_path / "halves.png", _crop(16, "random", False), random.Random(3))[0])

    flips = [load_image(tmp_path / "halves.png", _crop(16, "center", True), random.Random(s))[0] for s in range(16)]
    assert any(torch.equal(f, center.flip(-1)) for f in flips) and any(torch.equal(f, center) for f in flips)


def test_samples_are_deterministic_and_carry_their_seed(shapes):
    config = DataConfig(path=str(shapes), resolution=32, crop="random", random_flip=True, caption_dropout=0.5)
    dataset = CaptionedImages(scan_examples(config)[0], config, _tokenize, train_seed=7)
    first, again, other_epoch = dataset[(0, 3)], dataset[(0, 3)], dataset[(1, 3)]
    assert torch.equal(first["pixel_values"], again["pixel_values"])
    assert torch.equal(first["token_ids"]["text_encoder"], again["token_ids"]["text_encoder"])
    assert torch.equal(first["geometry"], again["geometry"])
    assert first["seed"] == sample_seed(7, 0, 3) != other_epoch["seed"]
    assert first["token_ids"]["text_encoder"].shape == (build_tokenizer().model_max_length,)


def test_caption_dropout_rate(shapes):
    config = DataConfig(path=str(shapes), resolution=32, caption_dropout=0.3)
    dataset = CaptionedImages(scan_examples(config)[0], config, _tokenize, train_seed=0)
    empty = _tokenize([""])["text_encoder"][0].tolist()
    dropped = [dataset[(epoch, 0)]["token_ids"]["text_encoder"].tolist() == empty for epoch in range(400)]
    assert sum(dropped) / len(dropped) == pytest.approx(0.3, abs=0.07)


def test_training_order_covers_each_epoch_and_shards_by_rank():
    size, batch = 10, 3
    single = TrainingOrder(size, batch * 2, seed=5)
    ranks = [TrainingOrder(size, batch, seed=5, rank=r, world_size=2) for r in range(2)]
    single_batches = list(islice(single, 20))
    rank_batches = [list(islice(order, 20)) for order in ranks]
    for step in range(20):
        # Two processes together see exactly the single process's global batch, in order.
        assert rank_batches[0][step] + rank_batches[1][step] == single_batches[step]
    stream = [key for b in single_batches for key in b]
    for epoch in range(len(stream) // size):
        keys = stream[epoch * size : (epoch + 1) * size]
        assert {e for e, _ in keys} == {epoch}
        assert sorted(i for _, i in keys) == list(range(size))  # each epoch is a permutation
    assert [k for _, k in stream[:size]] != list(range(size))  # shuffled
    assert list(islice(TrainingOrder(size, batch * 2, seed=5), 20)) == single_batches
    assert list(islice(TrainingOrder(size, batch * 2, seed=6), 20)) != single_batches
    resumed = TrainingOrder(size, batch * 2, seed=5, start_batch=7)
    assert list(islice(resumed, 13)) == single_batches[7:]


def _bucket_config(tmp_path, **extra):
    return DataConfig(
        path=str(tmp_path), resolution=32, buckets=True, bucket_step=8, bucket_min_side=16, bucket_max_side=64, **extra
    )


def test_bucket_sizes_respect_the_budget():
    from difftune.data.dataset import bucket_sizes

    config = DataConfig(path=".", resolution=512, buckets=True)
    sizes = bucket_sizes(config)
    assert (512, 512) in sizes and (768, 320) in sizes and (320, 768) in sizes
    for width, height in sizes:
        assert width % 64 == 0 and height % 64 == 0
        assert 256 <= width <= 1024 and 256 <= height <= 1024
        assert width * height <= 512 * 512


def test_every_image_lands_in_its_closest_bucket(tmp_path):
    import math

    from difftune.data.dataset import bucket_sizes, training_sizes

    shapes = [(32, 32), (64, 32), (32, 64), (60, 20), (45, 30), (33, 50), (100, 48)]
    for i, (w, h) in enumerate(shapes):
        _image(tmp_path / f"{i}.png", size=(w, h))
        (tmp_path / f"{i}.txt").write_text("x")
    config = _bucket_config(tmp_path)
    examples, _ = scan_examples(config)
    ratios = sorted(math.log(w / h) for w, h in bucket_sizes(config))
    tolerance = max(b - a for a, b in pairwise(ratios)) / 2
    for example, (bw, bh) in zip(examples, training_sizes(examples, config), strict=True):
        w, h = Image.open(example.path).size
        assert abs(math.log(w / h) - math.log(bw / bh)) <= tolerance + 1e-9, (example.path.name, (bw, bh))
    assert training_sizes(examples, config)[0] == (32, 32)


def test_bucketed_batches_never_mix_buckets_and_repeat_under_a_seed():
    buckets = [(32, 32)] * 5 + [(48, 16)] * 3 + [(16, 48)] * 2

    def batches(seed, rank=0, world=1, start=0, count=12):
        order = TrainingOrder(len(buckets), 2, seed, rank, world, start, buckets=buckets)
        return list(islice(order, count))

    single = batches(seed=1)
    for batch in single:
        assert len({buckets[i] for _, i in batch}) == 1  # one bucket per batch
    per_epoch = 3 + 2 + 1  # ceil(5/2) + ceil(3/2) + ceil(2/2)
    first_epoch = [i for batch in single[:per_epoch] for _, i in batch]
    assert set(first_epoch) == set(range(10))  # every image, padded within its bucket
    assert batches(seed=1) == single and batches(seed=2) != single
    assert batches(seed=1, start=4, count=8) == single[4:]
    # Two processes at batch 2 each share out the global batches of one process at batch 4.
    wide = list(islice(TrainingOrder(len(buckets), 4, 1, buckets=buckets), 6))
    halves = [batches(seed=1, rank=r, world=2, count=6) for r in range(2)]
    assert [a + b for a, b in zip(*halves, strict=True)] == wide


def _batches(dataset, order, num_workers, count):
    from difftune.data.dataset import build_dataloader

    batches = iter(build_dataloader(dataset, order, num_workers, pin_memory=False))
    return [next(batches) for _ in range(count)]


def test_worker_processes_give_the_same_batches_as_none(shapes):
    """Every random draw comes from the sample's seed, so 2 loader workers (the default) read exactly what the
    training process alone reads: pixels after random crop and flip, captions after dropout, seeds, order."""
    config = DataConfig(path=str(shapes), resolution=24, crop="random", random_flip=True, caption_dropout=0.5)
    examples, _ = scan_examples(config)
    dataset = CaptionedImages(examples, config, _tokenize, train_seed=7)
    count = 2 * len(examples) // 3 + 1  # past an epoch boundary
    alone = _batches(dataset, TrainingOrder(len(examples), 3, seed=7), 0, count)
    workers = _batches(dataset, TrainingOrder(len(examples), 3, seed=7), 2, count)
    for a, b in zip(alone, workers, strict=True):
        assert (
            a["seed"].tolist() == b["seed"].tolist()
            and a["path"] == b["path"]
            and a["epoch"].tolist() == b["epoch"].tolist()
        )
        assert torch.equal(a["pixel_values"], b["pixel_values"]) and torch.equal(a["geometry"], b["geometry"])
        assert torch.equal(a["token_ids"]["text_encoder"], b["token_ids"]["text_encoder"])


def test_training_with_workers_matches_training_without(make_config, tmp_path):
    from difftune.training.metrics import read_metrics
    from difftune.training.train import train

    common = {"train__max_steps": 5, "data__random_flip": True, "data__caption_dropout": 0.3}
    train(make_config(train__output_dir=str(tmp_path / "alone"), data__num_workers=0, **common))
    train(make_config(train__output_dir=str(tmp_path / "workers"), data__num_workers=2, **common))
    losses = [[row["loss"] for row in read_metrics(tmp_path / name)] for name in ("alone", "workers")]
    assert losses[0] == losses[1]
