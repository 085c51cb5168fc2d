"""What is Z-Image's own beyond the conformance suite: its single file in the original layout (read back by diffusers'
own converter), the fixed-shift noise levels of its scheduler, its guidance convention, and the sd-scripts /
musubi-tuner LoRA layout (a file written as those trainers name it, read as the same adapter)."""

from __future__ import annotations

import pytest
import torch
from diffusers import ZImageTransformer2DModel
from safetensors.torch import load_file, save_file

from difftune import export
from difftune.config import LossConfig, ModelConfig
from difftune.families import FAMILIES, load_components
from difftune.families.flow import shifted
from difftune.toy.tiny import build_pipeline
from difftune.train import train

FAMILY = FAMILIES["z_image"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("micro-z_image")
    build_pipeline(seed=1, family="z_image").save_pretrained(path, safe_serialization=True)
    return path


def test_the_single_file_is_the_original_layout_that_diffusers_reads(base, tmp_path):
    components = load_components(ModelConfig(base=str(base)))
    path = tmp_path / "z_image.safetensors"
    save_file({f"model.diffusion_model.{key}": value for key, value in FAMILY.to_single_file(components).items()}, path)
    keys = set(load_file(path))
    assert "model.diffusion_model.layers.0.attention.qkv.weight" in keys
    assert "model.diffusion_model.final_layer.linear.weight" in keys and "model.diffusion_model.norm_final.weight" in keys
    assert not any(".to_q." in key or "all_final_layer" in key for key in keys)
    theirs = ZImageTransformer2DModel.from_single_file(str(path), config=str(base), subfolder="transformer",
                                                        torch_dtype=torch.float32)
    ours = components.denoiser.state_dict()
    assert theirs.state_dict().keys() == ours.keys()
    assert all(torch.equal(value, ours[key]) for key, value in theirs.state_dict().items())


def test_noise_levels_follow_the_schedulers_fixed_shift(base):
    """Z-Image's scheduler shifts every size by 3 (no dynamic shifting): `loss.flow_shift_by_resolution` draws the
    levels it samples with, at any size."""
    components = load_components(ModelConfig(base=str(base)))
    latents = torch.zeros(4, 16, 8, 8)
    config = LossConfig(flow_shift_by_resolution=True)
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    timesteps, _, _ = FAMILY.draw_timesteps_and_noise(components, generators, latents, config)
    plain, _, _ = FAMILY.draw_timesteps_and_noise(components, [torch.Generator().manual_seed(i) for i in range(4)],
                                                  torch.zeros(4, 16, 32, 32), LossConfig())
    torch.testing.assert_close(timesteps, shifted(plain / 1000, 3.0) * 1000)


def test_sample_guidance_means_what_it_means_for_every_family(base):
    """`sample.guidance_scale` w is neg + w (pos - neg) everywhere; Z-Image's pipeline is asked for its own s with
    pos + s (pos - neg) is the same prediction at s = w - 1 (none at w <= 1, as Turbo samples)."""
    components = load_components(ModelConfig(base=str(base)))
    assert FAMILY.sampling_arguments(components, 4.0, "blurry") == {
        "max_sequence_length": 512, "guidance_scale": 3.0, "negative_prompt": "blurry"}
    assert FAMILY.sampling_arguments(components, 1.0, "blurry") == {"max_sequence_length": 512, "guidance_scale": 0.0}


def test_a_musubi_tuner_file_is_read_as_the_same_adapter(base, make_config, tmp_path):
    """sd-scripts / musubi-tuner name Z-Image's LoRA modules `lora_unet_` + the module's name with `_` (their
    `lora_zimage.py` targets the blocks' linear layers); difftune's kohya layout is that, and reads it back."""
    settings = {"model__base": str(base), "train__output_dir": str(tmp_path / "run"), "train__max_steps": 2,
                "sample__prompts": [], "adapter__text_encoder": False}
    trained_path = train(make_config(**settings)).trained_path
    trained = load_file(trained_path)
    kohya = load_file(export.convert_adapter(trained_path, tmp_path / "kohya.safetensors", "kohya"))
    assert "lora_unet_layers_0_attention_to_q.lora_down.weight" in kohya
    assert "lora_unet_noise_refiner_0_feed_forward_w1.lora_up.weight" in kohya
    assert torch.equal(kohya["lora_unet_layers_0_attention_to_out_0.lora_down.weight"],
                       trained["transformer.layers.0.attention.to_out.0.lora_A.weight"])
