"""Checks that need a CUDA device: skipped elsewhere (CI and this project's CPU machine), run on the device tool's
GPU machine when one is lent (`pytest tests/test_cuda.py`). The issue asks that `train.compile` be verified
against eager on CUDA before it is recommended: same losses and same trained adapter. bf16 training is checked
against fp32, fp8 frozen weights against bf16 ones, offloaded blocks against kept ones, and the Flux job's
gradients for the cuDNN attention kernel's NaNs (scripts/gpu_suite.sh runs this)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from difftune.config import load_config
from difftune.training.metrics import read_metrics
from difftune.training.train import train

from conftest import REPO
from test_offload import offloader_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _adapter(result) -> dict[str, torch.Tensor]:
    return load_file(result.trained_path)


def test_compiled_unet_trains_like_eager(make_config, tmp_path):
    # tf32 off on both sides: the comparison is of the compiler, not of tf32's rounding. Adapter B starts at
    # zero, so a block whose gradients the compiled graph drops (what inductor did on CPU) stays at zero.
    settings = dict(train__max_steps=4, train__tf32="off", optim__learning_rate=1e-2, adapter__text_encoder=False)
    eager = train(make_config(train__output_dir=str(tmp_path / "eager"), **settings))
    compiled = train(make_config(train__output_dir=str(tmp_path / "compiled"), train__compile=True, **settings))
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-4)
    expected = _adapter(eager)
    for key, value in _adapter(compiled).items():
        torch.testing.assert_close(value, expected[key], rtol=1e-3, atol=1e-5, msg=key)


def _weight_changes(adapter: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each adapted layer's learned weight change, up to the scale both runs share: B @ A."""
    return {
        key: adapter[key.replace("lora_A", "lora_B")].float() @ value.float()
        for key, value in adapter.items()
        if "lora_A" in key
    }


def _group(key: str) -> str:
    """Where an adapted layer sits, for the failure message: its block list and its kind of layer."""
    parts = key.split(".")
    kind = next((part for part in parts if part in ("attn1", "attn2", "ff", "proj_in", "proj_out")), "other")
    return f"{parts[1]} {kind}"


def _cosines(expected: dict[str, torch.Tensor], learned: dict[str, torch.Tensor]) -> dict[str, float]:
    """Cosine similarity of two runs' learned changes, over all layers and over each group of layers."""
    groups: dict[str, list[str]] = {"all": list(expected)}
    for key in expected:
        groups.setdefault(_group(key), []).append(key)
    return {
        name: round(
            float(
                torch.nn.functional.cosine_similarity(
                    *(torch.cat([changes[key].flatten() for key in keys]) for changes in (expected, learned)), dim=0
                )
            ),
            3,
        )
        for name, keys in groups.items()
    }


def _grad_norms(tmp_path, *runs: str) -> list[list[float]]:
    return [[row["grad_norm"] for row in read_metrics(tmp_path / run) if "grad_norm" in row] for run in runs]


def test_bf16_training_is_finite_and_learns_what_fp32_learns(make_config, tmp_path):
    settings = dict(train__max_steps=4, optim__learning_rate=1e-2)
    plain_kernels = dict(train__channels_last="off", train__cudnn_benchmark="off")
    full = train(make_config(train__output_dir=str(tmp_path / "fp32"), train__tf32="off", **settings))
    half = train(make_config(train__output_dir=str(tmp_path / "bf16"), train__mixed_precision="bf16", **settings))
    assert all(torch.isfinite(torch.tensor(half.losses)))
    assert half.losses == pytest.approx(full.losses, rel=5e-2)  # bf16's 8-bit mantissa over 4 steps
    norms = _grad_norms(tmp_path, "fp32", "bf16")
    # On 2 CPU cores bf16 autocast learns what fp32 learns: cosine 0.995 over the whole adapter at learning rates
    # 1e-4 to 1e-2. On an H100 it was 0.31 (2026-11-25), and the first step's gradient norm came out 9% low
    # (2026-11-26: 0.0491 against 0.0539, the same weights and batch). Should either fail again, the message says
    # where the two part: the same comparison with channels-last and cuDNN autotuning off, fp32 against fp32 with
    # them off (kernel choice alone), and each kind of layer.
    expected, learned = _weight_changes(_adapter(full)), _weight_changes(_adapter(half))
    cosines = _cosines(expected, learned)
    if cosines["all"] <= 0.9 or norms[1] != pytest.approx(norms[0], rel=5e-2):
        plain_full = train(
            make_config(train__output_dir=str(tmp_path / "fp32-plain"), train__tf32="off", **plain_kernels, **settings)
        )
        plain_half = train(
            make_config(
                train__output_dir=str(tmp_path / "bf16-plain"),
                train__mixed_precision="bf16",
                **plain_kernels,
                **settings,
            )
        )
        plain_expected = _weight_changes(_adapter(plain_full))
        plain_norms = _grad_norms(tmp_path, "fp32-plain", "bf16-plain")
        pytest.fail(
            f"bf16 against fp32: {cosines}, gradient norms {norms}; both with channels-last and cuDNN "
            f"autotuning off: {_cosines(plain_expected, _weight_changes(_adapter(plain_half)))}, gradient "
            f"norms {plain_norms}; fp32 against fp32 with them off: {_cosines(expected, plain_expected)}"
        )


def test_flux_trains_in_bf16_with_finite_gradients(tmp_path):
    # SDPA's cuDNN kernel gave NaN gradients from the first step of this job on an H100 (torch 2.11); the
    # trainer turns that kernel off. The guard would skip such steps: none may be skipped.
    config = load_config(
        REPO / "configs" / "flux_lora.toml",
        [
            f"train.output_dir={tmp_path}",
            "train.max_steps=10",
            "train.mixed_precision=bf16",
            "log.progress_bar=false",
            "sample.every_steps=0",
        ],
    )
    result = train(config)
    rows = read_metrics(tmp_path)
    assert [row["skipped"] for row in rows] == [False] * 10
    assert all(math.isfinite(row["grad_norm"]) for row in rows) and all(math.isfinite(x) for x in result.losses)


def test_regionally_compiled_flux_trains_like_eager(tmp_path):
    # `train.compile` compiles a transformer block by block (`compile_denoiser`): same losses and adapter as eager.
    def run(name: str, compiled: bool):
        overrides = [f"train.output_dir={tmp_path / name}", "train.max_steps=4", "train.tf32=off"]
        overrides += [
            "log.progress_bar=false",
            "sample.prompts=[]",
            "sample.before=false",
            f"train.compile={str(compiled).lower()}",
        ]
        return train(load_config(REPO / "configs" / "flux_lora.toml", [*overrides, "adapter.text_encoder=false"]))

    eager, compiled = run("eager", False), run("compiled", True)
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-4)
    expected = _adapter(eager)
    for key, value in _adapter(compiled).items():
        torch.testing.assert_close(value, expected[key], rtol=1e-3, atol=1e-5, msg=key)


def test_fp8_frozen_weights_train_on_the_device_as_bf16_ones(make_config, tmp_path):
    # On the CPU fp8 storage trains exactly as the fp8-rounded base (test_storage.py); here: the stored bytes go
    # to the device as bytes, the casts run there, and the losses stay within fp8's rounding of bf16 weights'.
    settings = dict(train__max_steps=4, optim__learning_rate=1e-2, train__mixed_precision="bf16")
    plain = train(make_config(train__output_dir=str(tmp_path / "bf16"), **settings))
    stored = train(make_config(train__output_dir=str(tmp_path / "fp8"), model__weight_dtype="fp8", **settings))
    assert all(math.isfinite(x) for x in stored.losses)
    assert stored.losses == pytest.approx(plain.losses, rel=5e-2)
    originals = [p for n, p in stored.components.denoiser.named_parameters() if n.endswith("weight.original")]
    assert originals and all(p.dtype == torch.uint8 and p.is_cuda for p in originals)


def test_offloaded_blocks_train_on_the_device_as_kept_ones(make_config, tmp_path):
    # On the CPU the copies run in line and training is exact (test_offload.py); here they come from page-locked
    # host memory on a stream of their own, each ahead of its use, and must still give the same losses.
    settings = dict(
        train__max_steps=4, optim__learning_rate=1e-2, train__mixed_precision="bf16", model__weight_dtype="fp8"
    )
    in_place = train(make_config(train__output_dir=str(tmp_path / "in-place"), **settings))
    offloaded = train(make_config(train__output_dir=str(tmp_path / "offloaded"), model__offload_blocks=4, **settings))
    assert offloaded.losses == pytest.approx(in_place.losses, rel=1e-3)
    offloader = offloader_of(offloaded.components.denoiser)
    assert all(host.is_pinned() and not host.is_cuda for host in offloader.hosts.values())
    assert offloader.copies["prefetched"] > 3 * offloader.copies["in_line"]  # in line: the first step's forward


def test_cached_encoders_wait_in_host_memory_between_previews(make_config, tmp_path, monkeypatch):
    import difftune.training.train as training

    seen = []
    preview = training.generate_images

    def watched(components, config, device):  # where the encoders are while a preview runs, and between
        seen.append((components.vae.device.type, components.text_encoders["text_encoder"].device.type))
        return preview(components, config, device)

    def stepped(run):  # where they are while the denoiser trains
        seen.append((run.components.vae.device.type, run.components.text_encoders["text_encoder"].device.type))
        return step(run)

    step = training.accumulate_gradients
    monkeypatch.setattr(training, "generate_images", watched)
    monkeypatch.setattr(training, "accumulate_gradients", stepped)
    settings = dict(
        cache__latents=True,
        cache__text=True,
        sample__prompts=["a red circle"],
        sample__every_steps=2,
        sample__steps=2,
        sample__resolution=32,
        sample__before=False,
        sample__parity=False,
        train__max_steps=3,
    )
    result = train(make_config(train__output_dir=str(tmp_path / "run"), **settings))
    # Steps 1 and 2 in host memory, the preview after step 2 on the device, step 3 in host memory again, and the
    # end-of-run samples on the device.
    assert seen == [("cpu", "cpu")] * 2 + [("cuda", "cuda"), ("cpu", "cpu"), ("cuda", "cuda")]
    assert (tmp_path / "run" / "samples" / "step-000002").is_dir() and len(result.losses) == 3


@pytest.mark.parametrize("cached", [False, True], ids=["encoding-each-step", "caches"])
def test_a_training_step_waits_for_the_device_once(make_config, tmp_path, monkeypatch, cached):
    # torch's sync debug mode warns at every operation that makes the host wait for the device (a read of a value, a
    # copy from ordinary host memory). From step 3 on (cuDNN's autotuning done) to the loop's end, a step's one wait
    # is `step_numbers`'s read of its loss and gradient norm; the batch, noise and timesteps reach the device without.
    import warnings

    import difftune.training.train as training

    steps, step, finish = 6, training.accumulate_gradients, training.finish

    def stepped(run):
        if run.progress.global_step == 2:
            torch.cuda.set_sync_debug_mode("warn")
        return step(run)

    def finished(run):
        torch.cuda.set_sync_debug_mode(0)
        return finish(run)

    monkeypatch.setattr(training, "accumulate_gradients", stepped)
    monkeypatch.setattr(training, "finish", finished)
    settings = dict(train__max_steps=steps, cache__latents=cached, cache__text=cached, adapter__text_encoder=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = train(make_config(train__output_dir=str(tmp_path / "run"), **settings))
        finally:
            torch.cuda.set_sync_debug_mode(0)
    waits = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message)]
    assert len(result.losses) == steps
    assert len(waits) == steps - 2, "\n".join(waits)
