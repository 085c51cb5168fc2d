"""The text encoders and the denoiser by turns on a device that cannot hold both (memory/turns.py): each group comes
as one of its models computes, the other leaving first; a sample drawn so is the sample drawn with both in place, and
afterwards every model is where it was, unhooked. On the CPU nothing moves, so the text encoders are made to look as
though they were elsewhere and the moves are read from the record."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from difftune.config import ModelConfig, SampleConfig
from difftune.families import load_components
from difftune.families.common.drawing import generate_images
from difftune.memory import turns

CPU = torch.device("cpu")


@pytest.fixture
def recorded(monkeypatch):
    """Every `Turns` made, any text encoder counted as off the device (as in host memory on a GPU)."""
    made = []
    real_off, real_init = turns._off, turns.Turns.__init__

    def text_encoders_off(modules, device):
        text = [m for m in modules if m.__class__.__module__.startswith("transformers.")]
        return text if text == modules else real_off(modules, device)

    def init(self, *arguments):
        real_init(self, *arguments)
        made.append(self)

    monkeypatch.setattr(turns, "_off", text_encoders_off)
    monkeypatch.setattr(turns.Turns, "__init__", init)
    return made


def _draw(components):
    config = SampleConfig(prompts=["a purple circle"], steps=2, resolution=32, guidance_scale=3.0)
    return np.asarray(generate_images(components, config, CPU)[0].image)


def test_a_device_without_room_for_both_takes_turns(micro_base, recorded, monkeypatch):
    """The prompt's encoding sends the denoiser away and brings the text encoder; the first step brings the denoiser
    back and sends the text encoder away; the other steps move nothing. The image is the one drawn without turns."""
    components = load_components(ModelConfig(base=str(micro_base("sd"))))
    monkeypatch.setattr(turns, "device_has_room", lambda device, needed: False)
    taken = _draw(components)
    [turn] = recorded
    assert turn.moves == [
        ("denoisers", turns.HOST),
        ("text encoders", CPU),
        ("text encoders", turns.HOST),
        ("denoisers", CPU),
    ]
    assert not any(hasattr(m, "_hf_hook") for m in (components.denoiser, *components.text_encoders.values()))
    monkeypatch.setattr(turns, "_off", lambda modules, device: [])  # everything in place: no turns at all
    assert np.array_equal(_draw(components), taken)
    assert len(recorded) == 1


def test_a_device_with_room_for_both_brings_the_text_encoders_once(micro_base, recorded, monkeypatch):
    components = load_components(ModelConfig(base=str(micro_base("sd"))))
    monkeypatch.setattr(turns, "device_has_room", lambda device, needed: True)
    _draw(components)
    [turn] = recorded
    assert turn.moves == [("text encoders", CPU)]


def test_a_model_another_hook_moves_is_left_as_it_is(micro_base, recorded):
    """A base loaded with a device map (accelerate's hooks already on it): no turns over them."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    components = load_components(ModelConfig(base=str(micro_base("sd"))))
    add_hook_to_module(components.denoiser, ModelHook())
    try:
        _draw(components)
    finally:
        remove_hook_from_module(components.denoiser)
    assert recorded == []


def test_a_text_encoder_read_by_its_parts_comes_for_them(micro_base, recorded, monkeypatch):
    """Qwen-Image 2.1's captions are read by its language model's `model` alone, not the whole encoder's forward (as
    validation encodes held-out captions): the part's call brings the text encoders, and the states are those read
    with everything in place."""
    components = load_components(ModelConfig(base=str(micro_base("qwen_image21"))))
    conditioning = components.family.conditioning
    tokens = conditioning.tokenize(components.tokenizers, ["a purple circle"])
    with torch.no_grad():
        expected = conditioning.encode_prompts(components, tokens)
        monkeypatch.setattr(turns, "device_has_room", lambda device, needed: False)
        text = list(components.text_encoders.values())
        with turns.taking_turns(text, [components.denoiser], CPU) as turn:
            got = conditioning.encode_prompts(components, tokens)
    assert turn.moves == [("denoisers", turns.HOST), ("text encoders", CPU)]
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0)
