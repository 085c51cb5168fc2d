"""Stability techniques: EMA, averaging, the guard, optimizers and schedules, noise options, validation."""

import importlib.util
import json

import pytest
import torch
from diffusers import StableDiffusionPipeline
from PIL import Image
from safetensors.torch import load_file

from difftune.adapters import export
from difftune.adapters.trained import adapter_state_dict, trainable_parameters
from difftune.cli import main
from difftune.config import EmaConfig, GuardConfig, LossConfig, ModelConfig, OptimConfig, load_config
from difftune.data.dataset import scan_examples, training_sizes
from difftune.errors import DifftuneError
from difftune.families import load_components
from difftune.families.common.objective import draw_timesteps_and_noise, training_noise_scheduler
from difftune.toy.tiny import build_noise_scheduler
from difftune.training import train as train_module
from difftune.training.activations import BlockActivations
from difftune.training.ema import build_ema, ema_weights, update_ema
from difftune.training.guard import SKIPPED_FILE, Guard
from difftune.training.metrics import read_metrics
from difftune.training.optim import OPTIMIZERS, build_lr_scheduler, build_optimizer
from difftune.training.train import train
from difftune.training.validation import Validator


def test_ema_with_constant_decay_is_the_closed_form():
    param = torch.nn.Parameter(torch.zeros(3))
    ema = build_ema([param], EmaConfig(enabled=True, decay=0.9, warmup=False))
    values = [1.0, 2.0, -1.0, 4.0, 0.5]
    for value in values:
        param.data.fill_(value)
        update_ema(ema, [param], EmaConfig(enabled=True, decay=0.9, warmup=False))
    # The first update copies (diffusers' step 0 has decay 0); then e <- 0.9 e + 0.1 p.
    expected = values[0]
    for value in values[1:]:
        expected = 0.9 * expected + 0.1 * value
    torch.testing.assert_close(ema.shadow_params[0], torch.full((3,), expected))


def test_ema_warmup_ramps_the_decay():
    param = torch.nn.Parameter(torch.zeros(1))
    config = EmaConfig(enabled=True, decay=0.999, warmup=True, power=0.75)
    ema = build_ema([param], config)
    decays = []
    for _ in range(4):
        update_ema(ema, [param], config)
        decays.append(ema.cur_decay_value)
    # diffusers: decay(t) = 1 - (1 + t)^-power for t = step - 1, and 0 at the first step.
    assert decays == pytest.approx([0.0] + [1 - (1 + t) ** -0.75 for t in (1, 2, 3)])


def test_ema_weights_swap_in_and_out():
    param = torch.nn.Parameter(torch.ones(2))
    config = EmaConfig(enabled=True, decay=0.5, warmup=False)
    ema = build_ema([param], config)
    update_ema(ema, [param], config)
    param.data.fill_(3.0)
    update_ema(ema, [param], config)  # ema = 0.5 * 1 + 0.5 * 3 = 2
    with ema_weights(ema, [param]):
        torch.testing.assert_close(param.data, torch.full((2,), 2.0))
    torch.testing.assert_close(param.data, torch.full((2,), 3.0))


def test_training_saves_the_ema_adapter_beside_the_raw_one(make_config, tiny_base, tmp_path):
    config = make_config(train__max_steps=6, ema__enabled=True, ema__decay=0.5, ema__warmup=False)
    result = train(config)
    out = tmp_path / "run"
    raw, ema = (
        load_file(out / "pytorch_lora_weights.safetensors"),
        load_file(out / "pytorch_lora_weights_ema.safetensors"),
    )
    assert raw.keys() == ema.keys()
    assert any(not torch.equal(raw[k], ema[k]) for k in raw if "lora_B" in k)
    # The EMA file holds exactly the EMA weights.
    with ema_weights(result.ema, list(trainable_parameters(result.components, config.adapter).values())):
        expected, _ = adapter_state_dict(result.components, config.adapter)
    assert all(torch.equal(ema[k], expected[k]) for k in ema)
    pipeline = StableDiffusionPipeline.from_pretrained(tiny_base, safety_checker=None, dtype=torch.float32)
    pipeline.load_lora_weights(str(out), weight_name="pytorch_lora_weights_ema.safetensors")
    assert any("lora_A" in k for k in pipeline.unet.state_dict())


def test_average_command_is_the_weighted_mean(make_config, tiny_base, tmp_path):
    first = train(make_config(train__max_steps=2, train__output_dir=str(tmp_path / "a"))).trained_path
    second = train(make_config(train__max_steps=2, train__seed=1, train__output_dir=str(tmp_path / "b"))).trained_path
    out = tmp_path / "avg.safetensors"
    assert main(["average", str(first), str(second), "--out", str(out), "--weights", "linear"]) == 0
    a, b, averaged = load_file(first), load_file(second), load_file(out)
    for key in a:
        torch.testing.assert_close(averaged[key], a[key] / 3 + b[key] * 2 / 3, rtol=1e-6, atol=1e-7)
    pipeline = StableDiffusionPipeline.from_pretrained(tiny_base, safety_checker=None, dtype=torch.float32)
    pipeline.load_lora_weights(str(tmp_path), weight_name="avg.safetensors")
    assert any("lora_A" in k for k in pipeline.unet.state_dict())


def test_averaging_refuses_different_adapters(make_config, tmp_path):
    first = train(make_config(train__max_steps=1, train__output_dir=str(tmp_path / "a"))).trained_path
    other = train(make_config(train__max_steps=1, adapter__rank=2, train__output_dir=str(tmp_path / "b"))).trained_path
    with pytest.raises(DifftuneError, match="tensors differ"):
        export.average_adapters([first, other])


def test_training_averages_its_last_snapshots(make_config, tmp_path):
    config = make_config(
        train__max_steps=6,
        export__every_steps=2,
        export__average_last=3,
        export__average_weights="exponential",
        adapter__kind="dora",
    )
    train(config)
    out = tmp_path / "run"
    snapshots = sorted((out / "snapshots").iterdir())
    assert [p.name for p in snapshots] == [
        "step-000002.safetensors",
        "step-000004.safetensors",
        "step-000006.safetensors",
    ]
    loaded = [load_file(p) for p in snapshots]
    averaged = load_file(out / "pytorch_lora_weights_avg.safetensors")
    for key in averaged:
        expected = (loaded[0][key] + 2 * loaded[1][key] + 4 * loaded[2][key]) / 7
        torch.testing.assert_close(averaged[key], expected, rtol=1e-6, atol=1e-7)
    # The last snapshot is the final adapter.
    final = load_file(out / "pytorch_lora_weights.safetensors")
    assert all(torch.equal(final[k], loaded[2][k]) for k in final)


def _poison(monkeypatch, bad_calls: set[int], how):
    """Make the training loss of the given (1-based) micro-steps NaN or a spike."""
    original = train_module._training_loss
    calls = {"n": 0}

    def poisoned(components, batch, config, device, *rest):
        calls["n"] += 1
        loss = original(components, batch, config, device, *rest)
        return how(loss) if calls["n"] in bad_calls else loss

    monkeypatch.setattr(train_module, "_training_loss", poisoned)


def _optimizer_state(optimizer) -> list[torch.Tensor]:
    return [
        value
        for state in optimizer.state_dict()["state"].values()
        for value in state.values()
        if torch.is_tensor(value)
    ]


def test_a_nan_step_is_skipped_and_leaves_everything_as_it_was(make_config, tmp_path, monkeypatch):
    clean = train(make_config(train__max_steps=3, ema__enabled=True, train__output_dir=str(tmp_path / "clean")))
    _poison(monkeypatch, {4}, lambda loss: loss * float("nan"))
    skipped = train(make_config(train__max_steps=4, ema__enabled=True, train__output_dir=str(tmp_path / "nan")))
    # Step 4 was skipped: weights, optimizer state and EMA are bit-identical to the run that stopped at 3.
    weights_clean, weights_skipped = load_file(clean.trained_path), load_file(skipped.trained_path)
    assert all(torch.equal(weights_clean[k], weights_skipped[k]) for k in weights_clean)
    for a, b in zip(_optimizer_state(clean.optimizer), _optimizer_state(skipped.optimizer), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(clean.ema.shadow_params, skipped.ema.shadow_params, strict=True):
        assert torch.equal(a, b)
    records = [json.loads(line) for line in (tmp_path / "nan" / SKIPPED_FILE).read_text().splitlines()]
    assert [(r["step"], r["reason"]) for r in records] == [(4, "non-finite loss")]
    assert len(records[0]["images"]) == 2 and all(p.endswith(".png") for p in records[0]["images"])
    assert [row["skipped"] for row in read_metrics(tmp_path / "nan")] == [False, False, False, True]


def test_consecutive_nans_stop_the_run_without_writing_an_adapter(make_config, tmp_path, monkeypatch):
    _poison(monkeypatch, set(range(2, 100)), lambda loss: loss * float("nan"))
    config = make_config(train__max_steps=10, guard__max_consecutive_skips=3, export__every_steps=1)
    with pytest.raises(DifftuneError, match=r"stopped at step 4: 3 optimizer steps in a row were skipped"):
        train(config)
    out = tmp_path / "run"
    assert not (out / "pytorch_lora_weights.safetensors").exists()
    # Snapshots of the skipped steps hold the last good weights, unchanged and finite; none from step 4 on.
    snapshots = sorted((out / "snapshots").iterdir())
    assert [p.name for p in snapshots] == [f"step-00000{i}.safetensors" for i in (1, 2, 3)]
    first = load_file(snapshots[0])
    assert all(torch.isfinite(t).all() for t in first.values())
    for later in snapshots[1:]:
        assert all(torch.equal(first[k], v) for k, v in load_file(later).items())


@pytest.mark.parametrize("guard_on", [True, False])
def test_a_loss_spike_is_skipped_only_with_the_guard_on(make_config, tmp_path, monkeypatch, guard_on):
    clean = train(make_config(train__max_steps=5, train__output_dir=str(tmp_path / "clean")))
    _poison(monkeypatch, {6}, lambda loss: loss * 100)
    spiked = train(
        make_config(
            train__max_steps=6,
            guard__enabled=guard_on,
            guard__spike_warmup_steps=3,
            train__output_dir=str(tmp_path / "spike"),
        )
    )
    same = all(
        torch.equal(a, b)
        for a, b in zip(load_file(clean.trained_path).values(), load_file(spiked.trained_path).values(), strict=True)
    )
    assert same == guard_on
    assert read_metrics(tmp_path / "spike")[-1]["skipped"] == guard_on


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_builds_and_steps(name):
    unet_param, text_param = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4))
    # prodigy: a multiplier of the step size it finds, 1 as its authors advise; one for all groups (config.py)
    lr, text_lr = (1.0, 1.0) if name == "prodigy" else (1e-2, 1e-3)
    config = OptimConfig(optimizer=name, learning_rate=lr, text_encoder_learning_rate=text_lr)
    needs = {"adamw_8bit": ("bitsandbytes", "bnb"), "galore_adamw": ("galore_torch", "galore")}.get(name)
    if needs and importlib.util.find_spec(needs[0]) is None:
        with pytest.raises(DifftuneError, match=rf"needs {needs[0]}: `pip install difftune\[{needs[1]}\]`"):
            build_optimizer(
                {"unet.w": unet_param, "text_encoder.w": text_param}, ("text_encoder",), config, torch.device("cpu")
            )
        return
    if name == "adamw_cpu_offload":  # CUDA only: on the CPU there is nothing to offload from
        with pytest.raises(DifftuneError, match="from a CUDA device to the CPU; this run is on cpu"):
            build_optimizer(
                {"unet.w": unet_param, "text_encoder.w": text_param}, ("text_encoder",), config, torch.device("cpu")
            )
        return
    optimizer = build_optimizer(
        {"unet.w": unet_param, "text_encoder.w": text_param}, ("text_encoder",), config, torch.device("cpu")
    )
    assert [group["lr"] for group in optimizer.param_groups] == [lr, text_lr]
    (unet_param.square().sum() + text_param.square().sum()).backward()
    optimizer.step()
    assert (unet_param < 1).all() and (text_param < 1).all()


def test_schedules():
    def lrs(schedule, **extra):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = build_lr_scheduler(optimizer, OptimConfig(lr_schedule=schedule, warmup_steps=2, **extra), 10, 1)
        values = []
        for _ in range(10):
            optimizer.step()
            scheduler.step()
            values.append(scheduler.get_last_lr()[0])
        return values

    assert lrs("constant")[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert lrs("linear")[-1] == pytest.approx(0.0) and lrs("linear")[5] == pytest.approx(0.5)
    assert lrs("cosine")[-1] == pytest.approx(0.0, abs=1e-12)
    restarts = lrs("cosine_with_restarts", lr_cycles=2)
    assert restarts[5] > restarts[4]  # the second cycle restarts high


def test_noise_offset_is_a_per_channel_constant():
    latents = torch.zeros(2, 4, 8, 8)
    plain = draw_timesteps_and_noise([torch.Generator().manual_seed(s) for s in (1, 2)], latents, 1000, LossConfig())
    offset = draw_timesteps_and_noise(
        [torch.Generator().manual_seed(s) for s in (1, 2)], latents, 1000, LossConfig(noise_offset=0.1)
    )
    difference = offset[1] - plain[1]
    assert torch.equal(offset[0], plain[0])
    torch.testing.assert_close(difference, difference[:, :, :1, :1].expand_as(difference))
    assert 0 < difference.abs().max() < 1
    assert torch.equal(offset[2], offset[1])  # no perturbation asked for: the input noise is the target noise
    perturbed = draw_timesteps_and_noise(
        [torch.Generator().manual_seed(s) for s in (1, 2)], latents, 1000, LossConfig(input_perturbation=0.1)
    )
    assert torch.equal(perturbed[1], plain[1]) and not torch.equal(perturbed[2], plain[1])


def test_zero_terminal_snr():
    with pytest.raises(DifftuneError, match="zero_terminal_snr = true needs loss.prediction_type"):
        load_config(None, ["loss.zero_terminal_snr=true"])
    config = load_config(None, ["loss.zero_terminal_snr=true", "loss.prediction_type=v_prediction"]).loss
    scheduler = training_noise_scheduler(build_noise_scheduler(), config)
    assert scheduler.alphas_cumprod[-1].item() == pytest.approx(0.0, abs=1e-6)
    assert build_noise_scheduler().alphas_cumprod[-1].item() > 1e-3


def test_zero_terminal_snr_trains(make_config):
    result = train(make_config(loss__zero_terminal_snr=True, loss__prediction_type="v_prediction", train__max_steps=2))
    assert all(torch.isfinite(torch.tensor(result.losses)))


def test_validation_loss_is_repeatable(make_config, shapes):
    config = make_config(validation__path=str(shapes))
    components = load_components(config.model)
    first = Validator(components, config, torch.device("cpu")).loss(components)
    second = Validator(components, config, torch.device("cpu")).loss(components)
    assert first == second > 0


def test_validation_reads_frozen_text_encoders_once_and_trained_ones_each_pass(make_config, shapes, monkeypatch):
    """While no text encoder trains, a validator encodes its captions once and its later passes give the same loss
    bit for bit without them; a text encoder that trains (or an embedding) is read again at every pass."""
    config = make_config(validation__path=str(shapes))
    components = load_components(config.model)
    family = components.family
    reads = []
    encode = family.conditioning.encode_prompts

    def counted(components, token_ids):
        reads.append(len(next(iter(token_ids.values()))))
        return encode(components, token_ids)

    monkeypatch.setattr(family.conditioning, "encode_prompts", counted)
    for encoder in components.text_encoders.values():  # frozen, as training holds them
        encoder.requires_grad_(False)
    validator = Validator(components, config, torch.device("cpu"))
    first = validator.loss(components)
    once = len(reads)
    assert once > 0 and validator.loss(components) == first and len(reads) == once
    components.text_encoders["text_encoder"].get_input_embeddings().weight.requires_grad_(True)
    assert validator.loss(components) == first and len(reads) == 2 * once


def test_validation_and_previews_during_training(make_config, shapes, tmp_path):
    config = make_config(
        train__max_steps=4,
        validation__path=str(shapes),
        validation__every_steps=2,
        ema__enabled=True,
        sample__prompts=["a red circle"],
        sample__every_steps=2,
        sample__steps=2,
    )
    train(config)
    rows = read_metrics(tmp_path / "run")
    assert ["val_loss" in row for row in rows] == [False, True, False, True]
    assert all("val_loss_ema" in row for row in rows if "val_loss" in row)
    assert (tmp_path / "run" / "samples" / "step-000002" / "grid.png").is_file()
    assert (tmp_path / "run" / "samples" / "grid.png").is_file() and (
        tmp_path / "run" / "samples_ema" / "grid.png"
    ).is_file()


def test_rollback_goes_back_and_skips_the_offending_batches(make_config, tmp_path, monkeypatch):
    _poison(monkeypatch, {5, 6}, lambda loss: loss * float("nan"))  # the 5th and 6th batches
    config = make_config(
        train__max_steps=8,
        checkpoint__every_steps=2,
        guard__rollback=True,
        guard__max_consecutive_skips=2,
    )
    result = train(config)
    out = tmp_path / "run"
    rollbacks = [json.loads(line) for line in (out / "rollbacks.jsonl").read_text().splitlines()]
    assert rollbacks == [
        {"at_step": 6, "to_step": 4, "reason": "2 optimizer steps in a row were skipped", "skipped_micro_batches": 2}
    ]
    rows = read_metrics(out)
    assert [row["step"] for row in rows] == list(range(1, 9))  # steps 5-6 redone once, each step logged once
    assert not any(row["skipped"] for row in rows)  # the redone steps read the batches after the bad ones
    assert len(result.losses) == 10  # 8 steps, 2 of them done twice
    assert all(torch.isfinite(t).all() for t in load_file(out / "pytorch_lora_weights.safetensors").values())


def test_rollback_needs_checkpoints():
    with pytest.raises(DifftuneError, match="guard.rollback needs checkpoint.every_steps"):
        load_config(None, ["guard.rollback=true"])


def test_validation_scores_each_bucket_at_its_own_size(make_config, tmp_path):
    held_out = tmp_path / "held_out"
    held_out.mkdir()
    for i, size in enumerate([(32, 32), (48, 24), (24, 48)]):
        Image.new("RGB", size, (60 * i, 120, 200)).save(held_out / f"{i}.png")
        (held_out / f"{i}.txt").write_text("a shape")
    buckets = {"data__buckets": True, "data__bucket_step": 8, "data__bucket_min_side": 16, "data__bucket_max_side": 64}
    config = make_config(validation__path=str(held_out), **buckets)
    components = load_components(config.model)
    validator = Validator(components, config, torch.device("cpu"))
    examples, _ = scan_examples(config.data.model_copy(update={"path": str(held_out)}))
    factor = 2 ** (len(components.vae.config.block_out_channels) - 1)
    expected = sorted((h // factor, w // factor) for w, h in training_sizes(examples, config.data))
    assert len(set(expected)) == 3
    assert sorted(tuple(g["latents"].shape[-2:]) for g in validator.groups) == expected
    first, second = validator.loss(components), Validator(components, config, torch.device("cpu")).loss(components)
    assert first == second > 0
    train(
        make_config(
            validation__path=str(held_out),
            validation__every_steps=1,
            train__max_steps=2,
            data__path=str(held_out),
            **buckets,
        )
    )
    assert all(row["val_loss"] > 0 for row in read_metrics(tmp_path / "run"))


def test_average_of_one_adapter_is_refused():
    with pytest.raises(DifftuneError, match=r"export.average_last = 1 averages one adapter with itself"):
        load_config(None, ["export.average_last=1", "export.every_steps=10"])


class _OneBlockFamily:
    def monitored_blocks(self, model):
        return {"first": model[0]}


def test_block_activations_record_the_first_forward_of_each_block():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    inputs = torch.randn(5, 4)
    with BlockActivations(_OneBlockFamily(), model) as activations:
        output = model[0](inputs)
        model(inputs * 100)  # a recomputation (checkpointing) or a later micro-step: not recorded
    values = activations.values()
    assert values["act_rms/first"] == pytest.approx(output.square().mean().sqrt().item(), rel=1e-6)
    assert values["act_max/first"] == pytest.approx(output.abs().max().item(), rel=1e-6)
    assert not model[0]._forward_hooks  # removed on exit


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_unet_blocks_are_monitored(tiny_base, tiny_sdxl_base, family):
    components = load_components(ModelConfig(base=str(tiny_base if family == "sd" else tiny_sdxl_base)))
    blocks = components.family.monitored_blocks(components.denoiser)
    assert {"down_blocks.0", "mid_block", "mid_block.attentions.0", "up_blocks.0.resnets.0"} <= set(blocks)
    assert blocks["mid_block"] is components.denoiser.mid_block


def test_the_guard_warns_when_a_block_grows():
    guard = Guard(GuardConfig(activation_spike_factor=10), None)
    for value in (1.0, 1.2, 0.8):
        assert guard.watch_activations({"mid_block": value, "up_blocks.0": 2.0}) == []
    warnings = guard.watch_activations({"mid_block": 11.0, "up_blocks.0": 2.0})
    assert len(warnings) == 1 and "mid_block" in warnings[0] and "10 x" in warnings[0]
    assert "non-finite" in guard.watch_activations({"up_blocks.0": float("inf")})[0]
    restored = Guard(GuardConfig(), None)
    restored.load_state_dict(json.loads(json.dumps(guard.state_dict())))  # checkpoints keep the history as JSON
    assert list(restored.activation_maxima["mid_block"]) == [1.0, 1.2, 0.8, 11.0]


def test_activation_statistics_are_logged_on_their_steps_only(make_config, tmp_path):
    # A factor under 1 makes every record after the warmup a warning: the wiring, not the threshold, is tested.
    config = make_config(
        train__max_steps=5,
        log__activations_every_steps=1,
        guard__activation_spike_factor=0.5,
        train__gradient_checkpointing=True,
    )
    result = train(config)
    metrics = read_metrics(tmp_path / "run")
    assert all("act_rms/mid_block" in line and line["act_max/down_blocks.0"] > 0 for line in metrics)
    assert [bool(line.get("activation_warnings")) for line in metrics] == [False, False, False, True, True]
    assert not any(module._forward_hooks for module in result.components.denoiser.modules())
    quiet = make_config(train__max_steps=3, log__activations_every_steps=2, train__output_dir=str(tmp_path / "every-2"))
    train(quiet)
    assert ["act_rms/mid_block" in line for line in read_metrics(tmp_path / "every-2")] == [False, True, False]


def test_fp8_is_refused_without_fp8_tensor_cores(make_config):
    with pytest.raises(DifftuneError, match=r"needs a GPU with FP8 tensor cores .* this run has no CUDA device"):
        train(make_config(train__mixed_precision="fp8"))


def test_galore_is_for_full_fine_tunes(make_config):
    with pytest.raises(DifftuneError, match="galore_adamw.*is for full fine-tunes"):
        make_config(optim__optimizer="galore_adamw")
