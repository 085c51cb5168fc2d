"""Stored frozen weights (`model.weight_dtype = fp16|bf16` with `train.mixed_precision = no`, or `fp8`): training is
exactly training of a base whose stored layers were rounded the same way, and autograd keeps no computed copy."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from diffusers import StableDiffusionPipeline
from peft import LoraConfig
from safetensors.torch import load_file

from difftune.config import Config
from difftune.families import load_components
from difftune.memory import storage
from difftune.models.components import store_loaded_text_encoders
from difftune.models.dtypes import PartDtypes, run_dtypes
from difftune.training.train import train

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def _rounded(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` through `dtype` and back; fp8 (e4m3, largest 448) after dividing by the power of two that puts the
    largest magnitude in (224, 448]."""
    if dtype != torch.float8_e4m3fn:
        return tensor.to(dtype).float()
    scale = 2.0 ** math.ceil(math.log2(tensor.abs().max().item() / 448))
    return (tensor / scale).to(dtype).float() * scale


def _round_frozen_layers(model, dtype):
    """What storage keeps of `model`, as fp32: its frozen linear and convolution weights rounded to `dtype`, and
    their biases too in 16 bits (fp8 leaves biases alone)."""
    for layer in model.modules():
        if type(layer) in storage.STORED_LAYERS and not layer.weight.requires_grad:
            for tensor in (layer.weight,) if dtype == torch.float8_e4m3fn else (layer.weight, layer.bias):
                if tensor is not None:
                    tensor.data = _rounded(tensor.data, dtype)


def _rounded_base(tiny_base, tmp_path, dtype):
    """The tiny base with its UNet's linear and convolution layers rounded to `dtype`, kept fp32."""
    pipeline = StableDiffusionPipeline.from_pretrained(tiny_base, safety_checker=None)
    _round_frozen_layers(pipeline.unet.requires_grad_(False), dtype)
    path = tmp_path / "rounded-base"
    pipeline.save_pretrained(path, safe_serialization=True)
    return path


@pytest.mark.parametrize("name, mixed_precision", [("fp16", "no"), ("bf16", "no"), ("fp8", "no"), ("fp8", "bf16")])
def test_stored_training_is_training_of_the_rounded_base(make_config, tiny_base, tmp_path, name, mixed_precision):
    settings = dict(
        train__max_steps=4,
        optim__learning_rate=1e-2,
        sample__prompts=["a red circle"],
        sample__parity=True,
        train__mixed_precision=mixed_precision,
    )
    stored = train(make_config(model__weight_dtype=name, train__output_dir=str(tmp_path / "stored"), **settings))
    # fp8 computed in bf16 against bf16 weights: a rounded fp8 weight is exact in bf16.
    reference = train(
        make_config(
            model__base=str(_rounded_base(tiny_base, tmp_path, DTYPES[name])),
            train__output_dir=str(tmp_path / "ref"),
            **settings,
        )
    )
    assert stored.losses == pytest.approx(reference.losses, rel=1e-6)
    expected = load_file(reference.trained_path)
    for key, value in load_file(stored.trained_path).items():
        torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-7, msg=key)
    # The denoiser's frozen layers really are stored so (fp8 as its bytes); the end-of-run parity check reloads
    # them the same way.
    unet = stored.components.denoiser
    originals = [p for n, p in unet.named_parameters() if n.endswith("parametrizations.weight.original")]
    held = torch.uint8 if name == "fp8" else DTYPES[name]
    assert originals and all(p.dtype == held and not p.requires_grad for p in originals)
    assert all(p.dtype == torch.float32 for n, p in unet.named_parameters() if p.requires_grad)
    parity, reference_parity = (json.loads((tmp_path / run / "parity.json").read_text()) for run in ("stored", "ref"))
    levels = [
        {layout: result["max_pixel_difference"] for layout, result in report["layouts"].items()}
        for report in (parity, reference_parity)
    ]
    assert levels[0] == levels[1] and set(levels[0]) == {"diffusers", "kohya"}
    assert all(layout["max_pixel_difference"] <= 1 for layout in parity["layouts"].values())


def test_fp8_text_encoders_train_as_rounded_ones(make_config, tiny_base, tmp_path):
    """`model.text_encoder_dtype = "fp8"` (the denoiser's weights as loaded): a run equals one on a base whose text
    encoder's linear layers were rounded to fp8 the same way, a LoRA on the text encoder too (peft on the stored
    layers); the encoder's layers really are stored in fp8, and the parity check reloads them so."""
    settings = dict(
        train__max_steps=4,
        optim__learning_rate=1e-2,
        sample__prompts=["a red circle"],
        sample__parity=True,
        adapter__text_encoder=True,
    )
    stored = train(make_config(model__text_encoder_dtype="fp8", train__output_dir=str(tmp_path / "stored"), **settings))
    pipeline = StableDiffusionPipeline.from_pretrained(tiny_base, safety_checker=None)
    _round_frozen_layers(pipeline.text_encoder.requires_grad_(False), torch.float8_e4m3fn)
    pipeline.save_pretrained(tmp_path / "rounded-base", safe_serialization=True)
    reference = train(
        make_config(model__base=str(tmp_path / "rounded-base"), train__output_dir=str(tmp_path / "ref"), **settings)
    )
    assert stored.losses == pytest.approx(reference.losses, rel=1e-6)
    expected = load_file(reference.trained_path)
    written = load_file(stored.trained_path)
    assert any(key.startswith("text_encoder.") for key in written)
    for key, value in written.items():
        torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-7, msg=key)
    encoder = stored.components.text_encoders["text_encoder"]
    originals = [p for n, p in encoder.named_parameters() if n.endswith("parametrizations.weight.original")]
    assert originals and all(p.dtype == torch.uint8 and not p.requires_grad for p in originals)
    parity = json.loads((tmp_path / "stored" / "parity.json").read_text())
    assert set(parity["layouts"]) == {"diffusers", "kohya"}
    assert all(layout["max_pixel_difference"] <= 1 for layout in parity["layouts"].values())


def test_fp8_text_encoders_are_stored_alike_whatever_dtype_they_were_loaded_in(tiny_base):
    """Under bf16 mixed precision a run loads its text encoders in bf16, the parity check in fp32: both store the fp8
    of the bf16 weights the run computes with (the fp8 of the fp32 ones differs at rounding boundaries: the parity
    check redrew 3 to 9 levels away before)."""
    config = Config(model={"base": str(tiny_base), "text_encoder_dtype": "fp8"}, train={"mixed_precision": "bf16"})
    stored = []
    for dtype in (torch.float32, torch.bfloat16):
        components = load_components(config.model, PartDtypes(others=dtype))
        store_loaded_text_encoders(components, run_dtypes(config))
        stored.append(components.text_encoders["text_encoder"].state_dict())
    assert stored[0].keys() == stored[1].keys()
    assert all(torch.equal(stored[0][key], stored[1][key]) for key in stored[0])
    assert any(value.dtype == torch.uint8 for value in stored[0].values())  # fp8 bytes


def _tiny_unet_with_lora(tiny_base):
    pipeline = StableDiffusionPipeline.from_pretrained(tiny_base, safety_checker=None)
    unet = pipeline.unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    return unet


@pytest.mark.parametrize("name, compute", [("fp16", torch.float32), ("fp8", torch.float32), ("fp8", torch.bfloat16)])
def test_autograd_keeps_stored_sources_not_computed_copies(tiny_base, name, compute):
    unet = _tiny_unet_with_lora(tiny_base)
    reference = copy.deepcopy(unet)  # the same random adapter
    assert storage.store_frozen_layers(unet, DTYPES[name], compute) > 0
    if compute != torch.float32:  # as the run places it (models.place_frozen leaves fp32 alone: casting to it would
        unet.to(dtype=compute)  # undo 16-bit storage); the trained adapter stays fp32 as cast_training_params keeps it
    for param in unet.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    torch.manual_seed(0)
    inputs = (torch.randn(2, 4, 8, 8), torch.tensor([10, 500]), torch.randn(2, 77, unet.config.cross_attention_dim))

    def held_copies() -> int:
        return sum(storage._holders(buffer) > 1 for buffers in storage._BUFFERS.by_size.values() for buffer in buffers)

    def loss(model):
        with torch.autocast("cpu", dtype=compute, enabled=compute != torch.float32):
            return model(*inputs).sample.float().square().mean()

    with storage.computed_copies_saved_as_stored():
        output = loss(unet)
    assert held_copies() == 0  # between forward and backward: every saved weight is a stored source
    output.backward()
    grads = {n: p.grad for n, p in unet.named_parameters() if p.requires_grad}

    unheld = loss(unet)  # without the hooks autograd keeps the computed copies (so the check above can fail)
    assert held_copies() > 0
    del unheld

    # The same numbers as layers holding the rounded weights in the compute dtype.
    _round_frozen_layers(reference, DTYPES[name])
    reference.to(dtype=compute)
    for param in reference.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    loss(reference).backward()
    for key, param in reference.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(grads[key], param.grad, rtol=1e-5, atol=1e-7, msg=key)


def test_adapter_layers_stay_fp32_when_an_adapter_is_loaded_frozen(tiny_base):
    unet = _tiny_unet_with_lora(tiny_base)
    unet.requires_grad_(False)  # as when a saved adapter is loaded to sample: its layers are frozen too
    storage.store_frozen_layers(unet, torch.bfloat16)
    lora = {n: p.dtype for n, p in unet.named_parameters() if "lora_" in n}
    assert lora and set(lora.values()) == {torch.float32}
