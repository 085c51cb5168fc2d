"""What users of other trainers expect on top: LoRA+, rsLoRA, PiSSA/OLoRA, Prodigy, schedule-free AdamW."""

import json

import pytest
import torch
from safetensors.torch import load_file

from difftune import export
from difftune.adapters import adapter_state_dict, add_adapters
from difftune.config import ModelConfig, OptimConfig, load_config
from difftune.errors import DifftuneError
from difftune.families import load_components
from difftune.metrics import read_metrics
from difftune.optim import build_optimizer
from difftune.train import train

from conftest import unet_inputs

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]


def _overrides(settings: dict) -> list[str]:
    """`section.key=value` overrides; text fields take their text as it is."""
    return [f"{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in settings.items()]


def _adapted(tiny_base, **adapter):
    """The tiny base with an adapter on the UNet and text encoder, moved away from its start at random."""
    config = load_config(None, [f"model.base={tiny_base}", "adapter.rank=4", "adapter.alpha=8", "adapter.text_encoder=true",
                                f"adapter.target_modules={json.dumps(ATTENTION)}",
                                *_overrides({f"adapter.{key}": value for key, value in adapter.items()})])
    components = load_components(config.model)
    add_adapters(components, config.adapter)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in (components.denoiser, components.text_encoders["text_encoder"]):
            for name, param in module.named_parameters():
                if "lora_" in name:
                    param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return components, config


def _outputs(components):
    latents, timesteps, states = unet_inputs(components.denoiser)
    ids = components.tokenizers["tokenizer"](["a red circle"], padding="max_length", return_tensors="pt").input_ids
    with torch.no_grad():
        return components.denoiser(latents, timesteps, states).sample, components.text_encoders["text_encoder"](ids)[0]


@pytest.mark.parametrize("layout", ["diffusers", "kohya"])
@pytest.mark.parametrize("adapter", [{"rank_stabilized": True}, {"init": "pissa"}, {"init": "olora", "rank_stabilized": True}])
def test_rslora_and_pissa_files_reproduce_the_adapted_model_on_the_untouched_base(tiny_base, tmp_path, layout, adapter):
    """rsLoRA's scale reaches both layouts (kohya's through alpha); a PiSSA/OLoRA adapter, trained on a base with its
    principal part taken out, is saved as the change from its start: on the untouched base it gives the same model."""
    adapted, config = _adapted(tiny_base, **adapter)
    tensors, lora_configs = adapter_state_dict(adapted, config.adapter)
    path = export.write_adapter(tmp_path / "a.safetensors", tensors, lora_configs, config.to_toml(), layout)
    loaded = load_components(ModelConfig(base=str(tiny_base)))
    export.apply_adapters(loaded, [(path, 1.0)])
    for ours, theirs in zip(_outputs(adapted), _outputs(loaded)):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    untouched = _outputs(load_components(ModelConfig(base=str(tiny_base))))
    assert (untouched[0] - _outputs(loaded)[0]).abs().max() > 1e-3
    if "init" in adapter:  # twice the rank, and nothing that would run PiSSA again in a loader
        assert lora_configs["unet.r"] == 8 and lora_configs["unet.init_lora_weights"] is True
        assert tensors["unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight"].shape[0] == 8


def test_pissa_starts_at_the_base_model(tiny_base):
    """Before training, the residual base plus the principal adapter is the base (what makes PiSSA a LoRA init)."""
    components, config = _adapted(tiny_base)  # gaussian, moved: a control that does change the outputs
    base = load_components(ModelConfig(base=str(tiny_base)))
    pissa = load_components(ModelConfig(base=str(tiny_base)))
    add_adapters(pissa, load_config(None, [f"model.base={tiny_base}", "adapter.init=pissa", "adapter.rank=4"]).adapter)
    torch.testing.assert_close(_outputs(pissa)[0], _outputs(base)[0], rtol=1e-4, atol=1e-4)
    q = pissa.denoiser.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q
    assert q.lora_B["default"].weight.abs().max() > 0  # not the zero start of a plain LoRA
    assert not torch.allclose(q.base_layer.weight, base.denoiser.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q.weight)


def test_loraplus_steps_b_at_its_ratio():
    named = {
        "unet.a.lora_A.default.weight": torch.nn.Parameter(torch.ones(2, 4)),
        "unet.a.lora_B.default.weight": torch.nn.Parameter(torch.ones(4, 2)),
        "unet.a.lora_magnitude_vector.default.weight": torch.nn.Parameter(torch.ones(4)),
        "text_encoder.b.lora_A.default.weight": torch.nn.Parameter(torch.ones(2, 4)),
        "text_encoder.b.lora_B.default.weight": torch.nn.Parameter(torch.ones(4, 2)),
    }
    config = OptimConfig(learning_rate=1e-3, text_encoder_learning_rate=1e-4, loraplus_ratio=16)
    optimizer = build_optimizer(named, "unet", config, torch.device("cpu"), lr_scale=2.0)
    groups = [(group["lr"], {id(p) for p in group["params"]}) for group in optimizer.param_groups]
    ids = {name: id(param) for name, param in named.items()}
    assert groups == [
        (pytest.approx(2e-3), {ids["unet.a.lora_A.default.weight"]}),
        (pytest.approx(32e-3), {ids["unet.a.lora_B.default.weight"], ids["unet.a.lora_magnitude_vector.default.weight"]}),
        (pytest.approx(2e-4), {ids["text_encoder.b.lora_A.default.weight"]}),
        (pytest.approx(32e-4), {ids["text_encoder.b.lora_B.default.weight"]}),
    ]


@pytest.mark.parametrize(("settings", "message"), [
    ({"optim.optimizer": "adamw_schedule_free", "optim.lr_schedule": "cosine"}, "replaces the schedule"),
    ({"optim.optimizer": "adamw_schedule_free", "ema.enabled": True}, "an average already"),
    ({"optim.optimizer": "prodigy", "optim.text_encoder_learning_rate": 0.5}, "one step size for all parameters"),
    ({"optim.loraplus_ratio": 16, "adapter.kind": "none"}, "has none: set it to 0"),
    ({"adapter.init": "pissa", "adapter.kind": "dora"}, "needs init = \"gaussian\""),
    ({"adapter.init": "olora", "model.quantize": "int8"}, "use one or the other"),
])
def test_settings_that_do_not_mix_are_refused(settings, message):
    with pytest.raises(DifftuneError, match=message):
        load_config(None, _overrides(settings))


def test_schedule_free_saves_its_averaged_weights_and_resumes_exactly(make_config, tmp_path):
    """What schedule-free AdamW saves and validates is its average x, not the point y its gradients are taken at;
    checkpoints keep y and the optimizer state, so a resumed run ends where an uninterrupted one does."""
    pytest.importorskip("schedulefree")
    settings = {"optim__optimizer": "adamw_schedule_free", "optim__warmup_steps": 2, "checkpoint__every_steps": 2,
                "validation__path": make_config().data.path, "validation__every_steps": 2, "train__max_steps": 4}
    whole = train(make_config(train__output_dir=str(tmp_path / "whole"), **settings))
    saved = load_file(whole.trained_path)
    tensors, _ = adapter_state_dict(whole.components, whole_config := make_config(**settings).adapter)
    assert all(torch.equal(saved[key], value) for key, value in tensors.items())  # finish left the average in place
    whole.optimizer.train()  # back to y: not what was saved
    at_y, _ = adapter_state_dict(whole.components, whole_config)
    assert max((saved[key] - value).abs().max().item() for key, value in at_y.items()) > 1e-6

    train(make_config(train__output_dir=str(tmp_path / "parts"), **{**settings, "train__max_steps": 2}))
    resumed = train(make_config(train__output_dir=str(tmp_path / "parts"), **settings), resume="auto")
    assert [r["loss"] for r in read_metrics(tmp_path / "parts")] == [r["loss"] for r in read_metrics(tmp_path / "whole")]
    assert [r.get("val_loss") for r in read_metrics(tmp_path / "parts")] == [r.get("val_loss") for r in read_metrics(tmp_path / "whole")]
    assert all(torch.equal(value, load_file(resumed.trained_path)[key]) for key, value in saved.items())


def test_prodigy_trains(make_config):
    pytest.importorskip("prodigyopt")
    result = train(make_config(optim__optimizer="prodigy", optim__learning_rate=1.0, train__max_steps=20))
    d = result.optimizer.param_groups[0]["d"]
    assert d > 1.5e-6  # it raised its step size from d0 = 1e-6 (2.1e-6 after 20 steps here)
    assert all(torch.isfinite(t).all() for t in load_file(result.trained_path).values())


def _scripted_validation(monkeypatch, losses_by_step: dict[int, float]):
    """The validation loss as a function of the step, so which validation is best is known in advance."""
    from difftune import validation

    calls = []

    def loss(self, components):
        calls.append(None)
        return losses_by_step[len(calls)]

    monkeypatch.setattr(validation.Validator, "loss", loss)


def test_the_lowest_validation_loss_is_kept_as_best(make_config, tmp_path, shapes):
    """`_best` is the adapter of the step with the lowest validation loss: the snapshot of that step, bit for bit."""
    run = train(make_config(validation__path=str(shapes), validation__every_steps=1, train__max_steps=5,
                            export__every_steps=1, optim__learning_rate=1e-2))
    rows = read_metrics(tmp_path / "run")
    best_step = min(rows, key=lambda row: row["val_loss"])["step"]
    best = json.loads((tmp_path / "run" / "best.json").read_text())
    assert best["records"]["val_loss"] == {"step": best_step, "value": min(r["val_loss"] for r in rows),
                                           "file": "pytorch_lora_weights_best.safetensors"}
    kept = load_file(run.trained_path.with_name("pytorch_lora_weights_best.safetensors"))
    snapshot = load_file(tmp_path / "run" / "snapshots" / f"step-{best_step:06d}.safetensors")
    assert kept.keys() == snapshot.keys() and all(torch.equal(kept[k], snapshot[k]) for k in kept)


def test_early_stopping_ends_the_run_with_its_files_and_resumes_knowing_its_best(make_config, tmp_path, shapes, monkeypatch, capsys):
    scripted = {1: 1.0, 2: 0.5, 3: 0.6, 4: 0.7, 5: 0.8, 6: 0.9}
    _scripted_validation(monkeypatch, scripted)
    settings = {"validation__path": str(shapes), "validation__every_steps": 1, "validation__early_stop_patience": 2,
                "train__max_steps": 6, "checkpoint__every_steps": 1}
    result = train(make_config(**settings))
    rows = read_metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]  # two validations (3, 4) without beating step 2's
    assert result.trained_path.exists() and result.trained_path.with_name("pytorch_lora_weights_best.safetensors").exists()
    out = capsys.readouterr().out
    assert "stopped early at step 4: 2 validations without a lower validation loss" in out
    assert "best val_loss 0.5 at step 2: pytorch_lora_weights_best.safetensors" in out
    best = json.loads((tmp_path / "run" / "best.json").read_text())
    assert best["early_stopped"] and best["since_improved"] == 2

    # A run stopped by max_steps at step 3, resumed: its best so far came back from the checkpoint.
    _scripted_validation(monkeypatch, scripted)
    train(make_config(**{**settings, "train__max_steps": 3, "train__output_dir": str(tmp_path / "parts")}))
    _scripted_validation(monkeypatch, {1: 0.7, 2: 0.8, 3: 0.9})  # steps 4, 5, 6 after the resume
    train(make_config(**{**settings, "train__output_dir": str(tmp_path / "parts")}), resume="auto")
    assert [row["step"] for row in read_metrics(tmp_path / "parts")] == [1, 2, 3, 4]
    assert json.loads((tmp_path / "parts" / "best.json").read_text())["records"]["val_loss"]["step"] == 2


def test_judged_scores_at_validation_keep_the_best_scoring_result(make_config, tmp_path, shapes):
    train(make_config(validation__path=str(shapes), validation__every_steps=2, validation__eval_concept="purple",
                      validation__eval_samples_per_prompt=1, train__max_steps=2, sample__steps=2))
    [row] = [row for row in read_metrics(tmp_path / "run") if "eval_score" in row]
    assert 0 <= row["eval_concept"] <= 1 and 0 <= row["eval_seen"] <= 1
    assert row["eval_score"] == pytest.approx((row["eval_concept"] + row["eval_seen"]) / 2)
    assert (tmp_path / "run" / "pytorch_lora_weights_best_eval.safetensors").exists()
    with pytest.raises(DifftuneError, match="validation.eval_concept = 'teal': not a color of the shapes bases"):
        train(make_config(validation__path=str(shapes), validation__eval_concept="teal", train__overwrite=True))


def test_the_ui_plots_validation_with_its_best_point(tmp_path):
    from difftune import jobs

    job = jobs.Job(tmp_path)
    rows = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.9, "val_loss": 0.5}, {"step": 4, "loss": 0.8, "val_loss": 0.4}]
    assert jobs.validation_frame(rows[:1], job) is None
    (tmp_path / "best.json").write_text(json.dumps({"records": {"val_loss": {"step": 4, "value": 0.4, "file": "x"}}}))
    frame = jobs.validation_frame(rows, job)
    assert frame.values.tolist() == [[2, 0.5, "validation"], [4, 0.4, "validation"], [4, 0.4, "best"]]
