"""16-bit storage with fp32 compute (`model.weight_dtype = fp16|bf16`, `train.mixed_precision = no`): training is
exactly fp32 training of a base whose stored layers were rounded to 16 bits, and autograd keeps no fp32 copy."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from diffusers import StableDiffusionPipeline
from peft import LoraConfig
from safetensors.torch import load_file

from difftune import storage
from difftune.train import train

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _round_frozen_layers(model, dtype):
    """What storage keeps of `model`, as fp32: its frozen linear and convolution weights and biases rounded to `dtype`."""
    for layer in model.modules():
        if type(layer) in storage.STORED_LAYERS and not layer.weight.requires_grad:
            for tensor in (layer.weight, layer.bias):
                if tensor is not None:
                    tensor.data = tensor.data.to(dtype).float()


def _rounded_base(tiny_base, tmp_path, dtype):
    """The tiny base with its UNet's linear and convolution weights and biases rounded to `dtype`, kept fp32."""
    pipeline = StableDiffusionPipeline.from_pretrained(tiny_base, safety_checker=None)
    _round_frozen_layers(pipeline.unet.requires_grad_(False), dtype)
    path = tmp_path / "rounded-base"
    pipeline.save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_stored_training_is_fp32_training_of_the_rounded_base(make_config, tiny_base, tmp_path, name):
    settings = dict(train__max_steps=4, optim__learning_rate=1e-2, sample__prompts=["a red circle"], sample__parity=True)
    stored = train(make_config(model__weight_dtype=name, train__output_dir=str(tmp_path / "stored"), **settings))
    reference = train(make_config(
        model__base=str(_rounded_base(tiny_base, tmp_path, DTYPES[name])), train__output_dir=str(tmp_path / "ref"), **settings,
    ))
    assert stored.losses == pytest.approx(reference.losses, rel=1e-6)
    expected = load_file(reference.trained_path)
    for key, value in load_file(stored.trained_path).items():
        torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-7, msg=key)
    # The denoiser's frozen layers really are 16-bit; the end-of-run parity check reloads them the same way.
    unet = stored.components.denoiser
    originals = [p for n, p in unet.named_parameters() if n.endswith("parametrizations.weight.original")]
    assert originals and all(p.dtype == DTYPES[name] and not p.requires_grad for p in originals)
    assert all(p.dtype == torch.float32 for n, p in unet.named_parameters() if p.requires_grad)
    parity = json.loads((tmp_path / "stored" / "parity.json").read_text())
    assert all(layout["max_pixel_difference"] <= 1 for layout in parity["layouts"].values())


def _tiny_unet_with_lora(tiny_base):
    pipeline = StableDiffusionPipeline.from_pretrained(tiny_base, safety_checker=None)
    unet = pipeline.unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    return unet


def test_autograd_keeps_16_bit_sources_not_fp32_copies(tiny_base):
    unet = _tiny_unet_with_lora(tiny_base)
    reference = copy.deepcopy(unet)  # the same random adapter
    assert storage.store_frozen_layers(unet, torch.float16) > 0
    torch.manual_seed(0)
    inputs = (torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.randn(2, 77, unet.config.cross_attention_dim))

    def held_copies() -> int:
        return sum(storage._holders(buffer) > 1 for buffers in storage._BUFFERS.by_size.values() for buffer in buffers)

    with storage.fp32_copies_saved_as_stored():
        output = unet(*inputs).sample
    assert held_copies() == 0  # between forward and backward: every saved weight is a 16-bit source
    output.square().mean().backward()
    grads = {n: p.grad for n, p in unet.named_parameters() if p.requires_grad}

    unheld = unet(*inputs).sample  # without the hooks autograd keeps the fp32 copies (so the check above can fail)
    assert held_copies() > 0
    del unheld

    # The same numbers as fp32 layers holding the rounded weights.
    _round_frozen_layers(reference, torch.float16)
    reference(*inputs).sample.square().mean().backward()
    for name, param in reference.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_adapter_layers_stay_fp32_when_an_adapter_is_loaded_frozen(tiny_base):
    unet = _tiny_unet_with_lora(tiny_base)
    unet.requires_grad_(False)  # as when a saved adapter is loaded to sample: its layers are frozen too
    storage.store_frozen_layers(unet, torch.bfloat16)
    lora = {n: p.dtype for n, p in unet.named_parameters() if "lora_" in n}
    assert lora and set(lora.values()) == {torch.float32}
