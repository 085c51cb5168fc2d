"""What the UI's Datasets tab reads and writes (webui/datasets.py) and the Train tab's draws (webui/draws.py), checked
against the code that reads them in a run (the data scan) and wrote them (the sample writer)."""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from difftune.config import DataConfig, SampleConfig
from difftune.data.dataset import report_bad_files, scan_examples
from difftune.errors import DifftuneError
from difftune.families.common.drawing import Sample, save_images
from difftune.webui import datasets, draws
from difftune.webui.datasets_tab import dataset_sources, source_data
from difftune.webui.jobs import Job


def _image(path: Path, size=(48, 32), color="red") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


@pytest.fixture
def folder(tmp_path) -> Path:
    """Two captioned images (one wide, one tall), one uncaptioned, one in a `3_more` folder, one unreadable; a mask
    folder and an edit control."""
    root = tmp_path / "data"
    _image(root / "wide.png", (64, 32))
    (root / "wide.txt").write_text("a wide red box\n")
    _image(root / "tall.png", (32, 64), "blue")
    (root / "tall.txt").write_text("a tall blue box\n")
    _image(root / "bare.png")
    _image(root / "3_more" / "again.png", (40, 40), "green")
    (root / "3_more" / "again.txt").write_text("a green square\n")
    (root / "broken.png").write_bytes(b"not a png at all")
    (root / "broken.txt").write_text("never read\n")
    _image(root / "control" / "wide.png", (64, 32), "white")
    _image(tmp_path / "masks" / "tall.png", (32, 64), "white")
    return root


def test_items_are_listed_once_with_their_captions_masks_and_controls(folder, tmp_path):
    data = DataConfig(path=str(folder), masks="folder", mask_path=str(tmp_path / "masks"))
    items = {item.name: item for item in datasets.list_items(data)}
    assert set(items) == {"wide.png", "tall.png", "bare.png", "again.png", "broken.png"}  # `3_more` folded to one
    assert items["wide.png"].caption == "a wide red box" and items["bare.png"].caption is None
    assert items["again.png"].caption_file == folder / "3_more" / "again.txt"
    assert items["wide.png"].controls == (folder / "control" / "wide.png",)
    assert items["tall.png"].mask == tmp_path / "masks" / "tall.png" and items["wide.png"].mask is None
    assert datasets.thumbnail(items["wide.png"].path).size == (64, 32)  # never blown up
    assert datasets.thumbnail(items["wide.png"].path, 16).size == (16, 8)
    card = datasets.thumbnail(items["broken.png"].path)  # unreadable: a card, no exception
    assert card.size == (datasets.THUMBNAIL_SIDE, datasets.THUMBNAIL_SIDE)


def test_a_caption_edit_is_what_the_run_reads_and_the_old_text_is_kept(folder, tmp_path):
    data = DataConfig(path=str(folder), missing_caption="empty")
    history = tmp_path / "jobs" / "datasets" / datasets.HISTORY_FILE
    items = {item.name: item for item in datasets.list_items(data)}
    datasets.write_caption(items["wide.png"], "  a wide crimson box\n", [tmp_path], history)
    written = datasets.write_caption(items["bare.png"], "a red box", [tmp_path], history)
    assert written.caption == "a red box" and written.caption_file == folder / "bare.txt"
    assert (folder / "wide.txt").read_text() == "a wide crimson box\n"
    examples, _ = scan_examples(data)
    assert {e.path.name: e.caption for e in examples}["wide.png"] == "a wide crimson box"
    assert {e.path.name: e.caption for e in examples}["bare.png"] == "a red box"
    [edit] = datasets.caption_history(history, folder / "wide.png")
    assert (edit["old"], edit["new"]) == ("a wide red box", "a wide crimson box")
    assert datasets.caption_history(history, folder / "bare.png")[0]["old"] is None
    datasets.write_caption(written, "a scarlet box", [tmp_path], history)
    assert [e["new"] for e in datasets.caption_history(history, folder / "bare.png")] == ["a scarlet box", "a red box"]

    with pytest.raises(DifftuneError, match="outside the folders this UI reads data from"):
        datasets.write_caption(items["tall.png"], "moved", [tmp_path / "elsewhere"], history)
    assert (folder / "tall.txt").read_text() == "a tall blue box\n"


def test_a_metadata_folder_gets_its_line_rewritten_and_keeps_the_others(tmp_path):
    root = tmp_path / "meta"
    _image(root / "a.png")
    _image(root / "b.png")
    lines = [{"file_name": "a.png", "text": "first", "extra": 1}, {"file_name": "b.png", "text": "second"}]
    (root / "metadata.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    data = DataConfig(path=str(root))
    item = next(item for item in datasets.list_items(data) if item.name == "b.png")
    assert item.caption_file == root / "metadata.jsonl"
    datasets.write_caption(item, "second, edited", [tmp_path], tmp_path / "history.jsonl")
    kept = [json.loads(line) for line in (root / "metadata.jsonl").read_text().splitlines()]
    assert kept == [lines[0], {"file_name": "b.png", "text": "second, edited"}]
    assert [e.caption for e in scan_examples(data)[0]] == ["first", "second, edited"]


def test_the_check_says_what_the_run_leaves_out_and_counts_its_buckets(folder, tmp_path):
    data = DataConfig(
        path=str(folder), resolution=32, buckets=True, bucket_step=8, bucket_min_side=16, bucket_max_side=64
    )
    check = datasets.check_dataset(data)
    # The run's report of the same folder, written by its own function (uncaptioned images allowed, else it stops).
    _, bad = scan_examples(data.model_copy(update={"missing_caption": "empty"}))
    report_bad_files(bad, tmp_path / "bad_files.jsonl", print_fn=lambda line: None)
    reported = [json.loads(line) for line in (tmp_path / "bad_files.jsonl").read_text().splitlines()]
    assert [(str(b.path), b.reason) for b in check.left_out] == [(r["file"], r["reason"]) for r in reported]
    assert "broken.png" in check.left_out[0].path.name
    assert check.uncaptioned == [folder / "bare.png"]
    verdicts = check.verdicts()
    assert "no caption" in verdicts[str(folder / "bare.png")] and str(folder / "broken.png") in verdicts
    # wide, tall, bare once each and the green square 3 times (its folder's repeats)
    assert check.examples == 6
    assert sum(check.buckets.values()) == 6
    wide = max(check.buckets, key=lambda size: size[0] / size[1])
    assert wide[0] > wide[1] and check.buckets[wide] == 2  # the wide box and the uncaptioned one (48x32)
    assert check.buckets[(32, 32)] == 3  # the square's repeats
    assert Counter(w > h for w, h in check.buckets.elements()) == Counter({True: 2, False: 4})

    uncaptioned_allowed = datasets.check_dataset(data.model_copy(update={"missing_caption": "empty"}))
    assert uncaptioned_allowed.uncaptioned == [] and uncaptioned_allowed.examples == 6


def test_stored_records_are_read_one_file_at_a_time_and_not_edited(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for number in range(2):
        with tarfile.open(shards / f"{number:05d}.tar", "w") as tar:
            for key, text in ((f"{number}a", "one"), (f"{number}b", "two")):
                png = io.BytesIO()
                Image.new("RGB", (16, 16), "red").save(png, format="PNG")
                for suffix, payload in ((".png", png.getvalue()), (".txt", text.encode())):
                    member = tarfile.TarInfo(key + suffix)
                    member.size = len(payload)
                    tar.addfile(member, io.BytesIO(payload))
    data = DataConfig(path=str(shards))
    files = datasets.stored_files(data)
    assert [Path(f).name for f in files] == ["00000.tar", "00001.tar"]
    items = datasets.list_items(data, files[1])
    assert [item.caption for item in items] == ["one", "two"] and all(i.caption_file is None for i in items)
    assert datasets.thumbnail(items[0].path).size == (16, 16)
    with pytest.raises(DifftuneError, match="read-only"):
        datasets.write_caption(items[0], "three", [tmp_path], tmp_path / "history.jsonl")
    with pytest.raises(DifftuneError, match="read-only"):
        datasets.caption_uncaptioned(data, "any-model", False, [tmp_path])


def test_datasets_are_offered_from_presets_and_jobs_inside_the_roots_only(tmp_path, folder):
    configs, jobs_dir = tmp_path / "configs", tmp_path / "jobs"
    configs.mkdir()
    (configs / "mine.toml").write_text(f'[data]\npath = "{folder}"\nresolution = 32\n')
    (jobs_dir / "20260101-000000-old").mkdir(parents=True)
    (jobs_dir / "20260101-000000-old" / "job.toml").write_text('[data]\npath = "/etc"\n')
    (jobs_dir / "20260101-000000-old" / "job.json").write_text("{}")
    offered = dict((value, label) for label, value in dataset_sources(jobs_dir, configs))
    assert set(offered) == {"preset:mine:0", "job:20260101-000000-old:0"}
    data, key = source_data("preset:mine:0", jobs_dir, configs)
    assert (data.path, data.resolution, key) == (str(folder), 32, "data.path")
    job_data, _ = source_data("job:20260101-000000-old:0", jobs_dir, configs)
    with pytest.raises(DifftuneError, match="outside the folders"):  # a job folder's config is not trusted
        datasets.checked_source(job_data, [tmp_path])
    with pytest.raises(DifftuneError, match="no such preset or job"):
        source_data("job:../../etc:0", jobs_dir, configs)


def test_the_draws_of_a_job_come_in_order_with_the_prompts_their_files_record(tmp_path):
    job = Job(tmp_path / "job")
    config = SampleConfig(prompts=["a purple circle", "a red square"])

    def drawn(folder: str, color: str):
        samples = [
            Sample(Image.new("RGB", (16, 16), color), prompt, seed) for seed, prompt in enumerate(config.prompts)
        ]
        save_images(samples, config, job.dir / folder)

    for folder in ("samples/step-000040", "samples/before", "samples/step-000020", "samples", "samples_ema"):
        drawn(folder, "purple")
    (job.dir / "samples" / "step-000060").mkdir()  # a draw begun, nothing written yet: not offered
    found = draws.draws(job)
    assert [draw.label for draw in found] == ["before training", "step 20", "step 40", "trained", "trained (EMA)"]
    files = found[1].files(job)
    assert [path.name for path in files] == ["000.png", "001.png"]  # the grid is not a sample
    assert [draws.drawn_prompt(path) for path in files] == config.prompts
    outside = tmp_path / "elsewhere.png"
    Image.new("RGB", (4, 4)).save(outside)
    (job.dir / "samples" / "step-000040" / "002.png").symlink_to(outside)
    assert len(draws.draws(job)[2].files(job)) == 2  # a link out of the job folder is not the job's
