"""Anima against its own modular pipeline and readers beyond the conformance suite: the transformer fed as the
pipeline's denoise step feeds it, the original model's single file (its text conditioner inside) as diffusers' Cosmos
reader reads it and as difftune reads it back, and ai-toolkit's `diffusion_model.` adapter files as diffusers' Anima
reader converts them."""

from __future__ import annotations

import pytest
import torch
from diffusers import ClassifierFreeGuidance
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_anima_lora_to_diffusers
from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers
from safetensors.torch import save_file

from difftune.adapters.files import read_adapter
from difftune.config import ModelConfig
from difftune.families import FAMILIES, load_components
from difftune.families.anima import CONDITIONER_PREFIX, ORIGINAL_PREFIX, original_name
from difftune.models.autoencoders import downsampling

FAMILY = FAMILIES["anima"]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("anima"))


def test_the_transformer_is_fed_as_the_pipelines_denoise_step_feeds_it(base):
    """One unguided step from sigma 1 to 0 takes the noise to noise - velocity: the pipeline's latents equal the noise
    less difftune's `denoise` of it (a one-frame clip, the time as sigma, the padding-mask channel zero)."""
    components = load_components(ModelConfig(base=base))
    pipeline = components.pipeline()
    pipeline.update_components(guider=ClassifierFreeGuidance(guidance_scale=1.0))
    noise = torch.randn(1, 16, 1, 4, 6, generator=torch.Generator().manual_seed(0))
    side = downsampling(components.vae)
    with torch.no_grad():
        drawn = pipeline(
            prompt="a red circle",
            height=4 * side,
            width=6 * side,
            num_inference_steps=1,
            sigmas=[1.0],
            latents=noise,
            output="latents",
        )
        conditioning = FAMILY.conditioning.encode_prompts(
            components, FAMILY.conditioning.tokenize(components.tokenizers, ["a red circle"])
        )
        velocity = FAMILY.denoise(components, noise[:, :, 0], torch.tensor([1000.0]), conditioning, None)
    torch.testing.assert_close(drawn[:, :, 0], noise[:, :, 0] - velocity, rtol=0, atol=1e-5)


def _changed_conditioner(components) -> dict[str, torch.Tensor]:
    return {key: value + 0.01 for key, value in components.text_encoders["text_conditioner"].state_dict().items()}


def test_the_single_file_is_the_original_models_with_its_conditioner_inside(base, tmp_path):
    """The original layout (`net.blocks.0.self_attn.q_proj`, the conditioner under `net.llm_adapter.`): diffusers'
    Cosmos reader gives back every transformer weight, and a base read from the file takes the file's conditioner,
    not `model.single_file_config`'s."""
    components = load_components(ModelConfig(base=base))
    components.text_encoders["text_conditioner"].load_state_dict(_changed_conditioner(components))
    single = FAMILY.layout.to_single_file(components)
    assert {
        "net.blocks.0.self_attn.q_proj.weight",
        "net.x_embedder.proj.1.weight",
        "net.t_embedding_norm.weight",
    } <= set(single)
    transformer = {
        key: value for key, value in single.items() if not key.startswith(ORIGINAL_PREFIX + CONDITIONER_PREFIX)
    }
    expected = components.denoiser.state_dict()
    read = convert_cosmos_transformer_checkpoint_to_diffusers(transformer)
    assert set(read) == set(expected) and all(torch.equal(read[key], expected[key]) for key in expected)
    assert [name for name in FAMILIES if FAMILIES[name].layout.reads_single_file(set(single))] == [FAMILY.name]

    path = tmp_path / "anima.safetensors"
    save_file(single, path)
    loaded = load_components(ModelConfig(base=str(path), single_file_config=base))
    for part, ours in (("denoiser", loaded.denoiser), ("text_conditioner", loaded.text_encoders["text_conditioner"])):
        theirs = components.denoiser if part == "denoiser" else components.text_encoders["text_conditioner"]
        assert all(
            torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values(), strict=True)
        ), part


def test_ai_toolkit_files_read_as_diffusers_reader_reads_them(base, tmp_path):
    """A peft-style file under the original names after `diffusion_model.` (ai-toolkit's, diffusion-pipe's) is read as
    diffusers' Anima reader converts it: each tensor at the module `original_name` maps back from."""
    components = load_components(ModelConfig(base=base))
    modules = [
        "transformer_blocks.0.attn1.to_q",
        "transformer_blocks.0.attn2.to_out.0",
        "transformer_blocks.0.ff.net.2",
    ]
    rank = 2
    tensors = {}
    for module in modules:
        layer = components.denoiser.get_submodule(module)
        tensors[f"diffusion_model.{original_name(module)}.lora_A.weight"] = torch.randn(rank, layer.in_features)
        tensors[f"diffusion_model.{original_name(module)}.lora_B.weight"] = torch.randn(layer.out_features, rank)
    tensors[f"diffusion_model.{CONDITIONER_PREFIX}blocks.0.cross_attn.q_proj.lora_A.weight"] = torch.randn(rank, 32)
    tensors[f"diffusion_model.{CONDITIONER_PREFIX}blocks.0.cross_attn.q_proj.lora_B.weight"] = torch.randn(32, rank)
    path = tmp_path / "ai_toolkit.safetensors"
    save_file(tensors, path)
    read, configs, _ = read_adapter(path)
    expected = _convert_non_diffusers_anima_lora_to_diffusers(dict(tensors))
    assert {key for key in expected if key.startswith("transformer.")} == {
        f"transformer.{module}.lora_{ab}.weight" for module in modules for ab in "AB"
    }
    assert set(read) == set(expected) and all(torch.equal(read[key], expected[key]) for key in expected)
    assert configs["transformer.r"] == rank and configs["text_conditioner.r"] == rank
