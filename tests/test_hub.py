"""What a run leaves where people share models: the model card every run writes (read back by huggingface_hub's own
parser), `difftune push` (offline and without a token it fails in one line, before any upload, and changes nothing;
online, what it would upload is filtered by huggingface_hub's own pattern matching), and a Weights & Biases run (in
wandb's offline mode, its run file read back with wandb's own record schema)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import httpx
import pytest
from huggingface_hub import ModelCard, constants
from huggingface_hub.utils import filter_repo_objects
from wandb.proto import wandb_internal_pb2

from difftune import cli
from difftune.adapter_kinds import KINDS
from difftune.adapters import hub
from difftune.adapters.model_card import KIND_NAMES, card_data, write_model_card
from difftune.config import load_config
from difftune.families import FAMILIES
from difftune.training.metrics import read_metrics
from difftune.training.train import train

from conftest import _toml_value


def _listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        path.relative_to(folder).as_posix(): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in folder.rglob("*")
        if path.is_file()
    }


def _job(out: Path, base: Path, shapes: Path, **more) -> list[str]:
    overrides = {
        "model.base": str(base),
        "data.path": str(shapes),
        "data.resolution": 32,
        "data.num_workers": 0,
        "data.caption_prefix": "sks, ",
        "train.output_dir": str(out),
        "train.max_steps": 3,
        "train.batch_size": 2,
        "adapter.rank": 4,
        "log.progress_bar": False,
        "log.tensorboard": False,
        "train.check_memory": False,
        "sample.prompts": ["sks a purple circle"],
        "sample.steps": 2,
        **more,
    }
    return [f"{key}={_toml_value(value)}" for key, value in overrides.items()]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, micro_base, shapes) -> Path:
    """A 3-step LoRA run on the micro SD base with a trigger word and one end sample, told to push to the Hub while
    offline: it ends with its files and a warning."""
    out = tmp_path_factory.mktemp("hub") / "run"
    config = load_config(None, _job(out, micro_base("sd"), shapes, **{"export.push_to_hub": "someone/tiny-lora"}))
    offline = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        result = train(config)
    finally:
        constants.HF_HUB_OFFLINE = offline
    assert result.trained_path.is_file()
    return out


def test_every_run_writes_a_card_the_hub_parses(finished_run):
    card = ModelCard.load(finished_run / "README.md")
    assert card.data.base_model is None  # a local base names no hub repository
    assert card.data.library_name == "diffusers" and card.data.pipeline_tag == "text-to-image"
    assert {"difftune", "sd", "lora", "text-to-image", "template:sd-lora"} <= set(card.data.tags)
    assert card.data.instance_prompt == "sks"
    assert card.data.widget == [{"text": "sks a purple circle", "output": {"url": "samples/000.png"}}]
    assert (finished_run / "samples" / "000.png").is_file()
    for file in ("pytorch_lora_weights.safetensors", "run.safetensors"):
        assert (finished_run / file).is_file() and f"| `{file}` |" in card.text
    assert "pipeline.load_lora_weights" in card.text and "StableDiffusionPipeline" in card.text


def test_a_hub_base_is_the_cards_base_model_and_its_license_is_passed_on(tmp_path):
    family = FAMILIES["sdxl"]
    hub_config = load_config(None, ['model.base="stabilityai/stable-diffusion-xl-base-1.0"', 'adapter.kind="dora"'])
    data = card_data(hub_config, family, [])
    assert data.base_model == "stabilityai/stable-diffusion-xl-base-1.0" and "dora" in data.tags
    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: openrail++\n---\n# a base\n")
    full = load_config(None, [f'model.base="{base}"', 'adapter.kind="none"'])
    out = tmp_path / "out"
    out.mkdir()
    (out / "model").mkdir()
    card = ModelCard.load(write_model_card(full, family, {"model": [out / "model"]}, out))
    assert card.data.license == "openrail++" and card.data.base_model is None
    assert "full-fine-tune" in card.data.tags and "template:sd-lora" not in card.data.tags


def test_push_offline_or_without_a_token_fails_in_one_line_and_changes_nothing(
    finished_run, monkeypatch, capsys, tmp_path
):
    before = _listing(finished_run)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert cli.main(["push", str(finished_run), "someone/tiny-lora"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "offline (HF_HUB_OFFLINE is set)" in error
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
    assert cli.main(["push", str(finished_run), "someone/tiny-lora"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "not logged in to the Hugging Face Hub" in error
    assert _listing(finished_run) == before


def test_push_says_a_failed_upload_in_one_line(finished_run, monkeypatch, capsys):
    """The Hub unreachable: the connection's error, named in one line."""

    def unreachable(*args, **kwargs):
        raise httpx.ConnectError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setattr(hub, "create_repo", unreachable)
    assert cli.main(["push", str(finished_run), "someone/tiny-lora"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.splitlines() == [error] and error.endswith("Temporary failure in name resolution")


@pytest.mark.parametrize("with_checkpoints", [False, True])
def test_push_uploads_the_files_card_and_samples_and_keeps_checkpoints_back(
    finished_run, monkeypatch, with_checkpoints
):
    """What `upload_folder` is asked to send, filtered as huggingface_hub filters it."""
    asked = {}
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setattr(hub, "create_repo", lambda *args, **kwargs: None)

    class Commit:
        commit_url = "https://huggingface.co/someone/tiny-lora/commit/0"

    def upload_folder(**kwargs):
        asked.update(kwargs)
        return Commit()

    monkeypatch.setattr(hub, "upload_folder", upload_folder)
    assert hub.push(finished_run, "someone/tiny-lora", with_checkpoints=with_checkpoints) == Commit.commit_url
    files = sorted(_listing(finished_run))
    sent = set(filter_repo_objects(files, ignore_patterns=asked["ignore_patterns"]))
    assert {"README.md", "pytorch_lora_weights.safetensors", "run.safetensors", "samples/000.png"} <= sent
    checkpoints = {file for file in files if file.startswith("checkpoints/")}
    assert checkpoints and (checkpoints & sent) == (checkpoints if with_checkpoints else set())
    assert not any(file.startswith("logs/") or os.path.basename(file).startswith(".") for file in sent)


def test_push_refuses_a_folder_that_is_not_a_finished_run(tmp_path, capsys):
    assert cli.main(["push", str(tmp_path), "someone/tiny-lora"]) == 2
    assert "no README.md in" in capsys.readouterr().err


def test_every_adapter_kind_has_a_name_on_the_card():
    assert set(KIND_NAMES) == set(KINDS)


def _wandb_records(path: Path):
    """The records of a W&B run file: leveldb's log format (32 KiB blocks, each record's pieces behind a 7-byte
    header of checksum, length and kind: whole, first, middle, last) after the file's own 7-byte header, each record
    a `wandb_internal_pb2.Record`."""
    data, position, pieces = path.read_bytes(), 7, b""
    assert data.startswith(b":W&B")
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        _, length, kind = struct.unpack("<IHB", data[position : position + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):  # a block's padding
            position += left
            continue
        pieces += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            yield record
            pieces = b""


def test_a_wandb_offline_run_holds_the_loss_curve_the_config_and_the_samples(tmp_path, micro_base, shapes, monkeypatch):
    """`log.wandb` in wandb's offline mode: its run folder under logs/wandb holds every step's loss as metrics.jsonl
    has it, the run's config, and the sample grids (a preview and the end's) as images."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    train(load_config(None, _job(out, micro_base("sd"), shapes, **{"log.wandb": True, "sample.every_steps": 2})))
    (run_file,) = (out / "logs" / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = {}, {}
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(row["_step"], {}).update(row)
        elif kind == "config":
            config |= {item.key: json.loads(item.value_json) for item in record.config.update}
    losses = {row["step"]: row["loss"] for row in read_metrics(out) if "loss" in row}
    assert sorted(losses) == [1, 2, 3]
    assert {step: history[step]["loss"] for step in losses} == pytest.approx(losses)
    assert config["train.max_steps"] == 3 and config["adapter.rank"] == 4
    images = sorted(run_file.parent.glob("files/media/images/samples_*.png"))
    assert len(images) == 2 and [step for step, row in history.items() if "samples/filenames" in row] == [2, 3]
