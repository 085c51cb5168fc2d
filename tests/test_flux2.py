"""FLUX.2 [dev] and [klein] beyond the conformance suite: single files in BFL's layout, read back by diffusers' own
single-file reader as the same weights, and the guidance each pipeline takes."""

from __future__ import annotations

import pytest
import torch
from diffusers import Flux2Transformer2DModel
from safetensors.torch import save_file

from difftune.config import Config, ModelConfig
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components

NAMES = ("flux2", "flux2_klein")


@pytest.fixture(scope="module", params=NAMES)
def base(request, micro_base):
    return request.param, micro_base(request.param, seed=2)


def test_a_single_file_is_bfls_layout_and_diffusers_reads_it_as_the_same_weights(base, tmp_path):
    name, path = base
    components = load_components(ModelConfig(base=str(path)))
    file = tmp_path / "flux-2.safetensors"  # unprefixed, as BFL ships it: diffusers' FLUX.2 converter reads no prefix
    tensors = FAMILIES[name].layout.to_single_file(components)
    save_file(tensors, file)
    assert {
        "double_blocks.0.img_attn.qkv.weight",
        "single_blocks.0.linear1.weight",
        "final_layer.adaLN_modulation.1.weight",
        "double_blocks.0.txt_attn.norm.key_norm.scale",
    } <= set(tensors)
    assert ("guidance_in.in_layer.weight" in tensors) == (name == "flux2")  # [dev] is guidance-distilled
    assert not any(".to_q." in key or "_embedder" in key for key in tensors)
    # difftune reads it back from the same table it wrote it with, ComfyUI's prefix too (diffusers' converter reads
    # none).
    save_file({f"model.diffusion_model.{key}": value for key, value in tensors.items()}, tmp_path / "comfy.safetensors")
    again = load_components(ModelConfig(base=str(tmp_path / "comfy.safetensors"), single_file_config=str(path)))
    assert again.family is FAMILIES[name]
    theirs = Flux2Transformer2DModel.from_single_file(
        str(file), config=str(path), subfolder="transformer", torch_dtype=torch.float32
    )
    ours = components.denoiser.state_dict()
    assert theirs.state_dict().keys() == ours.keys()
    assert all(torch.equal(value, ours[key]) for key, value in theirs.state_dict().items())
    assert all(torch.equal(value, ours[key]) for key, value in again.denoiser.state_dict().items())


def test_dev_takes_the_scale_as_its_guidance_embedding_and_no_negative_prompt(base):
    name, path = base
    family = FAMILIES[name]
    components = load_components(ModelConfig(base=str(path)))
    assert components.denoiser.config.guidance_embeds == (name == "flux2")
    assert family.drawing.sampling_arguments(components, 3.5, "") == {"max_sequence_length": 512, "guidance_scale": 3.5}
    with pytest.raises(DifftuneError, match=r"sample\.negative_prompt: Flux2\w*Pipeline .*leave it empty"):
        family.check_config(Config(model={"base": str(path)}, sample={"negative_prompt": "blurry"}))
    # Training conditions a distilled base on model.family_options.guidance; klein's transformer takes none.
    components.family_options = components.family_options.model_copy(update={"guidance": 3.5})
    guidance = family.guidance(components, 2, "cpu")
    assert (guidance is None) if name == "flux2_klein" else torch.equal(guidance, torch.full((2,), 3.5))
