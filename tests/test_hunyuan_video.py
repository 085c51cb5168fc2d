"""HunyuanVideo (1.0) beyond the conformance suite: the transformer fed as the pipeline feeds it (its guidance embedding
reading the scale x 1000), the single file in Tencent's layout as diffusers' own reader reads it, and Tencent's
image-to-video pipeline refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import HunyuanVideoImageToVideoPipeline, HunyuanVideoTransformer3DModel
from diffusers.loaders.single_file_utils import convert_hunyuan_video_transformer_to_diffusers
from safetensors.torch import save_file

from difftune.config import ModelConfig
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, family_of, load_components
from difftune.models.components import Components

from comfyui_lora import saved_by_comfyui

FAMILY = FAMILIES["hunyuan_video"]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("hunyuan_video"))


@pytest.mark.parametrize("scale", [1.0, 6.0])
def test_one_pipeline_step_is_the_noise_less_difftunes_velocity(base, scale):
    """One step from sigma 1 to 0 takes the noise to noise - velocity: the pipeline's latents (its guidance embedding
    given `guidance_scale` x 1000) equal the noise less difftune's `denoise` of it, training conditioned on the same
    scale (`model.family_options.guidance`)."""
    components = load_components(ModelConfig(base=base))
    components.family_options = components.family_options.model_copy(update={"guidance": scale})
    noise = torch.randn(1, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        drawn = components.pipeline()(
            prompt="a red circle",
            height=16,
            width=16,
            num_frames=5,
            num_inference_steps=1,
            guidance_scale=scale,
            latents=noise,
            output_type="latent",
        ).frames
        conditioning = FAMILY.conditioning.encode_prompts(
            components, FAMILY.conditioning.tokenize(components.tokenizers, ["a red circle"])
        )
        velocity = FAMILY.denoise(components, noise, torch.tensor([1000.0]), conditioning, None)
    torch.testing.assert_close(drawn, noise - velocity, rtol=0, atol=1e-5)
    assert torch.equal(FAMILY.guidance(components, 2, "cpu"), torch.full((2,), scale * 1000))


def test_the_single_file_is_tencents_layout_as_diffusers_reads_it():
    """diffusers' reader assumes the published width (3072) to split a single block's `linear1`: one double and one
    single block at that width and two refiner blocks, built on the meta device, its weights random bytes read as fp8
    (every value compared bit for bit, both ways)."""
    with torch.device("meta"):
        model = HunyuanVideoTransformer3DModel(num_layers=1, num_single_layers=1, text_embed_dim=64)
    ours = {
        key: torch.randint(0, 256, value.shape, dtype=torch.uint8).view(torch.float8_e4m3fn)
        for key, value in model.state_dict().items()
    }
    model.load_state_dict(ours, assign=True)
    components = Components(
        family=FAMILY, denoiser=model, vae=None, text_encoders={}, tokenizers={}, noise_scheduler=None
    )
    original = FAMILY.layout.to_single_file(components)
    assert {
        "double_blocks.0.img_attn_qkv.weight",
        "single_blocks.0.linear1.weight",
        "vector_in.in_layer.weight",
    } <= set(original)
    # Flux.1's files have `vector_in` too, HunyuanImage 2.1's the caption's token refiner: HunyuanVideo's alone read it
    # (SkyReels' image-to-video transformer has the same keys: read when model.family names it).
    assert [name for name, family in FAMILIES.items() if family.layout.reads_single_file(set(original))] == [
        "hunyuan_video",
        "hunyuan_video_skyreels_i2v",
    ]
    theirs = convert_hunyuan_video_transformer_to_diffusers(dict(original))
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[key].view(torch.uint8), value.view(torch.uint8)) for key, value in ours.items())
    back = FAMILY.layout.diffusers_names(original)
    assert all(torch.equal(back[key].view(torch.uint8), value.view(torch.uint8)) for key, value in ours.items())


def test_tencents_image_to_video_pipeline_is_refused_by_name(base, tmp_path):
    index = json.loads((Path(base) / "model_index.json").read_text())
    index["_class_name"] = HunyuanVideoImageToVideoPipeline.__name__
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(DifftuneError, match="is a HunyuanVideoImageToVideoPipeline; difftune trains"):
        family_of(ModelConfig(base=str(tmp_path)))


def test_a_file_in_comfyuis_names_reads_as_the_same_transformer(base, tmp_path):
    """Files saved from ComfyUI's HunyuanVideo model name Tencent's layers as its modules do (`img_attn.qkv`,
    `mlp.0`, `mod.lin`, `in_layer`): one under ComfyUI's prefix reads as the same transformer, as HunyuanVideo and not
    Flux.1 or HunyuanImage 2.1 (whose layers it shares)."""
    components = load_components(ModelConfig(base=base))
    comfyui = saved_by_comfyui(FAMILY.layout.to_single_file(components))
    assert {
        "model.diffusion_model.double_blocks.0.img_attn.qkv.weight",
        "model.diffusion_model.vector_in.in_layer.weight",
        "model.diffusion_model.guidance_in.out_layer.bias",
    } <= set(comfyui)
    save_file(comfyui, tmp_path / "hunyuan_video_bf16.safetensors")
    again = load_components(ModelConfig(base=str(tmp_path / "hunyuan_video_bf16.safetensors"), single_file_config=base))
    assert again.family is FAMILY
    for key, value in components.denoiser.state_dict().items():
        assert torch.equal(again.denoiser.state_dict()[key], value), key
