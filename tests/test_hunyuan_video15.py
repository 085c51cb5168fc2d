"""HunyuanVideo 1.5 against its own pipeline beyond the conformance suite: the glyph text ByT5 reads (double and
Chinese quotes, not single ones) as the pipeline encodes it, the transformer fed as the pipeline's denoising loop feeds
it on a clip, diffusers' own `HunyuanVideo15Pipeline` (no LoRA loader of its own) drawing an adapter loaded on its
transformer as difftune draws it, the kohya file in the original model's names (musubi-tuner's), clips encoded in
batches as one by one, and the step-distilled model refused by name."""

from __future__ import annotations

import pytest
import torch
from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline
from transformer_lora import assert_pipeline_draws_the_adapter, kohya_modules_read_back, trained_and_merged

from difftune.config import ModelConfig
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components
from difftune.models.autoencoders import downsampling, encode_posterior

FAMILY = FAMILIES["hunyuan_video15"]
PROMPTS = ['a sign that says "OPEN" in red', "a red circle"]  # one quoting text, one not


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("hunyuan_video15"))


def test_the_transformer_is_fed_as_the_pipelines_loop_feeds_it(base):
    """One unguided step from sigma 1 to 0 takes a clip's noise to noise - velocity: the pipeline's latents (its
    empty conditioning clip and mask beside them, 729 zero image states) equal the noise less difftune's `denoise`
    of it (one masked zero image state), for a caption with quoted text and one without in one batch; the quoted text
    is read. Two clips encode in one batch as each alone (diffusers' autoencoder fails on a batch without slicing)."""
    components = load_components(ModelConfig(base=base))
    pipeline = components.pipeline()
    pipeline.set_progress_bar_config(disable=True)
    pipeline.guider = ClassifierFreeGuidance(guidance_scale=1.0, enabled=False)
    noise = torch.randn(2, 16, 2, 4, 6, generator=torch.Generator().manual_seed(0))  # 5 frames: 2 latent frames
    side = downsampling(components.vae)
    prompts = PROMPTS
    with torch.no_grad():
        drawn = pipeline(
            prompt=prompts,
            height=4 * side,
            width=6 * side,
            num_frames=5,
            num_inference_steps=1,
            sigmas=[1.0],
            latents=noise,
            output_type="latent",
        ).frames
        conditioning = FAMILY.encode_prompts(components, FAMILY.tokenize(components.tokenizers, prompts))
        timesteps = torch.tensor([1000.0, 1000.0])
        velocity = FAMILY.denoise(components, noise, timesteps, conditioning, None)
        without_glyphs = FAMILY.denoise(
            components,
            noise,
            timesteps,
            conditioning | {"text_mask_2": torch.zeros_like(conditioning["text_mask_2"])},
            None,
        )
        clips = torch.rand(2, 3, 5, 16, 16, generator=torch.Generator().manual_seed(1)) * 2 - 1
        together = encode_posterior(components.vae, clips)[0]
        alone = torch.cat([encode_posterior(components.vae, clip[None])[0] for clip in clips])
    torch.testing.assert_close(drawn, noise - velocity, rtol=0, atol=1e-5)
    assert (without_glyphs[0] - velocity[0]).abs().max() > 1e-3  # the quoted text is read
    torch.testing.assert_close(without_glyphs[1], velocity[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-6)


def test_diffusers_own_pipeline_draws_the_adapter_as_difftune_does(make_config, base, tmp_path):
    """A merged folder says `HunyuanVideo15Pipeline`, which diffusers loads; its transformer reads the
    diffusers-layout file (`load_lora_adapter`, the pipeline having no loader) and the pipeline then draws what
    difftune's merged model draws. The kohya file names the original model's layers one for one
    (`double_blocks.0.img_attn_q`, as musubi-tuner's `networks.lora_hv_1_5` writes them) and reads back as the same
    adapter."""
    trained, merged = trained_and_merged(make_config, base, tmp_path)

    assert_pipeline_draws_the_adapter(HunyuanVideo15Pipeline, base, trained, merged, frames=5)
    modules = kohya_modules_read_back(trained, tmp_path)
    assert {
        "lora_unet_double_blocks_0_img_attn_q",
        "lora_unet_double_blocks_0_img_attn_proj",
        "lora_unet_double_blocks_0_txt_attn_v",
        "lora_unet_double_blocks_0_img_mlp_fc1",
        "lora_unet_double_blocks_0_txt_mlp_fc2",
    } <= modules
    assert not any("refiner" in module or "txt_in" in module for module in modules)


def test_the_step_distilled_model_is_refused_by_name(base, tmp_path):
    pipeline = HunyuanVideo15Pipeline.from_pretrained(base, dtype=torch.float32)
    config = dict(pipeline.transformer.config) | {"use_meanflow": True}
    pipeline.transformer = type(pipeline.transformer).from_config(config)
    pipeline.save_pretrained(tmp_path / "distilled")
    with pytest.raises(DifftuneError, match="step-distilled HunyuanVideo 1.5 base"):
        load_components(ModelConfig(base=str(tmp_path / "distilled")))
