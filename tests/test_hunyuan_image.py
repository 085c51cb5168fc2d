"""HunyuanImage 2.1 against its own pipeline beyond the conformance suite: the glyph text ByT5 reads (quoted text) as
the pipeline encodes it, the transformer fed as the pipeline's denoising loop feeds it, diffusers' own
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
from difftune.models.autoencoders import downsampling

FAMILY = FAMILIES["hunyuan_image"]
PROMPTS = ['a sign that says "OPEN" in red', "a red circle"]  # one quoting text, one not


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("hunyuan_image"))


def test_the_transformer_is_fed_as_the_pipelines_loop_feeds_it(base):
    """One unguided step from sigma 1 to 0 takes the noise to noise - velocity: the pipeline's latents equal the noise
    less difftune's `denoise` of it, for a caption with quoted text and one without in one batch (both texts cut to
    the batch's longest caption: their padding is masked out)."""
    components = load_components(ModelConfig(base=base))
    pipeline = components.pipeline()
    noise = torch.randn(2, 16, 4, 6, generator=torch.Generator().manual_seed(0))
    side = downsampling(components.vae)
    prompts = PROMPTS
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
