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
