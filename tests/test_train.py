import inspect
import json
import traceback
from pathlib import Path

import pytest
import tomllib
import torch
from diffusers import StableDiffusionPipeline, UNet2DConditionModel
from safetensors import safe_open
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode

from difftune.config import load_config
from difftune.errors import DifftuneError
from difftune.families import load_components
from difftune.toy.tiny import shape_images, write_caption_folder
from difftune.training.metrics import read_metrics
from difftune.training.train import train
from difftune.training.validation import Validator

from conftest import REPO, unet_inputs


def _base_weights(unet) -> dict[str, torch.Tensor]:
    """Every non-adapter weight, under its name in the plain model."""
    return {
        name.replace(".base_layer", ""): value.detach().clone()
        for name, value in unet.state_dict().items()
        if "lora_" not in name
    }


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_adapter_training_lowers_the_loss_and_keeps_the_base(make_config, tmp_path, kind):
    fixed_batch = tmp_path / "four"
    write_caption_folder(fixed_batch, shape_images(4, seed=3))
    # Convolutions too: DoRA on a conv under channels-last is a path peft can break.
    targets = ["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"]
    # High-noise timesteps: where a random-init base has most to learn in a few steps.
    config = make_config(
        data__path=str(fixed_batch),
        adapter__kind=kind,
        adapter__target_modules=targets,
        adapter__rank=8,
        train__max_steps=40,
        train__batch_size=4,
        optim__learning_rate=5e-3,
        loss__weighting="uniform",
        validation__path=str(fixed_batch),
        validation__timesteps=[600, 750, 900, 999],
    )
    base = load_components(config.model)
    before = Validator(base, config, torch.device("cpu")).loss(base)
    result = train(config)
    after = Validator(base, config, torch.device("cpu")).loss(result.components)
    metrics = read_metrics(result.trained_path.parent)
    assert metrics[-1]["val_loss"] == pytest.approx(after, rel=1e-6)  # the loop's validation is the same number
    assert after < 0.85 * before, (before, after)

    trained = _base_weights(result.components.denoiser)
    original = base.denoiser.state_dict()
    assert trained.keys() == original.keys()
    for name, value in original.items():
        assert torch.equal(trained[name], value), f"base weight {name} changed"
    assert len(result.losses) == 40 and all(torch.isfinite(torch.tensor(result.losses)))


def test_gradient_accumulation_matches_one_large_batch(make_config, tmp_path):
    one_batch = train(make_config(train__batch_size=4, train__output_dir=str(tmp_path / "a")))
    accumulated = train(
        make_config(train__batch_size=2, train__gradient_accumulation_steps=2, train__output_dir=str(tmp_path / "b"))
    )
    assert one_batch.losses == pytest.approx(accumulated.losses, rel=1e-5)
    # The same gradient, not k times it: Adam would hide a scale error in the weights, the norm does not.
    norms_a = [row["grad_norm"] for row in read_metrics(tmp_path / "a")]
    norms_b = [row["grad_norm"] for row in read_metrics(tmp_path / "b")]
    assert norms_a == pytest.approx(norms_b, rel=1e-4)
    weights_a, weights_b = load_file(one_batch.trained_path), load_file(accumulated.trained_path)
    assert weights_a.keys() == weights_b.keys()
    # Adam's first steps are ~sign(g) * lr, so an element whose gradient is at float-noise level may move by a
    # fraction of lr either way; a wrong batch would move most elements by ~lr.
    lr = 1e-3
    for key in weights_a:
        torch.testing.assert_close(weights_a[key], weights_b[key], rtol=0, atol=0.05 * lr)
    # ...and the adapters did move away from their initial value (B starts at zero).
    assert any(weights_a[k].abs().max() > 0 for k in weights_a if "lora_B" in k)


def test_gradient_checkpointing_gives_the_same_update(make_config, tmp_path):
    plain = train(make_config(train__output_dir=str(tmp_path / "plain")))
    checkpointed = train(make_config(train__output_dir=str(tmp_path / "ckpt"), train__gradient_checkpointing=True))
    assert plain.losses == pytest.approx(checkpointed.losses, rel=1e-5)
    for key, value in load_file(plain.trained_path).items():
        torch.testing.assert_close(value, load_file(checkpointed.trained_path)[key], rtol=1e-5, atol=1e-6)


def test_compile_on_cpu_is_refused_with_the_reason(make_config, tmp_path):
    with pytest.raises(
        DifftuneError, match=r"train.compile = true is supported on CUDA only .*wrong adapter gradients"
    ):
        train(make_config(train__compile=True))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_saved_adapter_reloads_in_diffusers(make_config, tiny_base, kind):
    config = make_config(adapter__kind=kind, adapter__text_encoder=True, train__max_steps=4, optim__learning_rate=1e-2)
    result = train(config)
    assert result.trained_path.name == "pytorch_lora_weights.safetensors"

    pipeline = StableDiffusionPipeline.from_pretrained(tiny_base, safety_checker=None)
    pipeline.load_lora_weights(result.trained_path.parent)
    latents, timesteps, states = unet_inputs(pipeline.unet)
    states = states[:, :, : pipeline.unet.config.cross_attention_dim]
    ids = pipeline.tokenizer(["a red circle", "a blue square"], padding="max_length", return_tensors="pt").input_ids
    ours = result.components
    ours.denoiser.eval()
    ours.text_encoders["text_encoder"].eval()
    with torch.no_grad():
        expected_unet = ours.denoiser(latents, timesteps, states).sample
        expected_text = ours.text_encoders["text_encoder"](ids)[0]
        base_unet = UNet2DConditionModel.from_pretrained(tiny_base, subfolder="unet")(latents, timesteps, states).sample
        torch.testing.assert_close(
            pipeline.unet(latents, timesteps, states).sample, expected_unet, rtol=1e-4, atol=1e-5
        )
        torch.testing.assert_close(pipeline.text_encoder(ids)[0], expected_text, rtol=1e-4, atol=1e-5)
    assert (expected_unet - base_unet).abs().max() > 1e-4  # the adapter does something

    with safe_open(result.trained_path, framework="pt") as handle:
        metadata = handle.metadata()
    resolved = json.loads(config.model_dump_json(exclude_none=True))
    resolved["model"]["family"] = "sd"  # the run records the family it found
    assert tomllib.loads(metadata["difftune_config"]) == resolved
    lora_metadata = json.loads(metadata["lora_adapter_metadata"])
    assert lora_metadata["unet.r"] == 4 and lora_metadata["unet.use_dora"] == (kind == "dora")
    assert lora_metadata["text_encoder.r"] == 4


@pytest.mark.parametrize("cached", [False, True], ids=["encoded", "cached-latents"])
def test_full_fine_tune_writes_a_loadable_pipeline(make_config, tiny_base, tmp_path, cached):
    # With cached latents the VAE leaves memory during training; the saved pipeline must still hold it.
    config = make_config(
        adapter__kind="none",
        adapter__text_encoder=True,
        optim__learning_rate=1e-3,
        cache__latents=cached,
        cache__dir=str(tmp_path / "cache"),
    )
    result = train(config)
    assert result.trained_path.name == "model"
    saved = StableDiffusionPipeline.from_pretrained(result.trained_path, safety_checker=None)
    base_unet = UNet2DConditionModel.from_pretrained(tiny_base, subfolder="unet")
    latents, timesteps, states = unet_inputs(base_unet)
    result.components.denoiser.eval()
    with torch.no_grad():
        expected = result.components.denoiser(latents, timesteps, states).sample
        torch.testing.assert_close(saved.unet(latents, timesteps, states).sample, expected, rtol=1e-5, atol=1e-6)
        assert (expected - base_unet(latents, timesteps, states).sample).abs().max() > 1e-4
    assert not any("lora" in key for key in saved.unet.state_dict())


def test_run_outputs_and_metrics(make_config, tmp_path):
    config = make_config(
        train__max_steps=4,
        sample__prompts=["a red circle", "a blue square"],
        sample__steps=3,
        log__tensorboard=True,
    )
    train(config)
    out = tmp_path / "run"
    assert load_config(out / "config.toml") == config.model_copy(
        update={"model": config.model.model_copy(update={"family": "sd"})}
    )
    rows = read_metrics(out)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for row in rows:
        assert {"loss", "grad_norm", "lr", "seconds", "samples_per_second", "epoch"} <= row.keys()
        assert row["loss"] > 0 and row["grad_norm"] > 0
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["000.png", "001.png", "grid.png"]
    from PIL import Image

    with Image.open(out / "samples" / "001.png") as image:
        assert image.size == (32, 32)
        assert image.text["prompt"] == "a blue square"
        assert "seed=1" in image.text["parameters"]
    assert list((out / "logs").rglob("events.out.tfevents.*")), "TensorBoard events were not written"


def test_a_run_without_tensorboard_says_so_and_keeps_the_jsonl(make_config, tmp_path, monkeypatch, capsys):
    import difftune.training.train as train_module

    monkeypatch.setattr(train_module, "is_tensorboard_available", lambda: False)
    train(make_config(train__max_steps=2, sample__prompts=[], log__tensorboard=True))
    assert "log.tensorboard: TensorBoard is not installed" in capsys.readouterr().out
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == [1, 2]
    assert not list((tmp_path / "run").rglob("events.out.tfevents.*"))


def test_warmup_and_clipping_show_in_the_metrics(make_config):
    config = make_config(
        train__max_steps=4, optim__warmup_steps=2, optim__lr_schedule="cosine", optim__max_grad_norm=1e-6
    )
    result = train(config)
    rows = read_metrics(result.trained_path.parent)
    lrs = [row["lr"] for row in rows]
    peak = config.optim.learning_rate
    # Warmup reaches the peak at step 2; cosine decays to 0 at the last step.
    assert (
        lrs[0] == pytest.approx(peak / 2) and lrs[1] == pytest.approx(peak) and lrs[-1] == pytest.approx(0.0, abs=1e-12)
    )
    assert all(row["grad_norm"] > 1e-6 for row in rows)  # the norm before clipping is what is logged


@pytest.mark.parametrize("max_grad_norm", [1e-3, 0.0])
def test_clipping_scales_the_gradient_the_optimizer_steps_with(make_config, monkeypatch, max_grad_norm):
    """The optimizer must see the clipped gradient: norm <= the limit when the raw norm exceeds it, the raw norm
    when clipping is off. (The loss alone cannot show it: Adam's first steps barely depend on the gradient's scale.)"""
    from difftune.training import train as train_module

    seen, real_build = [], train_module.build_optimizer

    def recording_optimizer(*args, **kwargs):
        optimizer = real_build(*args, **kwargs)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        optimizer.register_step_pre_hook(
            lambda *_: seen.append(
                torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])).item()
            )
        )
        return optimizer

    monkeypatch.setattr(train_module, "build_optimizer", recording_optimizer)
    result = train(make_config(train__max_steps=3, optim__max_grad_norm=max_grad_norm))
    logged = [row["grad_norm"] for row in read_metrics(result.trained_path.parent)]
    assert len(seen) == 3 and all(norm > 1e-3 for norm in logged)
    if max_grad_norm:
        assert all(norm == pytest.approx(max_grad_norm, rel=1e-3) for norm in seen), (seen, logged)
    else:
        assert seen == pytest.approx(logged, rel=1e-5)


def test_refuses_to_overwrite_a_finished_run(make_config):
    config = make_config(train__max_steps=1)
    train(config)
    with pytest.raises(DifftuneError, match="already holds a run .*train.overwrite=true"):
        train(config)
    train(make_config(train__max_steps=1, train__overwrite=True))


def test_fp16_on_cpu_is_a_clear_error(make_config):
    with pytest.raises(DifftuneError, match='mixed_precision = "fp16" needs a CUDA device'):
        train(make_config(train__mixed_precision="fp16"))


def test_runs_of_different_precision_follow_one_another_in_a_process(make_config, tmp_path):
    # accelerate keeps one AcceleratorState per process and refused the second run's precision (seen on an H100
    # in tests/test_cuda.py, and here on the CPU); each run now sets its own.
    full = train(make_config(train__output_dir=str(tmp_path / "fp32"), train__max_steps=2))
    half = train(
        make_config(train__output_dir=str(tmp_path / "bf16"), train__max_steps=2, train__mixed_precision="bf16")
    )
    again = train(make_config(train__output_dir=str(tmp_path / "fp32-again"), train__max_steps=2))
    assert again.losses == full.losses  # the fp32 run after the bf16 one computes in fp32 again
    assert half.losses != full.losses and half.losses == pytest.approx(full.losses, rel=5e-2)


BEFORE_FAMILIES = {  # what the trainer did at commit cc70728, before model families existed (4 steps on tiny-sd)
    "lora_te": ["adapter.text_encoder=true", "data.random_flip=true", "cache.latents=false"],
    "dora_cache": [
        "adapter.kind=dora",
        "adapter.text_encoder=false",
        "cache.latents=true",
        "cache.text=true",
        "loss.prediction_type=v_prediction",
    ],
}


@pytest.mark.parametrize("name", BEFORE_FAMILIES)
def test_sd_trains_the_same_weights_as_before_families(name, tmp_path):
    """The SD family reproduces the pre-refactor trainer bit for bit: the UNet's trained weights after 4 steps of
    the default job's settings (plus these overrides) equal the ones the old code wrote, same torch build."""
    config = load_config(
        REPO / "configs" / "tiny_lora.toml",
        [
            "train.max_steps=4",
            "sample.prompts=[]",
            f"train.output_dir={tmp_path / name}",
            "data.num_workers=0",
            "log.tensorboard=false",
            "log.progress_bar=false",
            f"cache.dir={tmp_path / 'cache'}",
            *BEFORE_FAMILIES[name],
        ],
    )
    trained = {n: p.detach() for n, p in train(config).components.denoiser.named_parameters() if p.requires_grad}
    before = load_file(REPO / "tests" / "data" / "before_families" / f"{name}.safetensors")
    assert trained.keys() == before.keys()
    for key, value in before.items():
        torch.testing.assert_close(trained[key], value, rtol=0, atol=1e-6, msg=key)


def test_encoders_fill_the_caches_and_go_before_the_denoiser_loads(make_config, tmp_path, monkeypatch):
    """With both caches on and nothing drawn before training, the run loads the base without its denoiser, fills the
    caches, lets go of the encoders, then loads the denoiser: never both resident (FLUX.1's T5 and transformer). It
    trains the same weights as the run that loads everything at once (its "before" samples need the whole base)."""
    import difftune.training.train as train_module

    seen = {}
    load_denoiser = train_module.load_denoiser

    def watched(components, *args):
        seen["encoders"] = [components.vae, *components.text_encoders.values()]
        load_denoiser(components, *args)

    monkeypatch.setattr(train_module, "load_denoiser", watched)
    settings = dict(
        cache__latents=True,
        cache__text=True,
        adapter__text_encoder=False,
        sample__prompts=["a red circle"],
        sample__steps=2,
        train__max_steps=3,
    )
    first = train(make_config(train__output_dir=str(tmp_path / "first"), sample__before=False, **settings))
    assert seen.pop("encoders") == [None, None]
    whole = train(make_config(train__output_dir=str(tmp_path / "whole"), sample__before=True, **settings))
    assert "encoders" not in seen  # the "before" samples draw with the whole base: loaded at once
    assert first.losses == whole.losses
    expected = load_file(whole.trained_path)
    assert load_file(first.trained_path).keys() == expected.keys()
    for key, value in load_file(first.trained_path).items():
        assert torch.equal(value, expected[key]), key


def test_a_runs_settings_are_decided_once_before_anything_loads(make_config, monkeypatch):
    """`resolve`: the family named in the config the run records, the accumulation that reaches the global batch on
    this many processes, and the dtypes the run keeps its parts in (fp8 stored, bf16 computed), with no weight read."""
    from difftune.training import resolved as resolved_module

    def no_loading(*_, **__):
        raise AssertionError("resolve loaded a model")

    monkeypatch.setattr("difftune.families.load_components", no_loading)
    config = make_config(train__global_batch_size=8, train__mixed_precision="bf16", model__weight_dtype="fp8")
    resolved = resolved_module.resolve(config, num_processes=2)
    assert resolved.config.model.family == resolved.family.name == "sd" and config.model.family == "auto"
    assert resolved.config.train.gradient_accumulation_steps == 2 and resolved.config.train.global_batch_size == 0
    assert (resolved.dtypes.compute, resolved.dtypes.stored) == (torch.bfloat16, torch.float8_e4m3fn)
    assert resolved.dtypes.stored_at_load and resolved.dtypes.text_encoders_stored is None
    assert resolved.offload_budget == ""
    with pytest.raises(DifftuneError, match="train.global_batch_size 8 is not a multiple"):
        resolved_module.resolve(config, num_processes=3)


def test_parts_load_in_the_dtype_the_run_keeps_them_in(tiny_base, make_config):
    """No frozen part is read into fp32 first: under bf16 the encoders load in bf16, and a denoiser whose layers are
    stored apart loads as its files hold it, mapped from them without a copy, then is stored layer by layer."""
    from difftune.memory.storage import file_mappings
    from difftune.models.dtypes import AS_STORED, PartDtypes, run_dtypes

    config = make_config(train__mixed_precision="bf16", model__weight_dtype="fp8")
    # Nothing drawn before the end (no sample prompts): drawing parts are left out until then.
    assert run_dtypes(config).loaded == PartDtypes(
        denoiser=AS_STORED,
        vae=torch.bfloat16,
        others=torch.bfloat16,
        stored_fp8_computes_in=torch.bfloat16,
        drawing_parts=False,
    )
    assert run_dtypes(make_config(adapter__kind="none", train__mixed_precision="bf16")).loaded == PartDtypes()
    loaded = load_components(config.model, run_dtypes(config).loaded)
    assert {p.dtype for p in loaded.text_encoders["text_encoder"].parameters()} == {torch.bfloat16}
    assert {p.dtype for p in loaded.vae.parameters()} == {torch.bfloat16}
    weights = [p for p in loaded.denoiser.parameters() if p.dim() > 1]
    assert {p.dtype for p in weights} == {torch.float32}  # the tiny base's files are fp32
    mapped = file_mappings()
    assert all(any(low <= p.data_ptr() < high for low, high in mapped) for p in weights)  # the file's pages, not a copy


def test_parity_is_left_out_with_a_line_when_a_fresh_copy_would_not_fit(make_config, tmp_path, monkeypatch, capsys):
    """The parity check loads the base afresh in fp32 beside the trained one: at the end of a long run on a large base
    that copy must not run the machine out of memory (FLUX.1 in fp32 is 63 GiB). Without room it is left out, said."""
    from types import SimpleNamespace

    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=2**20, total=2**40))
    result = train(
        make_config(
            train__output_dir=str(tmp_path / "run"),
            sample__prompts=["a red circle"],
            sample__steps=2,
            sample__parity=True,
            train__max_steps=1,
        )
    )
    out = capsys.readouterr().out
    assert "difftune: parity: not checked: redrawing loads a fresh fp32 copy of the base (" in out
    assert "more than the 1 MiB of RAM available; sample.parity = false leaves the check out" in out
    assert not (tmp_path / "run" / "parity.json").exists() and result.trained_path.is_file()


def test_a_part_is_loaded_as_the_files_diffusers_picks_hold_it(tmp_path):
    """A folder with a variant's copy beside the plain weights (`*.fp16.safetensors` sorts first): the plain files'
    dtype is the one diffusers loads and the run keeps, not the variant's."""
    from safetensors.torch import save_file

    from difftune.models.components import files_dtype

    part = tmp_path / "transformer"
    part.mkdir()
    save_file({"w": torch.zeros(2, dtype=torch.float16)}, part / "diffusion_pytorch_model.fp16.safetensors")
    save_file({"w": torch.zeros(2)}, part / "diffusion_pytorch_model.safetensors")
    assert files_dtype(str(tmp_path), "transformer") == torch.float32
    assert files_dtype(str(tmp_path), "transformer", "fp16") == torch.float16
    assert files_dtype(str(tmp_path), "unet") is None


class _DeviceReads(TorchFunctionMode):
    """Counts reads of computed values back to the host (`.item()`, `.tolist()`, `float(t)`...) of floating-point
    tensors, by the line that made them. On a GPU each is a wait for the device; the batch's seeds and epochs (integer
    tensors in host memory) are left out."""

    READS = ("item", "tolist", "__float__", "__bool__", "__int__", "__index__", "numpy", "cpu")

    def __init__(self):
        super().__init__()
        self.lines = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS and args[0].is_floating_point():
            caller = traceback.extract_stack(limit=2)[0]
            self.lines.append(f"{Path(caller.filename).name}:{caller.lineno}")
        return func(*args, **(kwargs or {}))


def test_a_training_step_reads_the_device_once(make_config, monkeypatch):
    # The step's loss and gradient norm are read together, once (the guard needs both before the optimizer steps);
    # the stop and sample requests of a single process never touch the device. Before: three reads a step.
    from difftune.training import train as training

    steps, reads = 4, _DeviceReads()
    looped = training.loop

    def counted(run):
        with reads:
            looped(run)

    monkeypatch.setattr(training, "loop", counted)
    result = train(make_config(train__max_steps=steps))
    assert len(result.losses) == steps
    assert len(reads.lines) == steps, reads.lines
    assert set(reads.lines) == {"train.py:" + str(_line_of(training.step_numbers, ".tolist()"))}


def _line_of(function, text: str) -> int:
    lines, first = inspect.getsourcelines(function)
    return first + next(index for index, line in enumerate(lines) if text in line)


def test_the_next_steps_batch_is_read_ahead_and_the_data_order_is_kept(make_config, monkeypatch, tmp_path):
    # `fetch_ahead` during each step but the last reads the next step's batch early; the run's batches, in order, are
    # those of a run that reads each when its step begins (so the same adapter, bit for bit).
    from difftune.training import train as training

    fetched = []
    fetch_ahead = training.BatchesAhead.fetch_ahead

    def counted(self):
        fetched.append(self.ahead is not None)
        fetch_ahead(self)

    monkeypatch.setattr(training.BatchesAhead, "fetch_ahead", counted)
    ahead = train(make_config(train__max_steps=3, train__output_dir=str(tmp_path / "ahead")))
    assert fetched == [False, False]  # steps 1 and 2 read ahead, each into an empty slot; step 3 is the last
    monkeypatch.setattr(training.BatchesAhead, "fetch_ahead", lambda self: None)
    in_step = train(make_config(train__max_steps=3, train__output_dir=str(tmp_path / "in-step")))
    assert ahead.losses == in_step.losses
    for key, value in load_file(in_step.trained_path).items():
        assert torch.equal(load_file(ahead.trained_path)[key], value), key
