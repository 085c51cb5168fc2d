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
