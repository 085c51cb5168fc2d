"""HunyuanVideo 1.5 against its own pipeline beyond the conformance suite and tests/test_hunyuan_text.py (its text,
and the transformer fed as the pipeline's loop feeds it): diffusers' own `HunyuanVideo15Pipeline` (no LoRA loader of
its own) drawing an adapter loaded on its transformer as difftune draws it, the kohya file in the original model's
names (musubi-tuner's), clips encoded in batches as one by one, and the step-distilled model refused by name."""

from __future__ import annotations

import pytest
import torch
from diffusers import HunyuanVideo15Pipeline
from safetensors.torch import load_file, save_file
from transformer_lora import assert_pipeline_draws_the_adapter, kohya_modules_read_back, trained_and_merged

from difftune.adapters import export
from difftune.adapters.files import read_adapter
from difftune.adapters.trained import config_alpha
from difftune.config import ModelConfig
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components
from difftune.families.common.hunyuan_original import ORIGINAL_IN_BLOCK
from difftune.families.hunyuan_video15 import TENCENT_FILE
from difftune.models.autoencoders import encode_posterior

FAMILY = FAMILIES["hunyuan_video15"]
PROMPTS = ['a sign that says "OPEN" in red', "a red circle"]  # one quoting text, one not


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("hunyuan_video15"))


def test_clips_encode_in_a_batch_as_one_by_one(base):
    """diffusers' autoencoder fails on a batch of two clips without slicing (its mid-block attention broadcasts the
    causal mask across the batch): the family turns it on, and a batch encodes as each clip alone."""
    components = load_components(ModelConfig(base=base))
    clips = torch.rand(2, 3, 5, 16, 16, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        together = encode_posterior(components.vae, clips)[0]
        alone = torch.cat([encode_posterior(components.vae, clip[None])[0] for clip in clips])
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-6)


def test_diffusers_own_pipeline_draws_the_adapter_as_difftune_does(make_config, base, tmp_path):
    """A merged folder says `HunyuanVideo15Pipeline`, which diffusers loads; its transformer reads the
    diffusers-layout file (`load_lora_adapter`, the pipeline having no loader) and the pipeline then draws what
    difftune's merged model draws. The kohya file names the layers as ComfyUI's HunyuanVideo model holds them (q, k and
    v fused as `img_attn_qkv`, the MLP's `img_mlp_0`: ComfyUI mapped 2 of 12 modules a block of the one-for-one names
    written before) and reads back as the same adapter; a file in those older names is read as the same adapter too."""
    trained, merged = trained_and_merged(make_config, base, tmp_path)

    assert_pipeline_draws_the_adapter(HunyuanVideo15Pipeline, base, trained, merged, frames=5)
    modules = kohya_modules_read_back(trained, tmp_path)
    assert {
        "lora_unet_double_blocks_0_img_attn_qkv",
        "lora_unet_double_blocks_0_img_attn_proj",
        "lora_unet_double_blocks_0_txt_attn_qkv",
        "lora_unet_double_blocks_0_img_mlp_0",
        "lora_unet_double_blocks_0_txt_mlp_2",
    } <= modules
    assert not any(module.endswith(("_attn_q", "_mlp_fc1")) for module in modules)
    assert not any("refiner" in module or "txt_in" in module for module in modules)

    # musubi-tuner's layout (`networks.lora_hv_1_5`), which difftune wrote before: Tencent's names one for one.
    ours, lora_configs, _ = read_adapter(trained)
    older = {}
    for key, value in ours.items():
        module, kind = key.removeprefix("transformer.").rsplit(".lora_", 1)
        block, rest = module.removeprefix("transformer_blocks.").split(".", 1)
        name = f"lora_unet_double_blocks_{block}_{ORIGINAL_IN_BLOCK[rest].replace('.', '_')}"
        older[f"{name}.{'lora_down' if kind.startswith('A') else 'lora_up'}.weight"] = value
        older[f"{name}.alpha"] = torch.tensor(float(config_alpha(lora_configs, "transformer", module)))
    save_file(older, tmp_path / "older.safetensors")
    older_read = export.convert_adapter(
        tmp_path / "older.safetensors", tmp_path / "back.safetensors", "diffusers", base
    )
    back = load_file(older_read)
    assert back.keys() == ours.keys()
    assert all(torch.equal(back[key], value) for key, value in ours.items())


def test_single_files_are_comfyuis_and_tencents_read_as_the_same_transformer(base, tmp_path):
    """The single file holds q, k and v fused under Tencent's names (`img_attn_qkv`), as ComfyUI's repackaged files
    do; Tencent's own file, q, k and v apart, reads as the same transformer."""
    components = load_components(ModelConfig(base=base))
    written = FAMILY.layout.to_single_file(components)
    assert "double_blocks.0.img_attn_qkv.weight" in written and "double_blocks.0.img_attn_q.weight" not in written
    tencent = TENCENT_FILE.original_state_dict(components.denoiser.state_dict())
    assert "double_blocks.0.img_attn_q.weight" in tencent
    expected = components.denoiser.state_dict()
    for weights in (written, tencent):
        assert FAMILY.layout.reads_single_file(set(weights))
        read = FAMILY.layout.diffusers_names(weights)
        assert read.keys() == expected.keys()
        assert all(torch.equal(read[key], expected[key]) for key in expected)


def test_the_step_distilled_model_is_refused_by_name(base, tmp_path):
    pipeline = HunyuanVideo15Pipeline.from_pretrained(base, dtype=torch.float32)
    config = dict(pipeline.transformer.config) | {"use_meanflow": True}
    pipeline.transformer = type(pipeline.transformer).from_config(config)
    pipeline.save_pretrained(tmp_path / "distilled")
    with pytest.raises(DifftuneError, match="step-distilled HunyuanVideo 1.5 base"):
        load_components(ModelConfig(base=str(tmp_path / "distilled")))
