import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from diffusers import AutoencoderKL, AutoencoderTiny, DDPMScheduler, FluxTransformer2DModel

from difftune.config import ModelConfig
from difftune.errors import DifftuneError
from difftune.families import load_components
from difftune.families.sd.micro import build_unet
from difftune.models.autoencoders import decode_latents, encode_latents
from difftune.models.components import compile_denoiser, place_frozen, set_attention
from difftune.toy.tiny import build_taesd, build_vae

from conftest import REPO


def test_loads_a_local_diffusers_folder(tiny_base):
    components = load_components(ModelConfig(base=str(tiny_base)))
    assert isinstance(components.vae, AutoencoderKL)
    assert isinstance(components.noise_scheduler, DDPMScheduler)
    assert components.denoiser.config.cross_attention_dim == components.text_encoders["text_encoder"].config.hidden_size
    ids = components.tokenizers["tokenizer"]("a red circle").input_ids
    assert (
        ids[0] == components.tokenizers["tokenizer"].bos_token_id
        and ids[-1] == components.tokenizers["tokenizer"].eos_token_id
    )


def test_pickled_checkpoints_are_refused(tmp_path):
    path = tmp_path / "model.ckpt"
    path.write_bytes(b"not read")
    with pytest.raises(
        DifftuneError, match=r"model\.ckpt: a pickle-based checkpoint is not read by default.*allow_pickled"
    ):
        load_components(ModelConfig(base=str(path)))


def test_missing_single_file_is_named(tmp_path):
    with pytest.raises(DifftuneError, match=r"model\.base .*nope\.safetensors: no such file"):
        load_components(ModelConfig(base=str(tmp_path / "nope.safetensors")))


def test_offline_hub_id_says_to_pass_a_local_path(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "difftune.cli",
            "train",
            "model.base=someone/some-model",
            f"train.output_dir={tmp_path}/o",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert "model.base someone/some-model: not a local folder or file" in run.stderr
    assert "Pass a local diffusers folder or a .safetensors file" in run.stderr
    assert "Traceback" not in run.stderr


def test_vae_override_with_taesd(tiny_base, tmp_path):
    taesd_dir = tmp_path / "taesd"
    build_taesd().save_pretrained(taesd_dir)
    components = load_components(ModelConfig(base=str(tiny_base), vae=str(taesd_dir)))
    assert isinstance(components.vae, AutoencoderTiny)
    assert components.vae.config.scaling_factor == 1.0


def test_vae_with_the_wrong_latent_channels_is_refused(tiny_base, tmp_path):
    vae_dir = tmp_path / "vae16"
    AutoencoderKL(block_out_channels=(32,), latent_channels=16, norm_num_groups=32).save_pretrained(vae_dir)
    with pytest.raises(DifftuneError, match=r"makes 16-channel latents but the unet takes 4"):
        load_components(ModelConfig(base=str(tiny_base), vae=str(vae_dir)))


def test_kl_latent_scaling_uses_the_config_factor():
    torch.manual_seed(0)
    vae = build_vae(scaling_factor=0.5).eval()
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    latents = encode_latents(vae, pixels, [torch.Generator().manual_seed(s) for s in (1, 2)])
    with torch.no_grad():
        posterior = vae.encode(pixels).latent_dist
        eps = torch.stack(
            [torch.randn(posterior.mean.shape[1:], generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
        )
        expected = (posterior.mean + posterior.std * eps) * 0.5
    assert latents.shape == (2, 4, 8, 8)
    torch.testing.assert_close(latents, expected)
    # Decoding divides the factor back out.
    with torch.no_grad():
        torch.testing.assert_close(decode_latents(vae, latents), vae.decode(latents / 0.5).sample)


def test_taesd_latents_are_used_as_encoded():
    torch.manual_seed(0)
    taesd = build_taesd().eval()
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        latents = encode_latents(taesd, pixels, [torch.Generator() for _ in range(2)])
        torch.testing.assert_close(latents, taesd.encode(pixels).latents)
    assert latents.shape == (2, 4, 8, 8)


@pytest.mark.skipif(importlib.util.find_spec("xformers") is not None, reason="xformers is installed")
def test_xformers_without_the_package_is_a_clear_error():
    with pytest.raises(DifftuneError, match=r"xformers is not installed; `pip install difftune\[xformers\]`"):
        set_attention(build_unet(), "xformers")


def test_a_wholly_trained_part_keeps_its_fp32_weights_under_half_precision(tiny_base):
    """A full fine-tune trains fp32 weights; casting them to bf16 first would round the base before training."""
    components = load_components(ModelConfig(base=str(tiny_base)))
    original = {name: p.detach().clone() for name, p in components.denoiser.named_parameters()}
    place_frozen(components, torch.device("cpu"), torch.bfloat16, trained_whole=[components.denoiser])
    for name, parameter in components.denoiser.named_parameters():
        assert parameter.dtype == torch.float32
        torch.testing.assert_close(parameter, original[name], rtol=0, atol=0)
    assert next(components.text_encoders["text_encoder"].parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("setting, expected", [("auto", False), ("on", True), ("off", False)])
def test_channels_last_auto_is_off_on_cpu(make_config, setting, expected):
    """On CPU channels-last measured no faster and 2.1 GB heavier at SD1.5 size (docs/benchmarks.md), so `auto` is
    CUDA only; `on` still forces it."""
    from difftune.training.train import _configure_denoiser

    unet = build_unet()
    _configure_denoiser(unet, make_config(train__channels_last=setting), torch.device("cpu"))
    weight = unet.conv_in.weight
    assert weight.is_contiguous(memory_format=torch.channels_last if expected else torch.contiguous_format)
    assert weight.is_contiguous() != expected


def test_a_transformer_is_compiled_block_by_block_and_a_unet_whole(monkeypatch):
    # Regional compilation for a transformer (each of its repeated blocks, in place); the whole model for a UNet.
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda module, *args, **kwargs: compiled.append(module))
    flux = FluxTransformer2DModel(
        in_channels=4,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=16,
        axes_dims_rope=(2, 2, 4),
    )
    compile_denoiser(flux)
    assert compiled == [*flux.transformer_blocks, *flux.single_transformer_blocks]
    compiled.clear()
    unet = build_unet()
    compile_denoiser(unet)
    assert compiled == [unet]
