"""Several datasets in one run (`[[data.datasets]]`): each read with its own settings over `[data]`'s, at each of its
resolutions, repeated and weighted as it says; a one-dataset config means what it meant."""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from difftune.config import DataConfig, load_config
from difftune.data.dataset import CaptionedImages, TrainingOrder, batch_groups, scan_datasets, training_sizes
from difftune.errors import DifftuneError
from difftune.toy.tiny import shape_images, write_caption_folder
from difftune.training.metrics import read_metrics
from difftune.training.train import train


def _spelled(captions, controls=None):
    """A tokenizer that keeps the text: each caption's UTF-8 bytes, zero-padded."""
    return {"text": torch.tensor([list(caption.encode().ljust(96, b"\0")) for caption in captions])}


def _caption(item) -> str:
    return bytes(item["token_ids"]["text"].tolist()).rstrip(b"\0").decode()


@pytest.fixture
def two_folders(tmp_path):
    """`a`: four captioned shapes, one wide (64 x 32), and a file that is no image; `b`: two shapes."""
    write_caption_folder(tmp_path / "a", shape_images(4, seed=1))
    Image.new("RGB", (64, 32), (200, 40, 40)).save(tmp_path / "a" / "wide.png")
    (tmp_path / "a" / "wide.txt").write_text("a wide red thing", encoding="utf-8")
    (tmp_path / "a" / "broken.png").write_bytes(b"not a png")
    (tmp_path / "a" / "broken.txt").write_text("broken", encoding="utf-8")
    write_caption_folder(tmp_path / "b", shape_images(2, seed=2))
    return tmp_path


def test_a_config_file_of_several_datasets(tmp_path):
    (tmp_path / "job.toml").write_text(
        """
[data]
resolution = 32
caption_prefix = "sks, "

[[data.datasets]]
path = "a"
resolution = [32, 64]
repeats = 2

[[data.datasets]]
path = "b"
caption_prefix = ""
loss_weight = 0.5
masks = "folder"
mask_path = "masks"
""",
        encoding="utf-8",
    )
    config = load_config(tmp_path / "job.toml")
    datasets = config.data.each_dataset()
    assert [(Path(d.path).name, d.resolution, d.repeats, d.loss_weight) for d in datasets] == [
        ("a", 32, 2, 1.0),
        ("a", 64, 2, 1.0),
        ("b", 32, 1, 0.5),
    ]
    assert [d.caption_prefix for d in datasets] == ["sks, ", "sks, ", ""]  # unset: [data]'s
    assert datasets[2].mask_path == str(tmp_path / "masks")  # relative to the file, as [data]'s paths are
    assert all(Path(d.path).parent == tmp_path and not d.datasets for d in datasets)
    assert config.data.dataset_keys() == ["data.datasets[0].path"] * 2 + ["data.datasets[1].path"]
    assert config.sample.resolution == 64  # the largest trained
    assert config.data.largest_resolution() == 64
    assert load_config(None, ["data.path=x"]).data.each_dataset()[0].path.endswith("x")  # one dataset: [data]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"path": "a", "num_workers": 4},
            r"data\.datasets\.0\.num_workers: unknown key; allowed in \[data\.datasets\]",
        ),
        ({"path": "a", "resolution": [32, 250]}, r"datasets\[0\] \(resolution 250\): resolution: must be a multiple"),
        ({"path": "a", "masks": "folder"}, r'datasets\[0\] \(resolution 32\).*masks = "folder" needs data\.mask_path'),
        ({"path": ""}, r"data\.datasets\.0\.path: is empty"),
    ],
)
def test_a_bad_dataset_is_named(entry, message):
    table = "{" + ", ".join(f"{key} = {json.dumps(value)}" for key, value in entry.items()) + "}"
    with pytest.raises(DifftuneError, match=message) as caught:
        load_config(None, ["data.resolution=32", f"data.datasets=[{table}]"])
    if "unknown key" in message:  # what a dataset may set, not the run-wide settings
        allowed = str(caught.value).split("allowed in [data.datasets]: ")[1].split(", ")
        assert {"path", "resolution", "repeats", "caption_prefix", "masks"} <= set(allowed)
        assert not {"num_workers", "keep_alpha", "datasets"} & set(allowed)


def test_a_dataset_with_random_crops_turns_the_latent_cache_off():
    datasets = 'data.datasets=[{path = "a"}, {path = "b", crop = "random"}]'
    assert load_config(None, [datasets]).cache.latents == "off"
    with pytest.raises(DifftuneError, match=r'cache\.latents needs data\.crop = "center", in every dataset'):
        load_config(None, [datasets, "cache.latents=on"])
    shuffled = 'data.datasets=[{path = "a"}, {path = "b", shuffle_tags = true}]'
    assert load_config(None, [shuffled]).cache.text == "off"


def test_each_dataset_is_scanned_once_repeated_weighted_and_read_with_its_settings(two_folders):
    data = DataConfig(
        resolution=32,
        caption_prefix="sks, ",
        datasets=[
            {
                "path": str(two_folders / "a"),
                "resolution": [32, 64],
                "repeats": 2,
                "buckets": True,
                "bucket_step": 8,
                "bucket_min_side": 16,
                "bucket_max_side": 128,
            },
            {"path": str(two_folders / "b"), "caption_prefix": "", "loss_weight": 0.5},
        ],
    )
    examples, bad = scan_datasets(data)
    assert [Path(b.path).name for b in bad] == ["broken.png"]  # its folder read at two sizes: reported once
    counts = [sum(e.dataset == d for e in examples) for d in range(3)]
    assert counts == [10, 10, 2]  # five images twice at each of two sizes; two once
    assert {e.loss_weight for e in examples if e.dataset == 2} == {0.5}
    assert {e.loss_weight for e in examples if e.dataset < 2} == {1.0}

    sizes = training_sizes(examples, data)
    for example, (width, height) in zip(examples, sizes, strict=True):
        side = data.each_dataset()[example.dataset].resolution
        if example.dataset == 2:  # no buckets: the square
            assert (width, height) == (32, 32)
        elif example.path.name == "wide.png":  # its bucket at this dataset's size: twice as wide, about side^2 pixels
            assert 1.5 <= width / height <= 2.5 and 0.6 * side**2 <= width * height <= side**2
        else:
            assert (width, height) == (side, side)

    dataset = CaptionedImages(examples, data, _spelled, train_seed=0, sizes=sizes)
    for index, example in enumerate(examples):
        item = dataset[(0, index)]
        assert item["pixel_values"].shape[1:] == (sizes[index][1], sizes[index][0])
        assert _caption(item) == ("" if example.dataset == 2 else "sks, ") + example.caption
        assert item["loss_weight"] == example.loss_weight

    order = TrainingOrder(len(examples), 2, seed=0, buckets=batch_groups(sizes, [()] * len(examples), False))
    batches = iter(order)
    for _ in range(30):  # no batch mixes sizes, though no dataset of one size asked for buckets
        assert len({sizes[index] for _, index in next(batches)}) == 1


def _job(make_config, tmp_path, out, data, **overrides):
    settings = {
        "train__output_dir": str(tmp_path / out),
        "train__max_steps": 6,
        "checkpoint__every_steps": 2,
        "cache__latents": True,
        "cache__text": True,
        "cache__dir": str(tmp_path / "cache"),
        "adapter__dropout": 0.1,
    }
    return make_config(**settings | data | overrides)


def _cache_files(tmp_path) -> set[Path]:
    return set((tmp_path / "cache").rglob("*.safetensors"))


def _losses(out: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(out)]


def test_one_dataset_in_the_list_trains_what_the_data_section_trains(make_config, shapes, tmp_path):
    """The same folder as `data.path` or as the one `[[data.datasets]]`: the same cache entries, losses and file."""
    train(_job(make_config, tmp_path, "plain", {"data__path": str(shapes), "data__random_flip": True}))
    cached = _cache_files(tmp_path)
    listed = {"data__datasets": [{"path": str(shapes), "random_flip": True}]}
    train(_job(make_config, tmp_path, "listed", listed))
    assert _cache_files(tmp_path) == cached  # nothing encoded again: the keys are the same
    assert _losses(tmp_path / "listed") == _losses(tmp_path / "plain")
    weights = [load_file(tmp_path / run / "pytorch_lora_weights.safetensors") for run in ("plain", "listed")]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


def test_two_datasets_at_two_resolutions_train_and_resume_exactly(make_config, shapes, two_folders, tmp_path):
    data = {
        "data__datasets": [
            {"path": str(shapes), "resolution": [32, 64], "random_flip": True},
            {"path": str(two_folders / "b"), "repeats": 3, "caption_dropout": 0.5, "loss_weight": 0.5},
        ]
    }
    result = train(_job(make_config, tmp_path, "whole", data))
    entries = _cache_files(tmp_path)
    sizes = {tuple(load_file(entry)["mean"].shape[-2:]) for entry in entries if "latents" in entry.parts}
    (small, _), (large, _) = sorted(sizes)
    assert len(sizes) == 2 and large == 2 * small  # 32 and 64 px
    assert len(_losses(tmp_path / "whole")) == 6 and result is not None
    train(_job(make_config, tmp_path, "parts", data, train__max_steps=4))
    train(_job(make_config, tmp_path, "parts", data), resume="auto")
    assert _losses(tmp_path / "parts") == _losses(tmp_path / "whole")
    whole, parts = (load_file(tmp_path / run / "pytorch_lora_weights.safetensors") for run in ("whole", "parts"))
    assert all(torch.equal(whole[name], parts[name]) for name in whole)


def test_the_ui_form_carries_the_datasets(tmp_path):
    """The form shows each dataset as one line (what it sets) and sends back the same config."""
    from difftune.webui.form import config_from_widgets, form_fields, widget_values

    config = load_config(
        None, [f'data.datasets=[{{path = "{tmp_path}", resolution = [32, 64]}}, {{path = "{tmp_path}", repeats = 2}}]']
    )
    fields = form_fields(["data"])
    values = widget_values(config, fields)
    shown = values[[field.name for field in fields].index("datasets")]
    assert shown.splitlines() == [
        json.dumps({"path": str(tmp_path), "resolution": [32, 64]}),
        json.dumps({"path": str(tmp_path), "repeats": 2}),
    ]
    assert config_from_widgets(fields, values, section="data") == config.data
