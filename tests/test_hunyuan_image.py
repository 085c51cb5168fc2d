"""HunyuanImage 2.1 against its own pipeline beyond the conformance suite and tests/test_hunyuan_text.py: diffusers' own
`HunyuanImagePipeline` (no LoRA loader of its own) drawing an adapter loaded on its transformer as difftune draws it,
the kohya file in ComfyUI's HunyuanVideo block names, and the distilled model refused by name."""

from __future__ import annotations

import pytest
import torch
from diffusers import HunyuanImagePipeline
from transformer_lora import assert_pipeline_draws_the_adapter, kohya_modules_read_back, trained_and_merged

from difftune.config import ModelConfig
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components

from comfyui_lora import saved_by_comfyui

FAMILY = FAMILIES["hunyuan_image"]
PROMPTS = ['a sign that says "OPEN" in red', "a red circle"]  # one quoting text, one not


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("hunyuan_image"))


def test_diffusers_own_pipeline_draws_the_adapter_as_difftune_does(make_config, base, tmp_path):
    """A merged folder says `HunyuanImagePipeline`, which diffusers loads; its transformer reads the diffusers-layout
    file (`load_lora_adapter`, the pipeline having no loader) and the pipeline then draws what difftune's adapted
    model draws. The kohya file names ComfyUI's HunyuanVideo blocks (q, k and v fused as `img_attn_qkv`, a single
    block's `linear1`), and reads back as the same adapter."""
    trained, merged = trained_and_merged(make_config, base, tmp_path)

    assert_pipeline_draws_the_adapter(HunyuanImagePipeline, base, trained, merged)
    modules = kohya_modules_read_back(trained, tmp_path)
    assert {
        "lora_unet_double_blocks_0_img_attn_qkv",
        "lora_unet_double_blocks_0_txt_attn_qkv",
        "lora_unet_double_blocks_0_img_mlp_0",
        "lora_unet_single_blocks_0_linear1",
        "lora_unet_single_blocks_0_linear2",
    } <= modules


def test_the_distilled_model_is_refused_by_name(base, tmp_path):
    pipeline = HunyuanImagePipeline.from_pretrained(base, dtype=torch.float32)
    config = dict(pipeline.transformer.config) | {"use_meanflow": True, "guidance_embeds": True}
    pipeline.transformer = type(pipeline.transformer).from_config(config)
    pipeline.save_pretrained(tmp_path / "distilled")
    with pytest.raises(DifftuneError, match="a distilled HunyuanImage 2.1 base .meanflow"):
        load_components(ModelConfig(base=str(tmp_path / "distilled")))


def _split_as_tencents_loader_does(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tencent's file as its loader reads it before loading and as diffusers' converter does first
    (`convert_hunyuan_dict_for_tensor_parallel`): a double block's fused q, k and v split in three by rows; a single
    block's `linear1` into q, k, v (each as wide as `linear2`'s output) and the MLP input; `linear2` as `linear2.fc`."""
    split = {}
    for key, value in original.items():
        if key.startswith("double_blocks") and "attn_qkv." in key:
            width = value.shape[0] // 3
            for i, name in enumerate("qkv"):
                split[key.replace("attn_qkv.", f"attn_{name}.")] = value[i * width : (i + 1) * width]
        elif key.startswith("single_blocks") and ".linear1." in key:
            width = original[key.replace("linear1", "linear2").rsplit(".", 1)[0] + ".weight"].shape[0]
            for i, name in enumerate("qkv"):
                split[key.replace("linear1", f"linear1_{name}")] = value[i * width : (i + 1) * width]
            split[key.replace("linear1", "linear1_mlp")] = value[3 * width :]
        elif key.startswith("single_blocks") and ".linear2." in key:
            split[key.replace("linear2", "linear2.fc")] = value
        else:
            split[key] = value
    return split


def _as_diffusers_converter_reads(original: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Tencent's file, split as its loader splits it, under diffusers' names as diffusers' converter maps it
    (scripts/convert_hunyuan_image_to_diffusers.py, `convert_hunyuan_image_transformer_checkpoint_to_diffusers`),
    name for name in its order; what it does not read is left in `original`."""
    take, out = original.pop, {}

    def move(diffusers: str, tencent: str, parameters=("weight", "bias")):
        for parameter in parameters:
            out[f"{diffusers}.{parameter}"] = take(f"{tencent}.{parameter}")

    for layer in ("norm", "linear_1", "linear_2", "linear_3"):
        move(f"context_embedder_2.{layer}", "byt5_in." + {"norm": "layernorm"}.get(layer, f"fc{layer[-1]}"))
    move("x_embedder.proj", "img_in.proj")
    move("context_embedder.proj_in", "txt_in.input_embedder")
    for i, embedder in ((1, "mlp.0"), (2, "mlp.2")):
        move(f"context_embedder.time_text_embed.timestep_embedder.linear_{i}", f"txt_in.t_embedder.{embedder}")
        move(f"context_embedder.time_text_embed.text_embedder.linear_{i}", f"txt_in.c_embedder.linear_{i}")
        move(f"time_guidance_embed.timestep_embedder.linear_{i}", f"time_in.{embedder}")
    for i in range(config.num_refiner_layers):  # the converter's 2, the real model's
        ours = f"context_embedder.token_refiner.refiner_blocks.{i}"
        theirs = f"txt_in.individual_token_refiner.blocks.{i}"
        move(f"{ours}.norm1", f"{theirs}.norm1")
        move(f"{ours}.norm2", f"{theirs}.norm2")
        for parameter in ("weight", "bias"):
            q, k, v = torch.chunk(take(f"{theirs}.self_attn_qkv.{parameter}"), 3, dim=0)
            out |= {f"{ours}.attn.to_{name}.{parameter}": value for name, value in zip("qkv", (q, k, v), strict=True)}
        move(f"{ours}.attn.to_out.0", f"{theirs}.self_attn_proj")
        move(f"{ours}.ff.net.0.proj", f"{theirs}.mlp.fc1")
        move(f"{ours}.ff.net.2", f"{theirs}.mlp.fc2")
        move(f"{ours}.norm_out.linear", f"{theirs}.adaLN_modulation.1")
    for i in range(config.num_layers):  # its 20
        ours, theirs = f"transformer_blocks.{i}", f"double_blocks.{i}"
        move(f"{ours}.norm1.linear", f"{theirs}.img_mod.linear")
        move(f"{ours}.norm1_context.linear", f"{theirs}.txt_mod.linear")
        for name in "qkv":
            move(f"{ours}.attn.to_{name}", f"{theirs}.img_attn_{name}")
            move(f"{ours}.attn.add_{name}_proj", f"{theirs}.txt_attn_{name}")
        move(f"{ours}.attn.norm_q", f"{theirs}.img_attn_q_norm", ("weight",))
        move(f"{ours}.attn.norm_k", f"{theirs}.img_attn_k_norm", ("weight",))
        move(f"{ours}.attn.norm_added_q", f"{theirs}.txt_attn_q_norm", ("weight",))
        move(f"{ours}.attn.norm_added_k", f"{theirs}.txt_attn_k_norm", ("weight",))
        move(f"{ours}.attn.to_out.0", f"{theirs}.img_attn_proj")
        move(f"{ours}.attn.to_add_out", f"{theirs}.txt_attn_proj")
        move(f"{ours}.ff.net.0.proj", f"{theirs}.img_mlp.fc1")
        move(f"{ours}.ff.net.2", f"{theirs}.img_mlp.fc2")
        move(f"{ours}.ff_context.net.0.proj", f"{theirs}.txt_mlp.fc1")
        move(f"{ours}.ff_context.net.2", f"{theirs}.txt_mlp.fc2")
    for i in range(config.num_single_layers):  # its 40
        ours, theirs = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        move(f"{ours}.norm.linear", f"{theirs}.modulation.linear")
        for name in "qkv":
            move(f"{ours}.attn.to_{name}", f"{theirs}.linear1_{name}")
        move(f"{ours}.attn.norm_q", f"{theirs}.q_norm", ("weight",))
        move(f"{ours}.attn.norm_k", f"{theirs}.k_norm", ("weight",))
        move(f"{ours}.proj_mlp", f"{theirs}.linear1_mlp")
        move(f"{ours}.proj_out", f"{theirs}.linear2.fc")
    move("proj_out", "final_layer.linear")
    for parameter in ("weight", "bias"):
        shift, scale = take(f"final_layer.adaLN_modulation.1.{parameter}").chunk(2, dim=0)
        out[f"norm_out.linear.{parameter}"] = torch.cat([scale, shift], dim=0)
    return out


def test_a_single_file_is_in_tencents_layout_as_diffusers_converter_reads_it(base, tmp_path):
    """`merge --single-file`'s file is Tencent's `hunyuanimage2.1.safetensors` layout (q, k and v fused, as Tencent's
    loader reads it): split as that loader splits it, diffusers' converter's mapping reads every one of its tensors
    back as the transformer's own (and leaves none), and difftune reads it as a base beside the folder's other parts."""
    from safetensors.torch import save_file

    components = load_components(ModelConfig(base=base))
    original = FAMILY.layout.to_single_file(components)
    assert {"double_blocks.0.img_attn_qkv.weight", "single_blocks.0.linear2.weight", "byt5_in.fc3.bias"} <= set(
        original
    )
    save_file(original, tmp_path / "hunyuanimage2.1.safetensors")
    split = _split_as_tencents_loader_does(original)
    converted = _as_diffusers_converter_reads(split, components.denoiser.config)
    assert split == {}
    expected = components.denoiser.state_dict()
    assert converted.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(converted[key], value), key
    again = load_components(ModelConfig(base=str(tmp_path / "hunyuanimage2.1.safetensors"), single_file_config=base))
    assert again.family is FAMILY
    for key, value in again.denoiser.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_a_file_in_comfyuis_names_reads_as_the_same_transformer(base, tmp_path):
    """ComfyUI's own HunyuanImage files (saved from its HunyuanVideo model) name Tencent's layers as its modules do:
    one under ComfyUI's prefix reads as the same transformer, as HunyuanImage 2.1 and not Flux.1 (whose layers it
    shares); a HunyuanVideo file (its CLIP vector input besides) is detected as HunyuanVideo's, not this family's."""
    from safetensors.torch import save_file

    components = load_components(ModelConfig(base=base))
    comfyui = saved_by_comfyui(FAMILY.layout.to_single_file(components))
    assert {
        "model.diffusion_model.double_blocks.0.img_attn.norm.query_norm.scale",
        "model.diffusion_model.single_blocks.0.modulation.lin.weight",
        "model.diffusion_model.txt_in.individual_token_refiner.blocks.0.self_attn.qkv.weight",
        "model.diffusion_model.time_in.out_layer.bias",
    } <= set(comfyui)
    save_file(comfyui, tmp_path / "hunyuanimage2.1_bf16.safetensors")
    again = load_components(
        ModelConfig(base=str(tmp_path / "hunyuanimage2.1_bf16.safetensors"), single_file_config=base)
    )
    assert again.family is FAMILY
    for key, value in components.denoiser.state_dict().items():
        assert torch.equal(again.denoiser.state_dict()[key], value), key
    hunyuan_video = comfyui | {"model.diffusion_model.vector_in.in_layer.weight": torch.zeros(8, 4)}
    save_file(hunyuan_video, tmp_path / "hunyuan_video_t2v_720p_bf16.safetensors")
    with pytest.raises(DifftuneError, match="a HunyuanVideo single file holds the transformer alone"):
        load_components(ModelConfig(base=str(tmp_path / "hunyuan_video_t2v_720p_bf16.safetensors")))
