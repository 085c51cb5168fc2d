"""Kill it at any moment, resume, and get the same run; safe loading; clear refusals."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from difftune.data.dataset import scan_examples
from difftune.errors import DifftuneError
from difftune.training import checkpoint as checkpoint_module
from difftune.training.checkpoint import MARKER, complete_checkpoints, find_checkpoint
from difftune.training.metrics import read_metrics
from difftune.training.output_lock import hold_output_dir
from difftune.training.train import train

from conftest import REPO, run_whole_killed_and_resumed


def _same_files(a: Path, b: Path) -> bool:
    first, second = load_file(a), load_file(b)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def _losses(output_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(output_dir)}


def _job(make_config, out, **overrides):
    settings = {
        "train__max_steps": 8,
        "checkpoint__every_steps": 2,
        "ema__enabled": True,
        "adapter__dropout": 0.1,
        "train__output_dir": str(out),
        **overrides,
    }
    return make_config(**settings)


def test_resume_continues_exactly_with_ema_and_keeps_the_last_checkpoints(make_config, tmp_path, tiny_base):
    """Stopped at step 4 then resumed (twice), the run matches an uninterrupted one bit for bit, its EMA weights too.
    (Every family resumes exactly: tests/test_families.py.) Adapter dropout is on, so the resumed run must also
    restore the global torch RNG state."""
    base = tiny_base
    whole = tmp_path / "whole"
    train(_job(make_config, whole, model__base=str(base)))
    parts = tmp_path / "parts"
    train(_job(make_config, parts, train__max_steps=4, model__base=str(base)))
    train(_job(make_config, parts, train__max_steps=6, model__base=str(base)), resume="auto")
    train(_job(make_config, parts, model__base=str(base)), resume="auto")
    assert _losses(parts) == _losses(whole)  # every step, the same loss
    assert list(_losses(parts)) == list(range(1, 9))  # each step once
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_ema.safetensors"):
        assert _same_files(whole / name, parts / name), name
    assert [p.name for p in complete_checkpoints(parts)] == ["step-000004", "step-000006", "step-000008"]  # keep_last 3


def test_galore_full_fine_tune_resumes_exactly(make_config, tmp_path):
    """GaLore's projections live in its optimizer state: checkpoints keep them as tensors (loaded without
    pickle code), so a resumed run refreshes and projects as the uninterrupted one does."""
    pytest.importorskip("galore_torch")
    settings = {
        "adapter__kind": "none",
        "optim__optimizer": "galore_adamw",
        "optim__galore_rank": 4,
        "optim__galore_update_proj_gap": 3,
        "ema__enabled": False,
        "adapter__dropout": 0.0,
    }
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(_job(make_config, whole, train__max_steps=6, **settings))
    train(_job(make_config, parts, train__max_steps=4, **settings))
    train(_job(make_config, parts, train__max_steps=6, **settings), resume="auto")
    assert _losses(parts) == _losses(whole)
    name = "unet/diffusion_pytorch_model.safetensors"
    assert _same_files(whole / "model" / name, parts / "model" / name)


def test_a_crash_while_writing_a_checkpoint_loses_nothing(make_config, tmp_path, monkeypatch):
    """Dying after the files are written but before the rename: the half-written checkpoint is never used."""
    whole = tmp_path / "whole"
    train(_job(make_config, whole, ema__enabled=False))
    out = tmp_path / "crash"
    real = checkpoint_module._seal
    calls = {"n": 0}

    def die_on_third_checkpoint(root):
        calls["n"] += 1
        real(root)
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed while writing the step-6 checkpoint")

    monkeypatch.setattr(checkpoint_module, "_seal", die_on_third_checkpoint)
    with pytest.raises(KeyboardInterrupt):
        train(_job(make_config, out, ema__enabled=False))
    monkeypatch.setattr(checkpoint_module, "_seal", real)
    assert (out / "checkpoints" / ".tmp-step-000006").is_dir()
    assert find_checkpoint(out, "auto").name == "step-000004"
    train(_job(make_config, out, ema__enabled=False), resume="auto")
    assert _losses(out) == _losses(whole)
    assert _same_files(whole / "pytorch_lora_weights.safetensors", out / "pytorch_lora_weights.safetensors")


# Run in a child process: training whose step-6 checkpoint write stops half-way through the trained weights and
# waits there (announcing it in a flag file) to be killed.
_SLOW_CHECKPOINT_WRITER = """
import sys, time
from pathlib import Path
from difftune.training import checkpoint
from difftune.config import load_config
from difftune.training.train import train

real_save_file = checkpoint.save_file

def half_written_then_wait(tensors, path, *args, **kwargs):
    real_save_file(tensors, path, *args, **kwargs)
    if "step-000006" in str(path):
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])
        Path(sys.argv[2]).write_text("writing")
        time.sleep(600)

checkpoint.save_file = half_written_then_wait
train(load_config(sys.argv[1]))
"""


def test_sigkill_during_a_checkpoint_write_leaves_the_previous_one_resumable(make_config, tmp_path):
    whole = tmp_path / "whole"
    train(_job(make_config, whole))
    killed = tmp_path / "killed"
    job = tmp_path / "job.toml"
    job.write_text(_job(make_config, killed).to_toml())
    flag = tmp_path / "writing"
    process = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CHECKPOINT_WRITER, str(job), str(flag)],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 300
    while not flag.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert flag.exists(), (
        process.stderr.read().decode()[-2000:] if process.poll() is not None else "no checkpoint write seen"
    )
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    assert (killed / "checkpoints" / ".tmp-step-000006" / "trained.safetensors").is_file()  # the half-written one
    assert find_checkpoint(killed, "auto").name == "step-000004"
    train(_job(make_config, killed), resume="auto")
    assert _losses(killed) == _losses(whole)
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_ema.safetensors"):
        assert _same_files(whole / name, killed / name), name


def test_a_checkpoint_without_its_marker_is_ignored(make_config, tmp_path):
    out = tmp_path / "run"
    train(_job(make_config, out, train__max_steps=6, ema__enabled=False))
    (out / "checkpoints" / "step-000006" / MARKER).unlink()
    assert find_checkpoint(out, "auto").name == "step-000004"
    with pytest.raises(DifftuneError, match="not a complete checkpoint"):
        find_checkpoint(out, str(out / "checkpoints" / "step-000006"))


def test_resume_refuses_changes_that_make_it_another_run(make_config, tmp_path, capsys):
    out = tmp_path / "run"
    train(_job(make_config, out, train__max_steps=2))
    expected = r"cannot resume.*\n  adapter\.alpha: 4\.0 -> 8\.0\n  adapter\.rank: 4 -> 8\n  data\.resolution: 32 -> 64"
    with pytest.raises(DifftuneError, match=expected):
        train(_job(make_config, out, train__max_steps=4, data__resolution=64, adapter__rank=8), resume="auto")
    with pytest.raises(DifftuneError, match=r"global batch \(train\.batch_size x processes\): 2 -> 4"):
        train(_job(make_config, out, train__max_steps=4, train__batch_size=4), resume="auto")
    capsys.readouterr()
    train(_job(make_config, out, train__max_steps=4, optim__learning_rate=5e-4), resume="auto")
    printed = capsys.readouterr().out
    assert "resuming with a changed setting: optim.learning_rate: 0.001 -> 0.0005" in printed
    assert "resuming with a changed setting: train.max_steps: 2 -> 4" in printed


def test_resume_fails_loudly_when_a_part_is_missing(make_config, tmp_path):
    out = tmp_path / "run"
    train(_job(make_config, out, train__max_steps=2))
    (out / "checkpoints" / "step-000002" / "trained.safetensors").unlink()
    with pytest.raises(
        DifftuneError, match=r"no checkpoint in .* passes its check \(step-000002: trained\.safetensors is missing\)"
    ):
        train(_job(make_config, out, train__max_steps=4), resume="auto")


def test_resume_auto_without_a_checkpoint_starts_fresh(make_config, tmp_path, capsys):
    """It says so, and starts as a new run does: the base's samples are drawn before training."""
    out = tmp_path / "new"
    job = _job(make_config, out, train__max_steps=2, sample__prompts=["a red circle"], sample__before=True)
    result = train(job, resume="auto")
    assert len(result.losses) == 2
    assert f"difftune: no checkpoint in {out / 'checkpoints'}: starting at step 0" in capsys.readouterr().out
    assert list((out / "samples" / "before").glob("*.png"))


def test_accelerate_state_is_loaded_without_pickle_code(make_config, tmp_path, monkeypatch):
    out = tmp_path / "run"
    train(_job(make_config, out, train__max_steps=2))
    real_load = torch.load
    seen = []

    def only_weights(*args, **kwargs):
        assert kwargs.get("weights_only") is True, "torch.load without weights_only=True"
        seen.append(args[0])
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", only_weights)
    train(_job(make_config, out, train__max_steps=4), resume="auto")
    assert any("optimizer" in str(path) for path in seen) and any("random_states" in str(path) for path in seen)


def test_no_unsafe_torch_load_in_the_library():
    offenders = []
    for path in (REPO / "difftune").rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if re.search(r"torch\.load\(", line) and "weights_only=True" not in line:
                offenders.append(f"{path.relative_to(REPO)}:{number}")
    assert offenders == []


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_is_bit_identical(tmp_path):
    common = [
        sys.executable,
        "-m",
        "difftune.cli",
        "train",
        "--config",
        "configs/tiny_lora.toml",
        "train.max_steps=60",
        "checkpoint.every_steps=5",
        "sample.prompts=[]",
        "log.progress_bar=false",
        "log.tensorboard=false",
    ]
    whole, killed = run_whole_killed_and_resumed(common, tmp_path, kill_at_rows=22, steps=60)
    assert _losses(killed) == _losses(whole)
    assert _same_files(whole / "pytorch_lora_weights.safetensors", killed / "pytorch_lora_weights.safetensors")


def _bad_image_folder(folder: Path) -> dict[str, str]:
    """One image of each awkward kind, captioned; returns the files expected to be left out, with a reason word."""
    from PIL import Image

    folder.mkdir()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(folder / "good.png")
    Image.new("CMYK", (32, 32), (255, 0, 0, 0)).save(folder / "cmyk.jpg")
    Image.fromarray(np.full((32, 32), 65535, dtype=np.uint16)).save(folder / "gray16.png")
    palette = Image.new("P", (32, 32), 1)
    palette.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    palette.info["transparency"] = 0
    palette.paste(0, (0, 0, 16, 32))
    palette.save(folder / "palette.png", transparency=0)
    rgba = Image.new("RGBA", (32, 32), (0, 0, 255, 255))
    rgba.paste((0, 0, 0, 0), (0, 0, 16, 32))
    rgba.save(folder / "rgba.png")
    Image.new("LA", (32, 32), (100, 0)).save(folder / "la.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    Image.new("RGB", (48, 32), (0, 200, 0)).save(folder / "exif.jpg", exif=exif)
    (folder / "empty.png").write_bytes(b"")
    (folder / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    Image.new("RGB", (64, 64), (9, 9, 9)).save(folder / "whole.png")
    (folder / "truncated.png").write_bytes((folder / "whole.png").read_bytes()[:-40])
    (folder / "whole.png").unlink()
    Image.new("RGB", (8, 8)).save(folder / "tiny.png")
    Image.new("RGB", (120, 120)).save(folder / "bomb.png")
    (folder / "gone.png").symlink_to(folder / "deleted-since.png")
    (folder / "loop.png").symlink_to(folder / "loop.png")
    frames = [Image.new("RGB", (32, 32), (120 * i, 0, 0)) for i in range(3)]
    for animated in ("animated.gif", "animated.webp"):
        frames[0].save(folder / animated, save_all=True, append_images=frames[1:])
    frames[0].save(folder / "still.gif")  # a GIF of one frame is an image like any other: trained
    for image in folder.iterdir():
        image.with_suffix(".txt").write_text(f"a {image.stem}")
    return {
        "empty.png": "empty",
        "corrupt.png": "decoded",
        "truncated.png": "truncated",
        "tiny.png": "smaller",
        "bomb.png": "max_image_pixels",
        "gone.png": "a symbolic link to",
        "loop.png": "leads back to itself",
        "animated.gif": "animated (3 frames)",
        "animated.webp": "animated (3 frames)",
    }


def test_bad_images_are_left_out_and_reported(make_config, tmp_path):
    folder = tmp_path / "images"
    expected_bad = _bad_image_folder(folder)
    config = make_config(data__path=str(folder), data__max_image_pixels=10_000, train__max_steps=2)
    train(config)
    report = [json.loads(line) for line in (tmp_path / "run" / "bad_files.jsonl").read_text().splitlines()]
    assert sorted(Path(r["file"]).name for r in report) == sorted(expected_bad)
    for record in report:
        assert expected_bad[Path(record["file"]).name] in record["reason"], record
    trained = {example.path.name for example in scan_examples(config.data)[0]}
    assert {"still.gif", "good.png", "cmyk.jpg"} <= trained


@pytest.mark.parametrize("file_name", ["../outside.png", "/etc/outside.png", "sub/../../outside.png"])
def test_metadata_file_names_stay_inside_the_data_folder(make_config, tmp_path, file_name):
    folder = tmp_path / "images"
    folder.mkdir()
    (folder / "metadata.jsonl").write_text(
        json.dumps({"file_name": "ok.png", "text": "a"})
        + "\n"
        + json.dumps({"file_name": file_name, "text": "b"})
        + "\n"
    )
    from PIL import Image

    Image.new("RGB", (32, 32)).save(folder / "ok.png")
    Image.new("RGB", (32, 32)).save(tmp_path / "outside.png")
    with pytest.raises(DifftuneError, match=rf"metadata\.jsonl:2: file_name '{re.escape(file_name)}' leads outside "):
        scan_examples(make_config(data__path=str(folder)).data)


def test_every_oversized_image_is_refused_when_checked_in_parallel(tmp_path):
    # The check runs in a thread pool; a limit enforced through warnings filters let some through.
    from PIL import Image

    from difftune.config import DataConfig
    from difftune.data.dataset import scan_examples

    for i in range(40):
        side = 120 if i % 2 else 64  # 14,400 pixels: over the limit, under PIL's own 2x refusal
        Image.new("RGB", (side, side), (i, 0, 0)).save(tmp_path / f"{i:02d}.png")
        (tmp_path / f"{i:02d}.txt").write_text("a square")
    examples, bad = scan_examples(DataConfig(path=str(tmp_path), max_image_pixels=10_000))
    assert sorted(int(b.path.stem) for b in bad) == list(range(1, 40, 2))
    assert all("max_image_pixels" in b.reason for b in bad)
    assert sorted(int(e.path.stem) for e in examples) == list(range(0, 40, 2))


def test_awkward_images_are_decoded_correctly(tmp_path):
    from difftune.config import DataConfig
    from difftune.data.dataset import open_image

    folder = tmp_path / "images"
    _bad_image_folder(folder)
    config = DataConfig(path=str(folder), alpha_background=(0, 255, 0))

    def pixel(name, xy=(24, 16)):
        image = open_image(folder / name, config)
        assert image.mode == "RGB"
        return image.getpixel(xy)

    assert pixel("gray16.png") == (255, 255, 255)  # scaled from 16 bits, not clipped
    assert pixel("rgba.png", (4, 4)) == (0, 255, 0) and pixel("rgba.png") == (0, 0, 255)  # alpha onto the background
    assert pixel("palette.png", (4, 4)) == (0, 255, 0) and pixel("palette.png") == (255, 0, 0)
    assert pixel("la.png", (4, 4)) == (0, 255, 0)  # fully transparent gray
    cyan = pixel("cmyk.jpg")
    assert cyan[0] < 40 and cyan[1] > 200 and cyan[2] > 200
    assert open_image(folder / "exif.jpg", config).size == (32, 48)  # orientation applied


def test_a_caption_that_is_a_folder_is_named_not_trained_uncaptioned(make_config, shapes, tmp_path):
    """With `missing_caption = "empty"` an image whose caption "file" was a folder trained as uncaptioned, silently; it
    is left out and named in bad_files.jsonl."""
    folder = shutil.copytree(shapes, tmp_path / "images")
    first = sorted(folder.glob("*.txt"))[0]
    first.unlink()
    first.mkdir()
    examples, bad = scan_examples(make_config(data__path=str(folder), data__missing_caption="empty").data)
    assert [item.path for item in bad] == [first] and "its caption is not a file" in bad[0].reason
    assert first.with_suffix(".png") not in [example.path for example in examples] and len(examples) == 7


def test_an_all_bad_dataset_fails_before_training(make_config, tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    for name in ("a.png", "b.png"):
        (folder / name).write_bytes(b"not an image")
        (folder / name).with_suffix(".txt").write_text("x")
    with pytest.raises(DifftuneError, match=r"no usable image \(2 left out: a\.png: cannot be decoded"):
        train(make_config(data__path=str(folder)))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_batch_larger_than_the_data_is_refused_before_caching(make_config, tmp_path):
    """600,000 over 16 images trained (each image thousands of times in every batch): refused naming the key, the
    data and what fits, before any cache entry is written."""
    config = make_config(train__batch_size=600000, cache__latents=True, cache__dir=str(tmp_path / "cache"))
    with pytest.raises(
        DifftuneError,
        match=rf"^train\.batch_size 600000: a batch of 600000 is more than the data holds "
        rf"\(at most 8 images in {re.escape(config.data.path)}\); use at most 8, or repeat "
        rf"the data \(data\.repeats, or N_name folders\)$",
    ):
        train(config)  # from the folder's file names, before anything loads
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.safetensors"))
    # An unusable image lowers what the data holds below what the names promise: the run's own count refuses it.
    data = shutil.copytree(config.data.path, tmp_path / "data")
    next(data.glob("*.png")).write_bytes(b"not a png")
    with pytest.raises(
        DifftuneError, match=rf"a batch of 8 is more than the data holds \(7 images in {re.escape(str(data))}"
    ):
        train(make_config(train__batch_size=8, data__path=str(data), train__output_dir=str(tmp_path / "seven")))
    assert train(make_config(train__batch_size=8, train__max_steps=1)).losses  # the whole data in one batch trains


def test_a_checkpoint_with_relative_paths_from_before_resumes(make_config, tmp_path, monkeypatch):
    """Checkpoints written before paths were recorded absolute hold them relative to the working directory."""
    out = tmp_path / "run"
    config = _job(make_config, out, train__max_steps=4, ema__enabled=False)
    train(config)
    state_file = find_checkpoint(out, "auto") / checkpoint_module.STATE_FILE
    state = json.loads(state_file.read_text())
    monkeypatch.chdir(Path(config.model.base).parent)
    state["config"] = state["config"].replace(f'"{config.model.base}"', f'"{Path(config.model.base).name}"')
    assert Path(config.model.base).name in state["config"]
    state_file.write_text(json.dumps(state))
    train(_job(make_config, out, train__max_steps=6, ema__enabled=False), resume="auto")
    assert [row["step"] for row in read_metrics(out)] == list(range(1, 7))


# Corrupt checkpoints, two runs in one folder, resuming an older checkpoint.


def _flip_bytes(path: Path, count: int = 64) -> None:
    """`count` bytes inverted in the middle of the file: its size stays, its contents do not."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(255 - byte for byte in data[middle : middle + count])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage", ["flipped optimizer state", "flipped weights", "truncated", "empty", "garbage state"]
)
def test_a_damaged_checkpoint_is_never_trained_on(make_config, tmp_path, capsys, damage):
    """The newest checkpoint damaged: `--resume auto` names it and why, goes back to the one before and ends as the
    uninterrupted run does; the damaged one is set apart. Flipped bytes used to be trained on silently."""
    whole, out = tmp_path / "whole", tmp_path / "run"
    settings = {"checkpoint__keep_last": 5}
    train(_job(make_config, whole, **settings))
    train(_job(make_config, out, train__max_steps=6, **settings))
    newest = out / "checkpoints" / "step-000006"
    target = {
        "flipped optimizer state": newest / "accelerate" / "optimizer.bin",
        "flipped weights": newest / "trained.safetensors",
        "truncated": newest / "trained.safetensors",
        "empty": newest / "accelerate" / "optimizer.bin",
        "garbage state": newest / "state.json",
    }[damage]
    if damage.startswith("flipped"):
        _flip_bytes(target)
    elif damage == "truncated":
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    elif damage == "empty":
        target.write_bytes(b"")
    else:
        target.write_text("{not json")
    capsys.readouterr()
    with pytest.raises(
        DifftuneError,
        match=rf"--resume {re.escape(str(newest))}: the checkpoint fails its check \({target.relative_to(newest)}",
    ):
        find_checkpoint(out, str(newest))
    train(_job(make_config, out, **settings), resume="auto")
    said = capsys.readouterr().out
    assert f"checkpoint {newest} fails its check ({target.relative_to(newest)}" in said
    assert "resumed from" in said and "step-000004 at step 4" in said
    assert _losses(out) == _losses(whole)
    assert _same_files(whole / "pytorch_lora_weights.safetensors", out / "pytorch_lora_weights.safetensors")
    [retired] = (out / "retired").iterdir()
    assert (retired / "checkpoints" / "step-000006" / target.relative_to(newest)).is_file()


def test_when_no_checkpoint_passes_resume_stops_with_one_line(make_config, tmp_path):
    out = tmp_path / "run"
    train(_job(make_config, out, train__max_steps=4, ema__enabled=False))
    for checkpoint in complete_checkpoints(out):
        _flip_bytes(checkpoint / "trained.safetensors", 8)
    job = tmp_path / "job.toml"
    job.write_text(_job(make_config, out, ema__enabled=False).to_toml())
    run = subprocess.run(
        [sys.executable, "-m", "difftune.cli", "train", "--config", str(job), "--resume", "auto"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=600,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    [line] = [line for line in run.stderr.splitlines() if line.startswith("difftune: error:")]
    assert re.search(
        r"no checkpoint in .*checkpoints passes its check \(step-000004: trained\.safetensors's contents differ "
        r"from when it was written \(SHA-256\); step-000002: .*\); start anew",
        line,
    ), line


def _manifest(checkpoint: Path) -> dict:
    return json.loads((checkpoint / checkpoint_module.MANIFEST).read_text())


def _rewrite_manifest(checkpoint: Path, change) -> None:
    manifest = _manifest(checkpoint)
    change(manifest)
    (checkpoint / checkpoint_module.MANIFEST).write_text(json.dumps(manifest))


def _drop_manifest(checkpoint: Path) -> None:
    """As difftune wrote checkpoints before they were sealed, or one whose manifest was lost: an empty marker."""
    (checkpoint / checkpoint_module.MANIFEST).unlink()
    (checkpoint / MARKER).write_text("")


_MANIFEST_DAMAGE = {  # what a held-back pass did to manifests -> the problem `verify` names
    "no files listed": (
        lambda c: _rewrite_manifest(c, lambda m: m.update(files={})),
        "manifest.json does not cover accelerate/",
    ),
    "one file left out": (
        lambda c: _rewrite_manifest(c, lambda m: m["files"].pop("trained.safetensors")),
        "manifest.json does not cover trained.safetensors",
    ),
    "no manifest, empty marker": (_drop_manifest, "manifest.json is missing"),
    "files a list": (
        lambda c: _rewrite_manifest(c, lambda m: m.update(files=list(m["files"]))),
        "manifest.json is malformed (files is a list, not a mapping)",
    ),
    "a size as a string": (
        lambda c: _rewrite_manifest(c, lambda m: m["files"]["state.json"].update(bytes="12")),
        "manifest.json is malformed (the size of state.json is '12')",
    ),
    "a zero block size": (
        lambda c: _rewrite_manifest(c, lambda m: m.update(block_bytes=0)),
        "manifest.json is malformed (block_bytes is 0)",
    ),
    "a misspelt key": (
        lambda c: _rewrite_manifest(
            c, lambda m: m["files"]["state.json"].update(sha265=m["files"]["state.json"].pop("sha256"))
        ),
        "manifest.json is malformed (the record of state.json)",
    ),
    "a name out of the folder": (
        lambda c: _rewrite_manifest(c, lambda m: m["files"].update({"../../x": m["files"]["state.json"]})),
        "manifest.json is malformed (file name '../../x')",
    ),
    "not an object": (
        lambda c: (c / checkpoint_module.MANIFEST).write_text("[1, 2]"),
        "manifest.json is malformed (keys list, not block_bytes and files)",
    ),
}


@pytest.fixture(scope="module")
def sealed_checkpoint(tmp_path_factory, tiny_base, shapes):
    """One real checkpoint, copied for each damage (training once for all of them)."""
    from difftune.config import load_config

    out = tmp_path_factory.mktemp("sealed") / "run"
    train(
        load_config(
            None,
            [
                f"model.base={tiny_base}",
                f"data.path={shapes}",
                "data.resolution=32",
                "data.num_workers=0",
                f"train.output_dir={out}",
                "train.max_steps=2",
                "train.batch_size=2",
                "adapter.rank=4",
                "log.progress_bar=false",
                "log.tensorboard=false",
                "train.check_memory=false",
                "cache.latents=false",
                "cache.text=false",
                "sample.prompts=[]",
            ],
        )
    )
    return complete_checkpoints(out)[-1]


@pytest.mark.parametrize("damage", list(_MANIFEST_DAMAGE))
def test_a_checkpoint_whose_manifest_lies_fails_its_check(sealed_checkpoint, tmp_path, damage):
    """Every way a held-back pass broke a manifest is named as a damaged checkpoint (it used to be resumed from, the
    damaged weights trained on, or a traceback); the intact copy passes."""
    checkpoint = tmp_path / "step-000002"
    shutil.copytree(sealed_checkpoint, checkpoint)
    assert checkpoint_module.verify(checkpoint) is None
    spoil, problem = _MANIFEST_DAMAGE[damage]
    spoil(checkpoint)
    assert (checkpoint_module.verify(checkpoint) or "").startswith(problem), checkpoint_module.verify(checkpoint)
    with pytest.raises(DifftuneError, match=rf"the checkpoint fails its check \({re.escape(problem)}"):
        find_checkpoint(tmp_path, str(checkpoint))


@pytest.mark.parametrize("damage", ["no files listed", "no manifest, empty marker"])
def test_a_checkpoint_without_a_covering_manifest_is_passed_over(make_config, tmp_path, capsys, damage):
    """The newest checkpoint's manifest covers nothing (or is gone) and its weights are damaged: `--resume auto`
    falls back to the one before and ends as the uninterrupted run (it used to train on the damaged weights)."""
    whole, out = tmp_path / "whole", tmp_path / "run"
    train(_job(make_config, whole, ema__enabled=False))
    train(_job(make_config, out, train__max_steps=6, ema__enabled=False))
    newest = out / "checkpoints" / "step-000006"
    _flip_bytes(newest / "trained.safetensors")
    _MANIFEST_DAMAGE[damage][0](newest)
    capsys.readouterr()
    train(_job(make_config, out, ema__enabled=False), resume="auto")
    said = capsys.readouterr().out
    assert f"checkpoint {newest} fails its check ({_MANIFEST_DAMAGE[damage][1]}" in said
    assert "step-000004 at step 4" in said
    assert _losses(out) == _losses(whole)
    assert _same_files(whole / "pytorch_lora_weights.safetensors", out / "pytorch_lora_weights.safetensors")


@pytest.mark.parametrize("points_to", ["another step", "outside the run"])
def test_a_linked_checkpoint_folder_is_neither_resumed_nor_pruned(make_config, tmp_path, points_to):
    """A `step-N` that is a symbolic link: the pruning of old checkpoints used to crash on it (`Cannot call rmtree on
    a symbolic link`), on that resume and the next. It is not a checkpoint of this run: never taken, never deleted
    through, and what it points to is untouched."""
    whole, out = tmp_path / "whole", tmp_path / "run"
    settings = {"ema__enabled": False, "checkpoint__keep_last": 1}
    train(_job(make_config, whole, **settings))
    train(_job(make_config, out, train__max_steps=4, **settings))
    target = out / "checkpoints" / "step-000004"
    if points_to == "outside the run":
        target = shutil.copytree(target, tmp_path / "elsewhere")
    link = out / "checkpoints" / "step-000100"
    link.symlink_to(target)
    assert find_checkpoint(out, "auto").name == "step-000004"
    train(_job(make_config, out, train__max_steps=6, **settings), resume="auto")
    train(_job(make_config, out, **settings), resume="auto")
    [retired] = (out / "retired").iterdir()  # the link is set apart with what came after step 4, as its name says
    moved = retired / "checkpoints" / "step-000100"
    assert moved.is_symlink() and os.readlink(moved) == str(target)
    if points_to == "outside the run":
        assert checkpoint_module.verify(target) is None
    assert _losses(out) == _losses(whole)
    assert [path.name for path in complete_checkpoints(out)] == ["step-000008"]


def test_a_linked_checkpoint_at_a_step_the_run_saves_is_replaced_not_followed(make_config, tmp_path):
    """`checkpoints/step-000006` a link to a folder elsewhere: `--resume auto` passes over it to step 4, trains on, and
    its save at step 6 replaces the link (it died there: `Cannot call rmtree on a symbolic link`); the run ends as the
    uninterrupted one, and the folder elsewhere is untouched."""
    whole, out = tmp_path / "whole", tmp_path / "run"
    settings = {"ema__enabled": False}
    train(_job(make_config, whole, **settings))
    train(_job(make_config, out, train__max_steps=4, **settings))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    (out / "checkpoints" / "step-000006").symlink_to(elsewhere, target_is_directory=True)
    train(_job(make_config, out, **settings), resume="auto")
    saved = out / "checkpoints" / "step-000006"
    assert not saved.is_symlink() and checkpoint_module.verify(saved) is None
    assert sorted(path.name for path in elsewhere.iterdir()) == ["keep.txt"]
    assert _losses(out) == _losses(whole)
    assert _same_files(whole / "pytorch_lora_weights.safetensors", out / "pytorch_lora_weights.safetensors")


@pytest.mark.parametrize("folder", ["checkpoints", "requests", "samples"])
def test_a_run_folder_that_is_a_link_is_refused_by_name(make_config, tmp_path, folder):
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    out.mkdir()
    (out / folder).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(DifftuneError, match=f"its {folder}/ is a symbolic link .* must be a real folder"):
        train(_job(make_config, out, train__max_steps=2))
    assert list(elsewhere.iterdir()) == []


def test_a_link_planted_as_the_lock_file_is_replaced_not_written_through(make_config, tmp_path):
    out, elsewhere = tmp_path / "run", tmp_path / "passwords"
    elsewhere.write_text("secret")
    out.mkdir()
    (out / ".difftune.lock").symlink_to(elsewhere)
    train(_job(make_config, out, train__max_steps=2))
    assert elsewhere.read_text() == "secret" and not (out / ".difftune.lock").is_symlink()


_HOLD_THE_FOLDER = """
import sys
from difftune.config import load_config
from difftune.training.train import train

train(load_config(sys.argv[1]))
"""


def test_two_runs_never_share_a_folder(make_config, tmp_path):
    """A running job holds its folder: a second fresh run and a `--resume auto` are refused naming it, and once the
    holder is SIGKILLed the folder is free again (the kernel drops the lock with the process)."""
    out = tmp_path / "run"
    job = tmp_path / "job.toml"
    job.write_text(
        _job(make_config, out, train__max_steps=100000, checkpoint__every_steps=5, ema__enabled=False).to_toml()
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_THE_FOLDER, str(job)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        deadline = time.time() + 300
        while not complete_checkpoints(out) and holder.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert complete_checkpoints(out), "the holding run wrote no checkpoint"
        for resume in (None, "auto"):
            with pytest.raises(
                DifftuneError,
                match=rf"train.output_dir {re.escape(str(out))}: another run is using this "
                rf"folder \(pid {holder.pid} on ",
            ):
                train(_job(make_config, out, train__overwrite=True, ema__enabled=False), resume=resume)
    finally:
        holder.kill()
        holder.wait()
    reached = checkpoint_module.step_of(find_checkpoint(out, "auto"))
    result = train(
        _job(make_config, out, train__max_steps=reached + 2, checkpoint__every_steps=5, ema__enabled=False),
        resume="auto",
    )
    assert len(result.losses) == 2


_HOLD_AND_FORK = """
import os, sys, time
from difftune.training.output_lock import hold_output_dir

with hold_output_dir(sys.argv[1]):
    started = sys.argv[1] + ".child-started"
    if os.fork() == 0:  # as a data-loader worker: forked while the folder is held, outliving its parent a while
        open(started, "w").close()  # running its own code: past the fork hooks, as a worker reading data is
        time.sleep(3)
        os._exit(0)
    while not os.path.exists(started):  # under load the child may not have run at all yet
        time.sleep(0.01)
    os._exit(0)  # the holder dies, without letting go; the child lives on
"""


def test_a_killed_runs_forked_workers_do_not_keep_its_folder_locked(tmp_path):
    """A flock belongs to the open file, which a process forked during the run (a loader worker) would share: the
    child drops its copy, so the folder is free the moment the holder dies, while the child still runs."""
    import fcntl

    out = tmp_path / "run"
    subprocess.run([sys.executable, "-c", _HOLD_AND_FORK, str(out)], cwd=REPO, check=True, timeout=60)
    folder = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free at once: no BlockingIOError
        fcntl.flock(folder, fcntl.LOCK_UN)
    finally:
        os.close(folder)
    started = time.monotonic()
    with hold_output_dir(out):
        assert json.loads((out / ".difftune.lock").read_text())["pid"] == os.getpid()
    assert time.monotonic() - started < 2  # the child sleeps 3 s: nothing waited for it


_HOLD_A_WHILE = """
import sys, time
from difftune.training.output_lock import hold_output_dir

with hold_output_dir(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def test_the_folder_stays_held_when_its_lock_record_is_deleted_or_replaced(tmp_path):
    """The hold is on the folder itself: with `.difftune.lock` deleted (or replaced by another file) while a run holds
    the folder, a second run is still refused. Locking the file let the second run lock its new one and train beside
    the first, retiring its newest metrics line."""
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_A_WHILE, str(out)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        (out / ".difftune.lock").unlink()
        with pytest.raises(
            DifftuneError,
            match=r"another run is using this folder \(a process whose \.difftune\.lock "
            r"record is missing or unreadable\)",
        ):
            with hold_output_dir(out):
                pass
        (out / ".difftune.lock").write_text("{}")
        with pytest.raises(DifftuneError, match="another run is using this folder"):
            with hold_output_dir(out):
                pass
    finally:
        holder.kill()
        holder.wait()
    with hold_output_dir(out):  # free once the holder is gone
        assert json.loads((out / ".difftune.lock").read_text())["pid"] == os.getpid()


def test_resuming_an_older_checkpoint_starts_a_branch_that_auto_resume_follows(make_config, tmp_path):
    """From step 8 of a 12-step run with another learning rate: the old branch's later checkpoints, snapshots and
    metrics lines are set apart, so `--resume auto` afterwards takes the new branch's step 10, not the old step 12."""
    out = tmp_path / "run"
    settings = {"checkpoint__keep_last": 10, "ema__enabled": False, "export__every_steps": 2}
    train(_job(make_config, out, train__max_steps=12, **settings))
    first = _losses(out)
    branch = _job(make_config, out, train__max_steps=10, optim__learning_rate=5e-4, **settings)
    train(branch, resume=str(out / "checkpoints" / "step-000008"))
    assert [path.name for path in complete_checkpoints(out)][-2:] == ["step-000008", "step-000010"]
    newest = find_checkpoint(out, "auto")
    assert (
        newest.name == "step-000010"
        and "learning_rate = 0.0005" in json.loads((newest / "state.json").read_text())["config"]
    )
    assert sorted(path.name for path in (out / "snapshots").glob("step-*"))[-1] == "step-000010.safetensors"
    [retired] = (out / "retired").iterdir()
    assert sorted(path.name for path in (retired / "checkpoints").iterdir()) == ["step-000010", "step-000012"]
    assert sorted(path.name for path in (retired / "snapshots").iterdir()) == [
        "step-000010.safetensors",
        "step-000012.safetensors",
    ]
    assert [row["step"] for row in read_metrics(retired)] == [9, 10, 11, 12]
    assert [read_metrics(retired)[0]["loss"]] == [first[9]]
    losses = _losses(out)
    assert list(losses) == list(range(1, 11)) and all(losses[step] == first[step] for step in range(1, 9))


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs (mounting needs root; CI runs as root): a real full disk, not a mocked error."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16M", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): the full-disk test needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_mid_checkpoint_says_so_and_what_is_intact(make_config, tmp_path, small_disk, monkeypatch):
    """The disk fills while the step-4 checkpoint is written: one line says so and that step 2's is intact (it used
    to be "RuntimeError: basic_ios::clear: iostream error"); the partial checkpoint is removed, and once there is
    room again the run resumes and ends as the uninterrupted one."""
    whole, out = tmp_path / "whole", small_disk / "run"
    settings = {"train__max_steps": 6, "ema__enabled": False, "sample__prompts": []}
    train(_job(make_config, whole, **settings))
    filler = small_disk / "filler"
    real_save = checkpoint_module.Checkpointer.save

    def fill_the_disk_first(self, progress, *args):
        if progress.global_step == 4:
            free = shutil.disk_usage(small_disk).free
            filler.write_bytes(b"\0" * (free - 16 * 1024))
        return real_save(self, progress, *args)

    monkeypatch.setattr(checkpoint_module.Checkpointer, "save", fill_the_disk_first)
    with pytest.raises(
        DifftuneError,
        match=rf"^no space left on {re.escape(str(out))}: the checkpoint at step 4 could not be "
        r"written \(its partial files are removed\); the checkpoint at step 2 is intact: "
        r"free some space, then continue with --resume auto$",
    ):
        train(_job(make_config, out, **settings))
    assert [path.name for path in (out / "checkpoints").iterdir()] == ["step-000002"]
    filler.unlink()
    monkeypatch.setattr(checkpoint_module.Checkpointer, "save", real_save)
    train(_job(make_config, out, **settings), resume="auto")
    assert _losses(out) == _losses(whole)
    assert _same_files(whole / "pytorch_lora_weights.safetensors", out / "pytorch_lora_weights.safetensors")


@pytest.mark.parametrize("write", ["preview samples", "adapter snapshot"])
def test_a_full_disk_between_checkpoints_says_so_and_what_is_intact(
    make_config, tmp_path, small_disk, monkeypatch, write
):
    """The disk fills while a preview sample or a snapshot is written, no checkpoint due: one line says so and
    that step 2's checkpoint is intact (it used to be a traceback, `OSError: [Errno 28]`); once there is room again
    the run resumes and ends as the uninterrupted one."""
    from difftune.adapters import export
    from difftune.training import train as train_module

    whole, out = tmp_path / "whole", small_disk / "run"
    settings = {
        "train__max_steps": 6,
        "ema__enabled": False,
        "sample__prompts": ["a red circle"],
        "sample__every_steps": 3,
        "sample__before": False,
        "sample__steps": 2,
        "sample__parity": False,
        "sample__images_per_prompt": 1,
        "export__every_steps": 3,
    }
    train(_job(make_config, whole, **settings))
    filler = small_disk / "filler"
    owner, name = {"preview samples": (train_module, "save_images"), "adapter snapshot": (export, "save_trained")}[
        write
    ]
    real = getattr(owner, name)

    def fill_the_disk_first(*args, **kwargs):
        if args[2].name.startswith("step-000003") and not filler.exists():
            filler.write_bytes(b"\0" * shutil.disk_usage(small_disk).free)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, fill_the_disk_first)
    with pytest.raises(
        DifftuneError,
        match=rf"^no space left on {re.escape(str(out))}( \(.* could not be written\))?; the "
        r"checkpoint at step 2 is intact: free some space, then continue with --resume auto$",
    ):
        train(_job(make_config, out, **settings))
    filler.unlink()
    monkeypatch.setattr(owner, name, real)
    train(_job(make_config, out, **settings), resume="auto")
    assert _losses(out) == _losses(whole)
    assert _same_files(whole / "pytorch_lora_weights.safetensors", out / "pytorch_lora_weights.safetensors")


def test_results_are_written_whole_or_not_at_all(make_config, tmp_path, monkeypatch):
    """The final adapter goes to a temporary name and is renamed into place: a write that dies half-way leaves the
    previous file (or none), never a truncated one under the final name."""
    from difftune.adapters import export

    out = tmp_path / "run"
    first = train(_job(make_config, out, train__max_steps=2, ema__enabled=False)).trained_path
    before = first.read_bytes()
    real_save_file = export.save_file

    def dies_half_way(tensors, path, *args, **kwargs):
        real_save_file(tensors, path, *args, **kwargs)
        Path(path).write_bytes(Path(path).read_bytes()[:100])
        raise OSError("killed half-way")

    monkeypatch.setattr(export, "save_file", dies_half_way)
    with pytest.raises(OSError, match="killed half-way"):
        train(_job(make_config, out, train__max_steps=4, ema__enabled=False), resume="auto")
    assert first.read_bytes() == before
    assert not list(out.glob(".*.tmp"))


def test_a_run_whose_every_step_was_skipped_does_not_end_as_if_it_trained(make_config, tmp_path, monkeypatch):
    """Every step judged unfit (a dataset's `loss_weight = inf` did it: every loss non-finite) ended in exit 0 with
    an untrained adapter written; now it stops with one line and writes no result."""
    from difftune.training.guard import Guard

    judge = Guard.judge
    monkeypatch.setattr(Guard, "judge", lambda self, step, loss, *rest, **kw: judge(self, step, math.nan, *rest, **kw))
    out = tmp_path / "run"
    with pytest.raises(DifftuneError, match="every one of the run's 3 optimizer steps was skipped"):
        train(_job(make_config, out, train__max_steps=3, guard__max_consecutive_skips=10, checkpoint__every_steps=0))
    assert not (out / "pytorch_lora_weights.safetensors").exists()


def test_a_writer_thread_that_finds_the_disk_full_prints_no_traceback(tmp_path, monkeypatch):
    """TensorBoard's writer thread met the full disk first and printed its traceback just before the run's one line;
    inside the run's guard a thread's out-of-space error is left to that line, and any other error still reaches the
    hook that prints it."""
    import errno
    import threading

    shown = []
    monkeypatch.setattr(threading, "excepthook", lambda args: shown.append(type(args.exc_value).__name__))

    def raising(error):
        def fail():
            raise error

        thread = threading.Thread(target=fail, name="EventFileWriter")
        thread.start()
        thread.join()

    with checkpoint_module.full_disk_said_plainly(tmp_path):
        raising(OSError(errno.ENOSPC, "No space left on device"))
        raising(ValueError("something else"))
    raising(OSError(errno.ENOSPC, "No space left on device"))  # outside a run: as before
    assert shown == ["ValueError", "OSError"]


@pytest.mark.parametrize(
    "name", ["metrics.jsonl", "config.toml", "skipped_steps.jsonl", "parity.json", "pytorch_lora_weights.safetensors"]
)
def test_a_link_planted_where_a_run_writes_leaves_its_target_untouched(make_config, tmp_path, name):
    """A file of the run's folder planted as a link to a file elsewhere, before a fresh run or a resume: each write
    replaces the link (or writes beside it), never what it points to (metrics.jsonl's lines were appended there)."""
    out, elsewhere = tmp_path / "run", tmp_path / "passwords"
    elsewhere.write_text("secret")
    out.mkdir()
    (out / name).symlink_to(elsewhere)
    train(_job(make_config, out, train__max_steps=2, train__overwrite=True))
    (out / name).unlink(missing_ok=True)
    (out / name).symlink_to(elsewhere)
    train(_job(make_config, out, train__max_steps=4), resume="auto")
    assert elsewhere.read_text() == "secret"
    assert [row["step"] for row in read_metrics(out)][-1] == 4
