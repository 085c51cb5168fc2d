"""Preference tuning (Diffusion-DPO): the loss as the paper and diffusers' example write it, the reference as the
base with the adapter switched off, pairs in the edit pairs' layout, and the settings it cannot train with."""

import math

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model

from difftune.adapters.trained import adapters_switched_off
from difftune.errors import DifftuneError
from difftune.families import FAMILIES
from difftune.training.metrics import read_metrics
from difftune.training.preference import check_preference_pairs, dpo_loss
from difftune.training.train import train


def _adapted_linear(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Linear]:
    """A linear layer with a LoRA whose B is not zero (so the adapter changes its output), and a copy of its base."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4))
    base = torch.nn.Linear(6, 4)
    base.load_state_dict(model[0].state_dict())
    model = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=["0"]), model)
    with torch.no_grad():
        model[0].lora_B["default"].weight.normal_()
    return model, base


def test_dpo_loss_is_the_papers_against_the_base_with_the_adapter_off():
    model, base = _adapted_linear()
    generator = torch.Generator().manual_seed(1)
    chosen, rejected = torch.randn(3, 6, generator=generator), torch.randn(3, 6, generator=generator)
    target = torch.randn(3, 4, generator=generator)
    beta = 3.0

    def loss_of_model(latents):
        return ((model(latents) - target) ** 2).mean(dim=1)

    loss = dpo_loss(loss_of_model, model, chosen, rejected, beta)

    def mse(module, latents):
        return ((module(latents) - target) ** 2).mean(dim=1)

    with torch.no_grad():
        model_gap = mse(model, chosen) - mse(model, rejected)
        reference_gap = mse(base, chosen) - mse(base, rejected)  # the base alone, never the adapted layer
    expected = -torch.nn.functional.logsigmoid(-beta / 2 * (model_gap - reference_gap))
    torch.testing.assert_close(loss, expected)
    assert loss.shape == (3,) and not torch.allclose(model_gap, reference_gap)

    loss.sum().backward()  # only the model's terms carry gradients, into the adapter
    lora_b = model[0].lora_B["default"].weight
    assert lora_b.grad is not None and lora_b.grad.abs().sum() > 0
    assert model[0].base_layer.weight.grad is None


def test_the_reference_reads_with_every_adapter_off_and_the_chosen_loss_is_added_at_its_weight():
    """A trained text encoder's adapter is off in the reference too (`reference_loss_of` reads the captions anew inside
    the switched-off block), and `chosen_weight` adds the model's own loss on the chosen images."""
    denoiser, base_denoiser = _adapted_linear(0)
    encoder, base_encoder = _adapted_linear(1)
    generator = torch.Generator().manual_seed(2)
    chosen, rejected = torch.randn(3, 6, generator=generator), torch.randn(3, 6, generator=generator)
    caption, target = torch.randn(3, 6, generator=generator), torch.randn(3, 4, generator=generator)
    encoded = encoder(caption)  # read once with the adapter on, as the step reads the captions

    def loss_of(latents):
        return ((denoiser(latents) + encoded - target) ** 2).mean(dim=1)

    def reference_loss_of(latents):
        return ((denoiser(latents) + encoder(caption) - target) ** 2).mean(dim=1)

    model = torch.nn.ModuleList([denoiser, encoder])
    loss = dpo_loss(loss_of, model, chosen, rejected, 3.0, chosen_weight=0.5, reference_loss_of=reference_loss_of)

    def mse(denoiser_, encoder_, latents):
        return ((denoiser_(latents) + encoder_(caption) - target) ** 2).mean(dim=1)

    with torch.no_grad():
        model_gap = mse(denoiser, encoder, chosen) - mse(denoiser, encoder, rejected)
        reference_gap = mse(base_denoiser, base_encoder, chosen) - mse(base_denoiser, base_encoder, rejected)
        expected = -torch.nn.functional.logsigmoid(-1.5 * (model_gap - reference_gap))
        expected += 0.5 * mse(denoiser, encoder, chosen)
    torch.testing.assert_close(loss.detach(), expected)
    loss.sum().backward()  # the text encoder's adapter learns through the model's terms
    assert encoder[0].lora_B["default"].weight.grad.abs().sum() > 0


def test_the_adapter_is_switched_back_on_with_its_trained_weights_trainable():
    model, base = _adapted_linear()
    inputs = torch.randn(2, 6)
    adapted = model(inputs)
    with adapters_switched_off(model):
        torch.testing.assert_close(model(inputs), base(inputs))
    torch.testing.assert_close(model(inputs), adapted)
    assert model[0].lora_A["default"].weight.requires_grad and not model[0].base_layer.weight.requires_grad


def _dpo_job(make_config, pairs, tmp_path, **overrides):
    settings = {
        "data__path": str(pairs),
        "preference__method": "dpo",
        "preference__beta": 50.0,
        "adapter__text_encoder": False,
        "train__max_steps": 8,
        "train__output_dir": str(tmp_path / "dpo"),
        "optim__learning_rate": 1e-2,
        **overrides,
    }
    return make_config(**settings)


@pytest.mark.parametrize("cached", [False, True])
def test_a_dpo_run_starts_at_log_2_and_separates_its_pairs(make_config, pairs, tmp_path, cached):
    """At the first step the adapter is zero, so the model is its reference and every pair's loss is log 2; then
    the LoRA learns to tell chosen from rejected and the loss falls below it."""
    config = _dpo_job(
        make_config,
        pairs,
        tmp_path,
        cache__latents=cached,
        cache__text=cached,
        cache__dir=str(tmp_path / "cache"),
        train__output_dir=str(tmp_path / f"dpo-{cached}"),
    )
    train(config)
    losses = [row["loss"] for row in read_metrics(tmp_path / f"dpo-{cached}")]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert len(losses) == 8 and min(losses[4:]) < math.log(2) - 0.01


def test_an_image_without_a_rejected_one_is_named(make_config, shapes, tmp_path):
    with pytest.raises(DifftuneError, match=r"data\.path: .*0000\.png has no rejected image; .*control"):
        train(_dpo_job(make_config, shapes, tmp_path))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"adapter__kind": "none"}, r'adapter\.kind = "none" \(use lora'),
        ({"prior__class_path": "/tmp"}, r"\[prior\]"),
    ],
)
def test_settings_dpo_cannot_train_with_are_refused(make_config, pairs, tmp_path, overrides, message):
    with pytest.raises(DifftuneError, match=r'preference\.method = "dpo" cannot train with .*' + message):
        _dpo_job(make_config, pairs, tmp_path, **overrides)


def test_an_edit_base_is_refused(make_config, pairs, kontext_base, tmp_path):
    with pytest.raises(DifftuneError, match=r"read control images as their input; preference tuning takes"):
        train(_dpo_job(make_config, pairs, tmp_path, model__base=str(kontext_base), sample__prompts=[]))


@pytest.mark.parametrize(
    ("name", "refused"), [("flux3", False), ("flux2", False), ("z_image_omni", True), ("qwen_image_edit", True)]
)
def test_bases_that_also_edit_take_preference_pairs_unless_their_prompts_read_the_references(name, refused):
    """FLUX.3 and FLUX.2 edit too, but their text-to-image bases read a pair's control as the rejected image; Z-Image
    Omni's captions are read with their references (the rejected image would be read as one), and an edit base's
    controls are its input."""
    family = FAMILIES[name]
    if refused:
        with pytest.raises(DifftuneError, match=r"read control images as their input"):
            check_preference_pairs([], family)
    else:
        check_preference_pairs([], family)
