"""HunyuanImage 2.1 against its own pipeline beyond the conformance suite: the glyph text ByT5 reads (quoted text) as
the pipeline encodes it, the transformer fed as the pipeline's denoising loop feeds it, diffusers' own
`HunyuanImagePipeline` (no LoRA loader of its own) drawing an adapter loaded on its transformer as difftune draws it,
the kohya file in ComfyUI's HunyuanVideo block names, and the distilled model refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import ClassifierFreeGuidance, HunyuanImagePipeline
from safetensors.torch import load_file

from difftune.adapters import export
from difftune.config import ModelConfig
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components
from difftune.families.hunyuan_image import GLYPH_TOKENS, TEXT_TOKENS
from difftune.models.autoencoders import downsampling
from difftune.training.train import train

FAMILY = FAMILIES["hunyuan_image"]
CAPTIONS = [
    'a sign that says "OPEN" in red',
    "a red circle",
    "a cup with 'tea' and “茶” written on it",
    "",
]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("hunyuan_image"))


def test_quoted_text_is_read_by_byt5_as_the_pipeline_reads_it(base):
    """`extract_glyph_text` finds single, double and Chinese quotes; ByT5's states of what it finds equal the
    pipeline's bit for bit, with its mask; a caption quoting nothing has none (zeros, as the pipeline's); the text
    cache keeps each caption's real tokens of both and gives back the same conditioning."""
    components = load_components(ModelConfig(base=base))
    with torch.no_grad():
        ours = FAMILY.encode_prompts(components, FAMILY.tokenize(components.tokenizers, CAPTIONS))
        states, mask, glyphs, glyph_mask = components.pipeline().encode_prompt(
            CAPTIONS, device="cpu", batch_size=len(CAPTIONS)
        )
    assert ours["encoder_hidden_states_2"].shape[1] == GLYPH_TOKENS and ours["encoder_hidden_states"].shape[1] == (
        TEXT_TOKENS
    )
    assert torch.equal(ours["text_mask_2"], glyph_mask) and glyph_mask.sum(dim=1).tolist()[1::2] == [0, 0]
    assert torch.equal(ours["encoder_hidden_states_2"], glyphs * glyph_mask[..., None])
    assert torch.equal(ours["encoder_hidden_states"], states * mask[..., None])
    for i in range(len(CAPTIONS)):
        one = {name: value[i] for name, value in ours.items()}
        stored = FAMILY.cached_conditioning(one)
        assert len(stored["encoder_hidden_states_2"]) == int(glyph_mask[i].sum())
        back = FAMILY.uncached_conditioning(stored)
        assert all(torch.equal(back[name], one[name]) for name in one)


def test_the_transformer_is_fed_as_the_pipelines_loop_feeds_it(base):
    """One unguided step from sigma 1 to 0 takes the noise to noise - velocity: the pipeline's latents equal the noise
    less difftune's `denoise` of it, for a caption with quoted text and one without in one batch (both texts cut to
    the batch's longest caption: their padding is masked out)."""
    components = load_components(ModelConfig(base=base))
    pipeline = components.pipeline()
    noise = torch.randn(2, 16, 4, 6, generator=torch.Generator().manual_seed(0))
    side = downsampling(components.vae)
    prompts = CAPTIONS[:2]
    with torch.no_grad():
        drawn = pipeline(
            prompt=prompts,
            height=4 * side,
            width=6 * side,
            num_inference_steps=1,
            sigmas=[1.0],
            latents=noise,
            output_type="latent",
        ).images
        conditioning = FAMILY.encode_prompts(components, FAMILY.tokenize(components.tokenizers, prompts))
        velocity = FAMILY.denoise(components, noise, torch.tensor([1000.0, 1000.0]), conditioning, None)
        without_glyphs = FAMILY.denoise(
            components,
            noise,
            torch.tensor([1000.0, 1000.0]),
            conditioning | {"text_mask_2": torch.zeros_like(conditioning["text_mask_2"])},
            None,
        )
    torch.testing.assert_close(drawn, noise - velocity, rtol=0, atol=1e-5)
    assert (without_glyphs[0] - velocity[0]).abs().max() > 1e-3  # the quoted text is read
    torch.testing.assert_close(without_glyphs[1], velocity[1], rtol=0, atol=1e-5)


def test_diffusers_own_pipeline_draws_the_adapter_as_difftune_does(make_config, base, tmp_path):
    """A merged folder says `HunyuanImagePipeline`, which diffusers loads; its transformer reads the diffusers-layout
    file (`load_lora_adapter`, the pipeline having no loader) and the pipeline then draws what difftune's adapted
    model draws. The kohya file names ComfyUI's HunyuanVideo blocks (q, k and v fused as `img_attn_qkv`, a single
    block's `linear1`), and reads back as the same adapter."""
    trained = train(
        make_config(
            model__base=base,
            train__max_steps=3,
            optim__learning_rate=5e-2,
            train__output_dir=str(tmp_path / "run"),
            sample__prompts=[],
        )
    ).trained_path
    merged = export.merge_into_folder(base, [(trained, 1.0)], tmp_path / "merged")[0]
    assert json.loads((merged / "model_index.json").read_text())["_class_name"] == "HunyuanImagePipeline"
    theirs = HunyuanImagePipeline.from_pretrained(base, dtype=torch.float32)
    theirs.transformer.load_lora_adapter(str(trained), prefix="transformer")
    merged_pipeline = HunyuanImagePipeline.from_pretrained(merged, dtype=torch.float32)
    untouched = HunyuanImagePipeline.from_pretrained(base, dtype=torch.float32)
    drawn = {}
    for name, pipeline in (("theirs", theirs), ("merged", merged_pipeline), ("base", untouched)):
        pipeline.set_progress_bar_config(disable=True)
        pipeline.guider = ClassifierFreeGuidance(guidance_scale=3.0)
        drawn[name] = pipeline(
            prompt="a purple circle",
            negative_prompt="",
            height=32,
            width=32,
            num_inference_steps=4,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
        ).images.numpy()
    assert np.abs(drawn["theirs"] - drawn["merged"]).max() < 1e-4
    assert np.abs(drawn["theirs"] - drawn["base"]).max() > 1e-3  # the adapter changed what is drawn

    kohya = load_file(export.convert_adapter(trained, tmp_path / "kohya.safetensors", "kohya"))
    modules = {key.split(".", 1)[0] for key in kohya}
    assert {
        "lora_unet_double_blocks_0_img_attn_qkv",
        "lora_unet_double_blocks_0_txt_attn_qkv",
        "lora_unet_double_blocks_0_img_mlp_0",
        "lora_unet_single_blocks_0_linear1",
        "lora_unet_single_blocks_0_linear2",
    } <= modules
    back = load_file(export.convert_adapter(tmp_path / "kohya.safetensors", tmp_path / "back.safetensors", "diffusers"))
    ours = load_file(trained)
    assert back.keys() == ours.keys()
    assert all(torch.allclose(back[key], ours[key], atol=1e-6) for key in ours)


def test_the_distilled_model_is_refused_by_name(base, tmp_path):
    pipeline = HunyuanImagePipeline.from_pretrained(base, dtype=torch.float32)
    config = dict(pipeline.transformer.config) | {"use_meanflow": True, "guidance_embeds": True}
    pipeline.transformer = type(pipeline.transformer).from_config(config)
    pipeline.save_pretrained(tmp_path / "distilled")
    with pytest.raises(DifftuneError, match="a distilled HunyuanImage 2.1 base .meanflow"):
        load_components(ModelConfig(base=str(tmp_path / "distilled")))
