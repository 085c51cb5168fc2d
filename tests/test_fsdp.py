"""Sharded training through accelerate's FSDP2: two CPU processes (gloo) train like one process with the same
global batch, write gathered checkpoints and exports, and resume exactly. accelerate enables FSDP only on
accelerator devices, so the runs go through tests/fsdp_cpu_launch.py (its docstring says what it switches)."""

import sys
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file

from difftune.config import load_config
from difftune.data.sharding import check_accelerator, check_config
from difftune.errors import DifftuneError
from difftune.training.metrics import read_metrics

from conftest import run_in_repo, torchrun

COMMON = [
    "--config",
    "configs/tiny_lora.toml",
    "sample.prompts=[]",
    "sample.before=false",
    "log.progress_bar=false",
    "data.num_workers=0",
    "adapter.text_encoder=false",
]


def _run(args, extra_env=None):
    run = run_in_repo(args, extra_env)
    # How far it got (the output's end) beside why it stopped (the errors' end)
    assert run.returncode == 0, run.stdout[-1500:] + run.stderr[-4000:]
    return run


def _one_process(out, *overrides):
    return _run(
        [sys.executable, "scripts/train.py", *COMMON, f"train.output_dir={out}", "train.batch_size=8", *overrides]
    )


def _fsdp(out, *overrides):
    run = _run(
        [
            *torchrun("tests/fsdp_cpu_launch.py"),
            "train",
            *COMMON,
            f"train.output_dir={out}",
            "train.batch_size=4",
            *overrides,
        ],
        {"ACCELERATE_USE_CPU": "true"},
    )
    assert "2 process(es)" in run.stdout
    return run


def _losses(out):
    return [row["loss"] for row in read_metrics(out)]


def _assert_same_tensors(expected: dict, actual: dict, atol: float):
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key].shape == value.shape, key
        torch.testing.assert_close(actual[key], value, rtol=0, atol=atol, msg=key)


@pytest.mark.slow
def test_fsdp_lora_trains_like_one_process_and_resumes_exactly(tmp_path):
    """LoRA on the UNet with EMA: 2 sharded processes x batch 4 give one process's batch-8 losses
    and adapter; the checkpoint holds gathered (full-shape) weights; killed after step 4 (a shorter run) and
    resumed, the sharded run ends where the uninterrupted one does."""
    settings = ["checkpoint.every_steps=2", "ema.enabled=true", "ema.decay=0.9"]
    _one_process(tmp_path / "one", "train.max_steps=6", *settings)
    _fsdp(tmp_path / "fsdp", "train.max_steps=4", *settings)
    step4 = "checkpoints/step-000004/trained.safetensors"
    _assert_same_tensors(load_file(tmp_path / "one" / step4), load_file(tmp_path / "fsdp" / step4), atol=1e-6)

    resumed = _fsdp(tmp_path / "fsdp", "train.max_steps=6", *settings, "--resume", "auto")
    assert "at step 4" in resumed.stdout
    assert _losses(tmp_path / "fsdp") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)
    for name in ("pytorch_lora_weights.safetensors", "pytorch_lora_weights_ema.safetensors"):
        _assert_same_tensors(load_file(tmp_path / "one" / name), load_file(tmp_path / "fsdp" / name), atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("job, denoiser", [("tiny_lora", "unet"), ("flux_lora", "transformer")], ids=["sd", "flux"])
def test_fsdp_full_fine_tune_saves_the_whole_model(tmp_path, job, denoiser):
    """A full fine-tune's denoiser (a UNet; Flux's transformer, wrapped per double and single block) is sharded
    while training; the saved pipeline holds the gathered weights."""
    settings = [
        "adapter.kind=none",
        "adapter.text_encoder=false",
        "optim.learning_rate=1e-4",
        "train.max_steps=3",
        "--config",
        f"configs/{job}.toml",
    ]
    _one_process(tmp_path / "one", *settings)
    _fsdp(tmp_path / "fsdp", *settings)
    assert _losses(tmp_path / "fsdp") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)
    # Reduce-scatter sums gradients in another order than one process does; Adam turns that rounding into up to
    # 3.3e-6 in a few biases after 3 steps (measured), a tenth of one step's 1e-4 change. A missing shard or an
    # unsynced gradient would differ by whole steps.
    weights = f"{denoiser}/diffusion_pytorch_model.safetensors"
    _assert_same_tensors(
        load_file(tmp_path / "one" / "model" / weights), load_file(tmp_path / "fsdp" / "model" / weights), atol=1e-5
    )


def test_what_fsdp_cannot_do_yet_is_refused_by_name():
    with pytest.raises(DifftuneError, match=r"DeepSpeed is not supported"):
        check_accelerator(SimpleNamespace(distributed_type=DistributedType.DEEPSPEED))
    with pytest.raises(DifftuneError, match=r"fsdp_version: 2"):
        check_accelerator(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=False))
    config = load_config(None, ["validation.path=/data/val", "sample.every_steps=50"])
    with pytest.raises(DifftuneError, match=r"validation\.path, sample\.every_steps: not supported with FSDP"):
        check_config(config)
    with pytest.raises(
        DifftuneError, match=r"adapter\.text_encoder = true and adapter\.kind = \"embedding\" are not supported"
    ):
        check_config(load_config(None, ["adapter.text_encoder=true"]))
    with pytest.raises(DifftuneError, match=r"adapter\.kind = \"embedding\" are not supported with FSDP"):
        check_config(load_config(None, ["adapter.kind=embedding"]))
    check_config(load_config(None, []))  # the defaults train under FSDP
