"""QLoRA: a quantized frozen denoiser under trained adapters (torchao int8, bitsandbytes nf4; both run on the CPU)."""

import importlib.util
import json

import pytest
import torch
from diffusers import StableDiffusionPipeline
from safetensors.torch import load_file

from difftune import errors
from difftune.data import sharding
from difftune.errors import DifftuneError
from difftune.memory import quantize
from difftune.training import train as train_module
from difftune.training.train import train

LIBRARY = {"int8": "torchao", "nf4": "bitsandbytes"}


@pytest.mark.parametrize("method", ["int8", "nf4"])
@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_adapters_train_on_a_quantized_base_and_load_on_the_plain_one(make_config, tiny_base, tmp_path, method, kind):
    if importlib.util.find_spec(LIBRARY[method]) is None:
        pytest.skip(f"{LIBRARY[method]} is not installed")
    plain = train(make_config(adapter__kind=kind, train__output_dir=str(tmp_path / "plain")))
    config = make_config(
        adapter__kind=kind,
        model__quantize=method,
        sample__prompts=["a red circle"],
        sample__steps=4,
        train__output_dir=str(tmp_path / "quantized"),
    )
    result = train(config)
    to_q = result.components.denoiser.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q
    assert to_q.base_layer.weight.dtype in (torch.int8, torch.uint8) or "Int8" in type(to_q.base_layer.weight).__name__
    # The same run with the base's linear weights rounded: close, not equal.
    assert result.losses == pytest.approx(plain.losses, rel=0.1)
    assert result.losses != plain.losses
    saved, plain_saved = load_file(result.trained_path), load_file(plain.trained_path)
    assert saved.keys() == plain_saved.keys() and all(saved[key].dtype == torch.float32 for key in saved)
    # Users load it on the unquantized base; the parity check reloads it on a base quantized as in training.
    pipeline = StableDiffusionPipeline.from_pretrained(tiny_base, safety_checker=None, dtype=torch.float32)
    pipeline.load_lora_weights(str(result.trained_path.parent), weight_name=result.trained_path.name)
    assert any("lora_A" in key for key in pipeline.unet.state_dict())
    parity = json.loads((tmp_path / "quantized" / "parity.json").read_text())
    assert all(layout["max_pixel_difference"] == 0 for layout in parity["layouts"].values())


def test_a_missing_quantization_library_is_named(make_config, monkeypatch):
    monkeypatch.setattr(errors.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DifftuneError, match=r"needs torchao: `pip install difftune\[torchao\]`"):
        quantize.quantize_linear_layers(torch.nn.Linear(2, 2), "int8", torch.device("cpu"), torch.float32)
    with pytest.raises(DifftuneError, match=r"needs bitsandbytes: `pip install difftune\[bnb\]`"):
        quantize.quantize_linear_layers(torch.nn.Linear(2, 2), "nf4", torch.device("cpu"), torch.float32)


def test_quantizing_needs_an_adapter_and_one_process(make_config):
    with pytest.raises(DifftuneError, match="needs an adapter"):
        make_config(model__quantize="int8", adapter__kind="none")
    with pytest.raises(DifftuneError, match="not supported with FSDP"):
        sharding.check_config(make_config(model__quantize="nf4"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is a CPU's")
def test_a_quantized_base_in_bf16_is_refused_on_a_cpu_before_loading(make_config, monkeypatch):
    monkeypatch.setattr(train_module, "load_components", lambda *args: pytest.fail("loaded before refusing"))
    with pytest.raises(DifftuneError, match=r'quantize = "int8" with train.mixed_precision = "bf16" fails on a CPU'):
        train_module.train(make_config(model__quantize="int8", train__mixed_precision="bf16"))


def test_nf4_layers_compute_alike_in_training_and_evaluation_on_any_cpu(monkeypatch):
    """bitsandbytes repacks nf4 weights for AVX-512 BF16 CPUs at the first no-grad eval forward, which fails for layers
    narrower than its blocks and rounds the scales to bf16. Forced on here, so every x86-64 CPU checks that path."""
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed")
    import bitsandbytes

    monkeypatch.setattr(bitsandbytes.nn.modules, "has_avx512bf16", lambda: True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.GELU(), torch.nn.Linear(40, 96))
    quantize.quantize_linear_layers(model, "nf4", torch.device("cpu"), torch.float32)
    inputs = torch.randn(3, 48)
    training = model.train()(inputs.requires_grad_())
    with torch.no_grad():
        evaluation = model.eval()(inputs.detach())
    torch.testing.assert_close(evaluation, training.detach(), rtol=0, atol=0)
    assert not any(getattr(layer.weight.quant_state, "packing_format_for_cpu", False) for layer in (model[0], model[2]))


def test_bitsandbytes_cpu_kernel_notice_stays_off_the_screen(caplog):
    import logging

    import difftune  # noqa: F401 - installs the filter

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'.")
        logger.warning("another bitsandbytes warning")
    assert [record.getMessage() for record in caplog.records] == ["another bitsandbytes warning"]
