"""What is Z-Image's own beyond the conformance suite: its single file in the original layout (read back by diffusers'
own converter), the fixed-shift noise levels of its scheduler, its guidance convention, and the sd-scripts /
musubi-tuner LoRA layout (a file written as those trainers name it, read as the same adapter)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import ZImageTransformer2DModel
from PIL import Image
from safetensors.torch import load_file, save_file

from difftune.adapters import export
from difftune.config import LossConfig, ModelConfig
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components
from difftune.families.common.flow import shifted
from difftune.training.parity import PARITY_FILE
from difftune.training.train import train

FAMILY = FAMILIES["z_image"]


@pytest.fixture(scope="module")
def base(micro_base):
    return micro_base("z_image")


def test_the_single_file_is_the_original_layout_that_diffusers_reads(base, tmp_path):
    components = load_components(ModelConfig(base=str(base)))
    path = tmp_path / "z_image.safetensors"
    save_file(
        {f"model.diffusion_model.{key}": value for key, value in FAMILY.layout.to_single_file(components).items()}, path
    )
    keys = set(load_file(path))
    assert "model.diffusion_model.layers.0.attention.qkv.weight" in keys
    assert (
        "model.diffusion_model.final_layer.linear.weight" in keys and "model.diffusion_model.norm_final.weight" in keys
    )
    assert not any(".to_q." in key or "all_final_layer" in key for key in keys)
    theirs = ZImageTransformer2DModel.from_single_file(
        str(path), config=str(base), subfolder="transformer", torch_dtype=torch.float32
    )
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
    timesteps, _, _ = FAMILY.objective.draw_timesteps_and_noise(components, generators, latents, config)
    plain, _, _ = FAMILY.objective.draw_timesteps_and_noise(
        components, [torch.Generator().manual_seed(i) for i in range(4)], torch.zeros(4, 16, 32, 32), LossConfig()
    )
    torch.testing.assert_close(timesteps, shifted(plain / 1000, 3.0) * 1000)


def test_sample_guidance_means_what_it_means_for_every_family(base):
    """`sample.guidance_scale` w is neg + w (pos - neg) everywhere; Z-Image's pipeline is asked for its own s with
    pos + s (pos - neg) is the same prediction at s = w - 1 (none at w <= 1, as Turbo samples)."""
    components = load_components(ModelConfig(base=str(base)))
    assert FAMILY.drawing.sampling_arguments(components, 4.0, "blurry") == {
        "max_sequence_length": 512,
        "guidance_scale": 3.0,
        "negative_prompt": "blurry",
    }
    assert FAMILY.drawing.sampling_arguments(components, 1.0, "blurry") == {
        "max_sequence_length": 512,
        "guidance_scale": 0.0,
    }


def test_the_kohya_layout_is_comfyuis_and_musubi_tuners_files_are_read(base, make_config, tmp_path):
    """The kohya layout is what ComfyUI maps onto its fused model and musubi-tuner's `convert_z_image_lora_to_comfy`
    writes: `lora_unet_<original name>`, q, k and v one `attention_qkv` layer (downs stacked, ups block-diagonal,
    alpha x 3 with the rank), `attention_out`. sd-scripts' / musubi-tuner's own files name each diffusers module
    (`lora_unet_layers_0_attention_to_q`): read as the same adapter."""
    settings = {
        "model__base": str(base),
        "train__output_dir": str(tmp_path / "run"),
        "train__max_steps": 2,
        "sample__prompts": [],
        "adapter__text_encoder": False,
    }
    trained_path = train(make_config(**settings)).trained_path
    trained = load_file(trained_path)
    kohya = load_file(export.convert_adapter(trained_path, tmp_path / "kohya.safetensors", "kohya"))
    module = "transformer.layers.0.attention"
    assert torch.equal(
        kohya["lora_unet_layers_0_attention_qkv.lora_down.weight"],
        torch.cat([trained[f"{module}.to_{p}.lora_A.weight"] for p in "qkv"]),
    )
    assert torch.equal(
        kohya["lora_unet_layers_0_attention_qkv.lora_up.weight"],
        torch.block_diag(*[trained[f"{module}.to_{p}.lora_B.weight"] for p in "qkv"]),
    )
    rank = trained[f"{module}.to_q.lora_A.weight"].shape[0]
    assert kohya["lora_unet_layers_0_attention_qkv.alpha"].item() == 3 * rank
    assert torch.equal(
        kohya["lora_unet_layers_0_attention_out.lora_down.weight"], trained[f"{module}.to_out.0.lora_A.weight"]
    )
    assert "lora_unet_noise_refiner_0_feed_forward_w1.lora_up.weight" in kohya

    musubi = {}
    for key, value in trained.items():
        name = "lora_unet_" + key.removeprefix("transformer.").rsplit(".lora_", 1)[0].replace(".", "_")
        musubi[f"{name}.{'lora_down' if '.lora_A.' in key else 'lora_up'}.weight"] = value
        musubi[f"{name}.alpha"] = torch.tensor(float(rank))
    save_file(musubi, tmp_path / "musubi.safetensors")
    tensors, configs, _ = export.read_any_adapter(tmp_path / "musubi.safetensors", str(base))
    assert tensors.keys() == trained.keys() and all(torch.equal(tensors[key], trained[key]) for key in trained)
    assert (configs["transformer.r"], configs["transformer.lora_alpha"]) == (rank, rank)


def test_a_training_adapter_is_trained_over_and_left_out_of_what_is_saved(make_config, base, tmp_path):
    """Z-Image Turbo's way, ai-toolkit's `assistant_lora_path`: the de-distilling adapter merged into the base for
    training only. Training over it is training on the merged base, loss for loss; the file saved is the new
    adapter alone, for the distilled base; samples show the base without it, as ai-toolkit's previews do. The
    assistant here is named as ai-toolkit's are (`diffusion_model.`)."""
    denoiser = load_components(ModelConfig(base=str(base))).denoiser
    generator, assistant = torch.Generator().manual_seed(0), {}
    for module in ("layers.0.attention.to_q", "layers.0.attention.to_v"):
        weight = denoiser.get_submodule(module).weight
        assistant[f"diffusion_model.{module}.lora_A.weight"] = torch.randn(2, weight.shape[1], generator=generator)
        assistant[f"diffusion_model.{module}.lora_B.weight"] = torch.randn(weight.shape[0], 2, generator=generator)
    save_file(assistant, tmp_path / "assistant.safetensors")
    merged = tmp_path / "merged"
    export.merge_into_folder(str(base), [(tmp_path / "assistant.safetensors", 1.0)], merged)
    change = (
        load_components(ModelConfig(base=str(merged))).denoiser.get_submodule("layers.0.attention.to_q").weight
        - denoiser.get_submodule("layers.0.attention.to_q").weight
    )
    prefix = "diffusion_model.layers.0.attention.to_q"
    torch.testing.assert_close(change, assistant[f"{prefix}.lora_B.weight"] @ assistant[f"{prefix}.lora_A.weight"])

    def run(name: str, **overrides):
        return train(make_config(**{"train__output_dir": str(tmp_path / name), "model__base": str(base)} | overrides))

    previews = {"sample__prompts": ["a red circle"], "sample__steps": 2, "sample__before": True, "sample__parity": True}
    over = run("over", model__training_adapter=str(tmp_path / "assistant.safetensors"), **previews)
    premerged = run("premerged", model__base=str(merged), **previews)
    plain = run("plain", **previews)
    assert over.losses == pytest.approx(premerged.losses, rel=1e-6)
    assert over.losses != pytest.approx(plain.losses, rel=1e-4)  # the assistant changes the model
    saved, expected = load_file(over.trained_path), load_file(premerged.trained_path)
    assert saved.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=1e-7, msg=key)

    def image(name: str, folder: str = "samples/before") -> np.ndarray:
        return np.asarray(Image.open(next((tmp_path / name / folder).glob("*.png"))), dtype=np.int16)

    # The base's samples, the assistant's change taken off at each of its layers (up to rounding: one 8-bit level).
    assert np.abs(image("over") - image("plain")).max() <= 1
    assert np.abs(image("premerged") - image("plain")).mean() > 5  # what previews would show with it merged
    # The saved adapter, reloaded on the base alone (no training adapter), draws what the run's last samples showed.
    parity = json.loads((tmp_path / "over" / PARITY_FILE).read_text())
    assert all(result["max_pixel_difference"] <= 1 for result in parity["layouts"].values()), parity

    with pytest.raises(
        DifftuneError, match=r"model.training_adapter nowhere/adapter.bin: not an adapter file; give a local"
    ):
        run("missing", model__training_adapter="nowhere/adapter.bin")
    with pytest.raises(DifftuneError, match=r"model.training_adapter needs an adapter \(adapter.kind lora"):
        make_config(model__training_adapter=str(tmp_path / "assistant.safetensors"), adapter__kind="none")
