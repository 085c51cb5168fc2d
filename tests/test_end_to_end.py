"""The README's promises, through the real entry points in subprocesses, on the bundled default job."""

import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
from diffusers import StableDiffusionPipeline
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from difftune.toy.family_jobs import FAMILY_CONFIGS, run_family_job
from difftune.training.metrics import read_metrics

from conftest import REPO, run_in_repo, torchrun

pytestmark = pytest.mark.slow


def _check_run_files(out, max_steps, images, before=False):
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    assert tomllib.loads((out / "config.toml").read_text())["train"]["max_steps"] == max_steps
    assert [row["step"] for row in read_metrics(out)] == list(range(1, max_steps + 1))
    expected = [f"{i:03d}.png" for i in range(images)] + ["grid.png"]
    assert sorted(p.name for p in (out / "samples").iterdir()) == sorted(expected + (["before"] if before else []))
    if before:
        assert sorted(p.name for p in (out / "samples" / "before").iterdir()) == expected
    assert list((out / "logs").rglob("events.out.tfevents.*"))


def test_accelerate_launch_runs_the_default_job(tmp_path):
    """`accelerate launch scripts/train.py --config configs/tiny_lora.toml`, as the README says, unchanged."""
    out = tmp_path / "tiny_lora"
    run = run_in_repo(
        [
            shutil.which("accelerate") or "accelerate",
            "launch",
            "--num_processes=1",
            "--num_machines=1",
            "--mixed_precision=no",
            "--dynamo_backend=no",
            "scripts/train.py",
            "--config",
            "configs/tiny_lora.toml",
            f"train.output_dir={out}",
        ]
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # Every long step says when it starts and how long it took, in order, and the parity check says its result.
    lines = run.stdout.replace(f"{REPO}/", "").splitlines()
    done = [line.removeprefix("difftune: ").split(": done in ")[0] for line in lines if ": done in " in line]
    assert done == [
        "loading the base models/tiny-sd",
        "reading the data in examples/purple",
        "filling the caches",
        "drawing the base's samples (before training)",
        "preparing the model for training",
        "training",
        "loading the encoders again for the end of the run",
        "saving the result",
        "drawing the end samples",
        "checking parity: the first sample redrawn with each written file",
    ], run.stdout
    assert [line.removesuffix(" ...") for line in lines if line.endswith(" ...")] == [
        f"difftune: {what}" for what in done
    ]
    assert re.search(r"^difftune: parity: \d+ levels in both layouts", run.stdout, re.MULTILINE), run.stdout
    assert "train: 100%" in run.stderr and "end samples" not in run.stderr  # the step bar in the log; no other bars
    # Nothing else on the screen: no third-party warning a newcomer could not act on (diffusers' guider notice).
    unexplained = [line for line in re.split(r"[\r\n]+", run.stderr) if line.strip() and not line.startswith("train: ")]
    assert unexplained == [], unexplained

    # The README's quick start shows this screen: the same lines, but for the times, paths and trained numbers.
    def shape(text: str) -> list[str]:
        text = text.replace(str(out), "/home/you/difftune/output/tiny_lora").replace(str(REPO), "/home/you/difftune")
        return [
            re.sub(r"\d", "#", re.sub(r"done in .*", "done in", line))
            for line in text.splitlines()
            if line.startswith("difftune: ")
        ]

    shown = re.search(
        r"\$ difftune train --config configs/tiny_lora\.toml\n(.*?)```", (REPO / "README.md").read_text(), re.S
    )
    assert shape(shown.group(1)) == shape(run.stdout)
    config = tomllib.loads((REPO / "configs/tiny_lora.toml").read_text())
    images = len(config["sample"]["prompts"]) * config["sample"]["images_per_prompt"]
    _check_run_files(out, config["train"]["max_steps"], images, before=True)
    losses = [row["loss"] for row in read_metrics(out)]
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    assert last < first, (first, last)

    # The adapter loads in diffusers onto the bundled base and changes its output.
    with safe_open(out / "pytorch_lora_weights.safetensors", framework="pt") as handle:
        assert tomllib.loads(handle.metadata()["difftune_config"])["train"]["output_dir"] == str(out)
    pipeline = StableDiffusionPipeline.from_pretrained(
        REPO / "models/tiny-sd", safety_checker=None, dtype=torch.float32
    )
    generator = torch.Generator().manual_seed(0)
    before = pipeline("a purple circle", num_inference_steps=3, generator=generator, output_type="np").images
    pipeline.load_lora_weights(out)
    generator = torch.Generator().manual_seed(0)
    after = pipeline("a purple circle", num_inference_steps=3, generator=generator, output_type="np").images
    assert abs(before - after).max() > 1e-3
    columns, rows = math.ceil(math.sqrt(images)), math.ceil(images / math.ceil(math.sqrt(images)))
    # The end-of-run grid's cells are before | after (the base's sample of the same number beside each), scaled to
    # 64 px panels under a band that names them; the base's own grid is its samples alone.
    with Image.open(out / "samples" / "before" / "grid.png") as grid:
        assert grid.size == (32 * columns, 32 * rows)
    shown_path = REPO / "docs" / "images" / "tiny_lora_grid.png"
    with Image.open(out / "samples" / "grid.png") as grid, Image.open(shown_path) as shown:
        band = grid.height // rows - 64
        assert grid.size == (128 * columns, (64 + band) * rows) and 10 <= band <= 20
        # The README shows this grid as the run writes it: its labels are these (the samples differ by CPU).
        assert shown.size == grid.size
        for row in range(rows):
            labels = (0, row * (64 + band), grid.width, row * (64 + band) + band)
            assert np.array_equal(np.asarray(grid.crop(labels)), np.asarray(shown.crop(labels)))
            assert np.asarray(grid.crop(labels)).min() < 100  # dark text on the white band


def test_difftune_command_with_overrides(tmp_path):
    out = tmp_path / "dora"
    run = run_in_repo(
        [
            sys.executable,
            "-m",
            "difftune.cli",
            "train",
            "--config",
            "configs/tiny_dora.toml",
            f"train.output_dir={out}",
            "train.max_steps=5",
            "sample.steps=2",
            'sample.prompts=["a red circle"]',
        ]
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"wrote {out / 'pytorch_lora_weights.safetensors'}" in run.stdout
    assert run.stdout.count(": done in ") == 10, run.stdout
    _check_run_files(out, 5, 1, before=True)
    with safe_open(out / "pytorch_lora_weights.safetensors", framework="pt") as handle:
        keys = list(handle.keys())
    assert any(k.startswith("text_encoder.") and k.endswith("lora_magnitude_vector.weight") for k in keys)
    assert any(k.startswith("unet.") and k.endswith("lora_magnitude_vector.weight") for k in keys)


def test_quiet_runs_say_only_warnings_errors_and_the_last_lines(tmp_path):
    out = tmp_path / "quiet"
    run = run_in_repo(
        [
            sys.executable,
            "-m",
            "difftune.cli",
            "train",
            "--quiet",
            "--config",
            "configs/tiny_lora.toml",
            f"train.output_dir={out}",
            "train.max_steps=2",
            "sample.steps=2",
            'sample.prompts=["a red circle"]',
        ]
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert " ..." not in run.stdout and "done in" not in run.stdout and "train:" not in run.stderr, (
        run.stdout + run.stderr
    )
    assert "difftune: parity: " in run.stdout and f"wrote {out / 'pytorch_lora_weights.safetensors'}" in run.stdout


def test_console_script_is_installed():
    run = subprocess.run([shutil.which("difftune") or "difftune", "train", "--help"], capture_output=True, text=True)
    assert run.returncode == 0
    # Short (it printed ~250 lines of descriptions): every key by section, and where their meanings and defaults are.
    assert "Config reference" in run.stdout and len(run.stdout.splitlines()) < 80
    train_keys = next(line for line in run.stdout.splitlines() if line.strip().startswith("[train]"))
    assert "max_steps" in train_keys and "[adapter] kind, rank" in run.stdout


@pytest.mark.parametrize(
    ("job", "result"),
    [
        ("tiny_lora", "pytorch_lora_weights.safetensors"),
        ("tiny_controlnet", "controlnet/diffusion_pytorch_model.safetensors"),  # the prepared ControlNet, not the UNet
    ],
)
def test_two_processes_match_one_with_the_same_global_batch(tmp_path, job, result):
    """DDP through accelerate (gloo on CPU): 2 x batch 4 trains exactly like 1 x batch 8."""
    common = ["--config", f"configs/{job}.toml", "train.max_steps=4", "sample.prompts=[]", "log.progress_bar=false"]
    one = run_in_repo(
        [sys.executable, "scripts/train.py", *common, f"train.output_dir={tmp_path / 'one'}", "train.batch_size=8"]
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_in_repo(
        [*torchrun("scripts/train.py"), *common, f"train.output_dir={tmp_path / 'two'}", "train.batch_size=4"],
        extra_env={"ACCELERATE_USE_CPU": "true"},
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 process(es)" in two.stdout
    losses_one = [row["loss"] for row in read_metrics(tmp_path / "one")]
    losses_two = [row["loss"] for row in read_metrics(tmp_path / "two")]
    assert losses_one == pytest.approx(losses_two, rel=1e-5)
    weights_one, weights_two = (load_file(tmp_path / run / result) for run in ("one", "two"))
    for key, value in weights_one.items():
        torch.testing.assert_close(weights_two[key], value, rtol=0, atol=1e-6)


def test_two_process_run_resumes_exactly(tmp_path):
    """Killed after its step-4 checkpoint (simulated by a shorter run), a 2-process run resumes where it stopped."""
    common = [
        "--config",
        "configs/tiny_lora.toml",
        "sample.prompts=[]",
        "log.progress_bar=false",
        "checkpoint.every_steps=2",
    ]
    one = run_in_repo(
        [
            sys.executable,
            "scripts/train.py",
            *common,
            f"train.output_dir={tmp_path / 'one'}",
            "train.batch_size=8",
            "train.max_steps=6",
        ]
    )
    assert one.returncode == 0, one.stderr[-3000:]
    launch = [
        *torchrun("scripts/train.py"),
        *common,
        f"train.output_dir={tmp_path / 'two'}",
        "train.batch_size=4",
    ]
    cpu = {"ACCELERATE_USE_CPU": "true"}
    first = run_in_repo([*launch, "train.max_steps=4"], extra_env=cpu)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_in_repo([*launch, "train.max_steps=6", "--resume", "auto"], extra_env=cpu)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 4" in resumed.stdout
    assert [row["loss"] for row in read_metrics(tmp_path / "two")] == pytest.approx(
        [row["loss"] for row in read_metrics(tmp_path / "one")], rel=1e-5
    )
    weights_one, weights_two = (
        load_file(tmp_path / run / "pytorch_lora_weights.safetensors") for run in ("one", "two")
    )
    for key, value in weights_one.items():
        torch.testing.assert_close(weights_two[key], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("model", ["tiny", "tiny-sdxl"])
def test_bench_prints_one_json_line_with_every_field(tmp_path, model):
    run = run_in_repo(
        [sys.executable, "scripts/bench.py", "--model", model, "--steps", "3", "--workdir", str(tmp_path)]
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for field in ("seconds_per_step", "samples_per_second", "peak_memory_bytes", "mfu", "device", "model", "batch"):
        assert field in result
    assert result["seconds_per_step"] > 0 and result["peak_memory_bytes"] > 10_000_000
    assert result["samples_per_second"] == pytest.approx(result["batch"] / result["seconds_per_step"])
    assert result["model"] == model and result["device"] == "cpu" and result["mfu"] is None


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_each_familys_shipped_job_runs_on_its_micro_model(family, tmp_path):
    """The config a family ships (configs/), as shipped but for the base, data, size and steps, trains its micro model
    on the purple set: validation rows at each quarter, and the adapter reloaded through the family's own pipeline
    draws the in-training sample exactly (bf16 and fp8 where the config sets them)."""
    row = run_family_job(family, tmp_path, steps=8)
    assert [step for step, _ in row["validation_loss"]] == [2, 4, 6, 8]
    assert all(math.isfinite(loss) for _, loss in row["validation_loss"])
    assert row["parity_max_pixel_difference"] == {"diffusers": 0, "kohya": 0}


def _readme_train_commands() -> list[list[str]]:
    """Every `difftune train ...` in the shell blocks of the README and the docs site's pages, as its words; a
    family's own page, whose commands are its real model's, left out (`test_plan` plans each shipped config)."""
    family_pages = set((REPO / "docs" / "families").glob("*.md")) - {REPO / "docs" / "families" / "index.md"}
    pages = [REPO / "README.md", *sorted(set((REPO / "docs").rglob("*.md")) - family_pages)]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", "\n".join(page.read_text(encoding="utf-8") for page in pages), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for command in line.split("&&"):
                if "difftune train" not in command:
                    continue
                words = shlex.split(command, comments=True)
                if words[:2] == ["difftune", "train"]:
                    commands.append(words[2:])
    return commands


README_TRAIN_COMMANDS = _readme_train_commands()


def test_the_readme_shows_train_commands_and_video_needs_no_extra():
    """The README's Wan command read clips after the README's plain install only with an extra: PyAV (and ftfy,
    which Wan's image-to-video pipeline calls) are core dependencies now."""
    assert any("configs/wan_lora.toml" in words for words in README_TRAIN_COMMANDS)
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert {re.split(r"[<>=;\s]", dependency)[0] for dependency in dependencies} >= {"av", "ftfy"}


@pytest.mark.parametrize("words", README_TRAIN_COMMANDS, ids=lambda words: " ".join(words))
def test_every_readme_train_command_runs_as_written(words, tmp_path, monkeypatch, capsys):
    """Each `difftune train` line of the README through the CLI's own entry, in the repository as a user runs it:
    on a bundled base a 2-step run of it (the line's own flags and overrides, a folder of its own), on a base or data
    to download (the lines showing s3:// or a user's folder) its config resolved."""
    from difftune.cli import main
    from difftune.config import load_config

    monkeypatch.chdir(REPO)
    config_path = words[words.index("--config") + 1]
    config = load_config(config_path, [word for word in words if "=" in word and not word.startswith("-")])
    on_this_machine = Path(config.model.base).is_dir() and Path(config.data.path).is_dir()
    if not on_this_machine:
        assert main(["config", *words]) == 0
        return
    few_steps = [
        "train.max_steps=2",
        "checkpoint.every_steps=0",
        f"train.output_dir={tmp_path / 'run'}",
        "sample.prompts=[]",
        "sample.before=false",
        "sample.parity=false",
        "validation.path=",
        "log.progress_bar=false",
        "log.tensorboard=false",
        "data.num_workers=0",
        "train.check_memory=false",
    ]
    after_config = words.index("--config") + 2  # overrides before any later flag, as argparse takes them
    assert main(["train", *words[:after_config], *few_steps, *words[after_config:]]) == 0, capsys.readouterr().err
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == [1, 2]
