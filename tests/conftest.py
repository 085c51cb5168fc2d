"""Fixtures: tiny SD, SDXL and Flux pipelines and captioned images built here, on the CPU, with no downloads."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

# The suite runs on two pytest-xdist workers (pyproject's addopts; CI has two cores), a test file each at a time
# (`--dist loadfile`: a module's fixtures, such as the quality jobs' pool, are made once): most tests drive micro
# models, whose work is Python's more than the math's, so one process a core finishes the suite in about 0.6 of the
# time one process on both takes. Each worker (and every process its tests start) computes on one thread: two workers
# of two threads each would fight over the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"  # read as torch starts, here and in the subprocesses the tests launch
# Memory plans are traced afresh in every test (and its subprocesses): a plan kept between runs is keyed by the
# settings and sources, not by what a test monkeypatches (tests/test_plan.py checks the keeping on its own).
os.environ["DIFFTUNE_PLAN_CACHE"] = "off"

import torch  # noqa: E402

from difftune.config import load_config
from difftune.families import FAMILIES
from difftune.toy.micro import build_pipeline
from difftune.toy.tiny import recolor_pairs, shape_images, write_caption_folder, write_pair_folder

REPO = Path(__file__).resolve().parents[1]


def script_module(name: str):
    """`scripts/<name>.py` imported as a module (the scripts are not a package), for testing its functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A loopback port nobody listens on now (for a server or a rendezvous a test starts)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(script: str, processes: int = 2) -> list[str]:
    """`torchrun` starting `processes` copies of `script`, meeting on a free port: tests on the other worker may run
    torchrun at the same time, and its default port is one for all."""
    return [
        shutil.which("torchrun") or "torchrun",
        f"--nproc_per_node={processes}",
        f"--master_port={free_port()}",
        script,
    ]


def run_in_repo(args, extra_env=None) -> subprocess.CompletedProcess:
    """A command run from the repository root, offline (the default jobs need no network), output captured."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)


def run_whole_killed_and_resumed(
    command: list[str], tmp_path: Path, kill_at_rows: int, steps: int
) -> tuple[Path, Path]:
    """A training command (without `train.output_dir`) run through into tmp_path/whole, and again into tmp_path/killed,
    killed with SIGKILL once its metrics log holds `kill_at_rows` rows, then resumed there with `--resume auto` (from
    the newest checkpoint, as its output says). Returns both folders."""
    import signal
    import time

    from difftune.training.checkpoint import find_checkpoint
    from difftune.training.metrics import read_metrics

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    finished = subprocess.run(
        [*command, f"train.output_dir={whole}"], cwd=REPO, env=env, capture_output=True, timeout=600
    )
    assert finished.returncode == 0, finished.stderr[-2000:]
    process = subprocess.Popen(
        [*command, f"train.output_dir={killed}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        if (killed / "metrics.jsonl").exists() and len(
            (killed / "metrics.jsonl").read_text().splitlines()
        ) >= kill_at_rows:
            break
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert kill_at_rows <= len(read_metrics(killed)) < steps, "the run was not killed mid-way"
    resume_point = find_checkpoint(killed, "auto").name
    resumed = subprocess.run(
        [*command, f"train.output_dir={killed}", "--resume", "auto"],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {killed / 'checkpoints' / resume_point}" in resumed.stdout.decode()
    return whole, killed


@pytest.fixture(scope="session")
def micro_base(tmp_path_factory):
    """Every test's micro base: `micro_base("flux", seed=2)` is that family's random-init micro pipeline folder (fp32,
    `toy.micro.build_pipeline`), built on first use and shared by the session."""
    built: dict[tuple, Path] = {}

    def folder(family: str = "sd", seed: int = 1, guidance: bool = False) -> Path:
        key = (family, seed, guidance)
        if key not in built:
            built[key] = tmp_path_factory.mktemp(f"micro-{family}")
            FAMILIES[family].loading.save_pipeline(
                build_pipeline(seed=seed, family=family, guidance=guidance), built[key]
            )
        return built[key]

    return folder


@pytest.fixture(scope="session")
def tiny_base(micro_base) -> Path:
    """The micro SD 1.x pipeline most tests train."""
    return micro_base("sd")


@pytest.fixture(scope="session")
def tiny_sdxl_base(micro_base) -> Path:
    return micro_base("sdxl")


@pytest.fixture(scope="session")
def tiny_flux_base(micro_base) -> Path:
    """Micro Flux, no guidance embedding."""
    return micro_base("flux")


@pytest.fixture(scope="session")
def kontext_base(micro_base) -> Path:
    """Micro FLUX.1 Kontext, an edit base."""
    return micro_base("flux_kontext")


@pytest.fixture(scope="session")
def shapes(tmp_path_factory) -> Path:
    """Eight captioned 32 px images in kohya layout."""
    path = tmp_path_factory.mktemp("shapes")
    write_caption_folder(path, shape_images(8, seed=3))
    return path


@pytest.fixture
def pairs(tmp_path) -> Path:
    """Six recolor pairs (32 px) in the control-folder layout."""
    write_pair_folder(tmp_path / "pairs", recolor_pairs(6, seed=0))
    return tmp_path / "pairs"


def edit_settings(base: Path, data: Path, out: Path, **overrides) -> dict:
    """`make_config` overrides of an edit job: `base` trained on the pairs in `data`, transformer only, no samples."""
    return {
        "model__base": str(base),
        "data__path": str(data),
        "train__output_dir": str(out),
        "adapter__text_encoder": False,
        "sample__prompts": [],
        **overrides,
    }


def drawn_edit_settings(base: Path, pairs: Path, out: Path) -> tuple[dict, Path]:
    """`edit_settings` of a 2-step job whose one sample is the instruction "make it purple" on the pairs' first control
    (3 unguided steps), to compare with its pipeline's drawing; and that control."""
    control = pairs / "control" / "0000.png"
    settings = edit_settings(
        base,
        pairs,
        out,
        train__max_steps=2,
        optim__learning_rate=2e-2,
        sample__prompts=[{"prompt": "make it purple", "controls": [str(control)]}],
        sample__steps=3,
        sample__guidance_scale=1.0,
    )
    return settings, control


@pytest.fixture
def make_config(tiny_base, shapes, tmp_path):
    """A fast job on the tiny base; keyword overrides as {"section.key": value}."""

    def make(**overrides):
        base = {
            "model.base": str(tiny_base),
            "data.path": str(shapes),
            "data.resolution": 32,
            "data.num_workers": 0,
            "train.output_dir": str(tmp_path / "run"),
            "train.max_steps": 3,
            "train.batch_size": 2,
            "adapter.rank": 4,
            "optim.learning_rate": 1e-3,
            "log.progress_bar": False,
            "log.tensorboard": False,
            "train.check_memory": False,  # the memory plan is tested on its own (test_plan.py)
            # Encoded every step unless a test turns a cache on: what most tests check is the uncached path.
            "cache.latents": False,
            "cache.text": False,
        }
        base.update({key.replace("__", "."): value for key, value in overrides.items()})
        return load_config(None, [f"{key}={_toml_value(value)}" for key, value in base.items()])

    return make


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):  # JSON strings, numbers and arrays of them are TOML; tables go inline
        return (
            "[" + ", ".join(_toml_value(item) if isinstance(item, dict) else json.dumps(item) for item in value) + "]"
        )
    if isinstance(value, dict):  # a prompt with controls
        return "{" + ", ".join(f"{key} = {json.dumps(item)}" for key, item in value.items()) + "}"
    return str(value)


def unet_inputs(unet, batch: int = 2, seed: int = 0):
    """Fixed random UNet inputs: (latents, timesteps, encoder_hidden_states)."""
    generator = torch.Generator().manual_seed(seed)
    size = unet.config.sample_size
    latents = torch.randn(batch, unet.config.in_channels, size, size, generator=generator)
    timesteps = torch.randint(0, 1000, (batch,), generator=generator)
    states = torch.randn(batch, 8, unet.config.cross_attention_dim, generator=generator)
    return latents, timesteps, states


# Families whose single file ComfyUI loads as its HunyuanVideo model, renaming Tencent's layers to that model's
# (Flux.1's layers: `img_attn_qkv` -> `img_attn.qkv`, `mlp.fc1` -> `mlp.0`; comfyui_lora.in_hunyuan_video_names) before
# its LoRA key map names them.
COMFYUI_HUNYUAN_VIDEO_MODEL = {
    "hunyuan_image",
    "hunyuan_video",
    "hunyuan_video15",
    "hunyuan_video15_i2v",
    "hunyuan_video_skyreels_i2v",
}


def comfyui_applies_as(lora: dict[str, torch.Tensor], base, expected) -> bool:
    """Whether ComfyUI's key maps (`comfyui_lora.py`, over the original single-file layout diffusers' reader reads)
    reach every key of the kohya-layout `lora` and its formula turns the loaded `base`'s weights (denoiser and adapted
    text encoders) into `expected`'s, a model holding the same change (asserted); False where the family has no
    single-file layout to hold ComfyUI's names. A model ComfyUI loads as its HunyuanVideo model is held in that
    model's names (`COMFYUI_HUNYUAN_VIDEO_MODEL`)."""
    from difftune.errors import DifftuneError

    from comfyui_lora import apply_lora, denoiser_weights, in_hunyuan_video_names, text_key_map, unet_key_map

    family = base.family

    def as_comfyui_holds(components) -> dict[str, torch.Tensor]:
        weights = denoiser_weights(family.layout.to_single_file(components))
        if family.name in COMFYUI_HUNYUAN_VIDEO_MODEL:
            weights = {in_hunyuan_video_names(key): value for key, value in weights.items()}
        return weights

    try:
        weights = as_comfyui_holds(base)
    except DifftuneError:
        return False
    modules = [key.removesuffix(".weight") for key in base.denoiser.state_dict() if key.endswith(".weight")]
    diffusers_names = (
        {diffusers: original for original, diffusers in family.layout.original_module_names(modules).items()}
        if family.denoiser_name == "unet"
        else {}
    )
    kinds = {"CLIP": "clip", "T5": "t5"}
    encoders = {
        part: (kind, base.text_encoders[part].state_dict())
        for part in family.targets.adapted_text_encoders()
        for kind in [next((k for m, k in kinds.items() if type(base.text_encoders[part]).__name__.startswith(m)), None)]
        if kind
    }
    texts = {(part, key): value for part, (_, state) in encoders.items() for key, value in state.items()}
    patched, not_in_denoiser = apply_lora(lora, unet_key_map(weights, diffusers_names), weights)
    patched_text, not_in_text = apply_lora(lora, text_key_map(encoders), texts)
    assert set(not_in_denoiser) & set(not_in_text) == set(), "lora key not loaded"
    assert any(not torch.equal(patched[key], weights[key]) for key in weights)
    ours = as_comfyui_holds(expected)
    for key in weights:
        torch.testing.assert_close(patched[key], ours[key], rtol=1e-5, atol=1e-6, msg=key)
    for (part, key), value in patched_text.items():
        torch.testing.assert_close(value, expected.text_encoders[part].state_dict()[key], rtol=1e-5, atol=1e-6, msg=key)
    return True
