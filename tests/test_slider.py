"""Concept sliders: the loss as ai-toolkit's slider and the paper define it, checked against the base's and the LoRA's
predictions computed apart (the base from an unadapted copy, the -1 scale from the LoRA's B negated by hand); a run
that trains; the settings a slider cannot train with."""

import pytest
import torch

from difftune.adapters.trained import add_adapters
from difftune.config import load_config
from difftune.errors import DifftuneError
from difftune.families import load_components
from difftune.training.metrics import read_metrics
from difftune.training.slider import PROMPTS, encoded_prompts, slider_loss
from difftune.training.train import train

SLIDER = ["slider.target=a circle", "slider.positive=a red circle", "slider.negative=a blue circle"]


def test_the_slider_loss_is_the_base_moved_both_ways(tiny_base):
    config = load_config(None, [f"model.base={tiny_base}", "adapter.rank=4", "adapter.text_encoder=false", *SLIDER])
    components, base = load_components(config.model), load_components(config.model)
    add_adapters(components, config.adapter)
    generator = torch.Generator().manual_seed(0)
    lora_b = [m for name, m in components.denoiser.named_parameters() if "lora_B" in name]
    with torch.no_grad():
        for parameter in lora_b:
            parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    prompts = encoded_prompts(components, config.slider, torch.device("cpu"))
    latents = torch.randn(2, 4, 8, 8, generator=generator)
    noise = torch.randn(2, 4, 8, 8, generator=generator)
    timesteps = torch.tensor([100, 700])
    geometry = torch.zeros(2, 6)
    loss = slider_loss(components, latents, timesteps, noise, prompts, geometry, guidance=2.0)

    noisy = base.noise_scheduler.add_noise(latents, noise, timesteps)

    def unet(model, prompt):
        states = prompts[prompt]["encoder_hidden_states"].expand(2, -1, -1)
        return model(noisy, timesteps, states).sample

    with torch.no_grad():
        neutral = unet(base.denoiser, "target")
        direction = 2.0 * (unet(base.denoiser, "positive") - unet(base.denoiser, "negative"))
        plus = unet(components.denoiser, "target")
        for parameter in lora_b:
            parameter.neg_()
        minus = unet(components.denoiser, "target")
        for parameter in lora_b:
            parameter.neg_()
    expected = (
        (plus - neutral - direction).square().mean((1, 2, 3)) + (minus - neutral + direction).square().mean((1, 2, 3))
    ) / 2
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(plus, minus) and set(prompts) == set(PROMPTS)
    torch.testing.assert_close(unet(components.denoiser, "target"), plus)  # its scale back at +1 after


def test_a_slider_run_trains_and_starts_at_the_base(make_config, tmp_path):
    """At the first step the LoRA is zero, so both scales predict the base's neutral and the loss is the direction's
    mean square; the LoRA then learns to move along it and the loss falls."""
    settings = {"slider__target": "a circle", "slider__positive": "a red circle", "slider__negative": "a blue circle"}
    config = make_config(
        **settings, adapter__text_encoder=False, train__max_steps=30, train__output_dir=str(tmp_path / "slider")
    )
    train(config)
    losses = [row["loss"] for row in read_metrics(tmp_path / "slider")]
    assert len(losses) == 30 and min(losses[-10:]) < losses[0]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["adapter.kind=dora"], r'adapter\.kind = "dora" \(a slider is a LoRA'),
        (["adapter.text_encoder=true"], r"adapter\.text_encoder = true"),
        (["train.gradient_checkpointing=true"], r"train\.gradient_checkpointing"),
        (["preference.method=dpo", "adapter.text_encoder=false"], r'preference\.method = "dpo"'),
        (["slider.negative="], r"set both slider\.positive and slider\.negative"),
    ],
)
def test_settings_a_slider_cannot_train_with_are_refused(overrides, message):
    with pytest.raises(DifftuneError, match=message):
        load_config(None, [*SLIDER, "adapter.text_encoder=false", *overrides])
