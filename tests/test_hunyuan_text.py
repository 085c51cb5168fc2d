"""Tencent Hunyuan's text conditioning (difftune/families/common/hunyuan_text.py) in each family that shares it, against
its own pipeline: the glyph text ByT5 reads (quoted text, as each pipeline finds it) and the language model's states,
bit for bit, the text cache's round trip, and the transformer fed both texts as the pipeline's loop feeds it."""

from __future__ import annotations

import pytest
import torch
from diffusers import ClassifierFreeGuidance

from difftune.config import ModelConfig
from difftune.families import FAMILIES, load_components
from difftune.models.autoencoders import downsampling

CAPTIONS = [
    'a sign that says "OPEN" in red',
    "a red circle",
    "a cup with 'tea' and “茶” written on it",
    "a cup with 'tea' written on it",
    "",
]
# Which captions each pipeline finds quoted text in: HunyuanImage 2.1's reads single quotes too, HunyuanVideo 1.5's
# double and Chinese ones alone.
QUOTED = {"hunyuan_image": [True, False, True, True, False], "hunyuan_video15": [True, False, True, False, False]}


@pytest.mark.parametrize("name", sorted(QUOTED))
def test_quoted_text_is_read_by_byt5_as_the_pipeline_reads_it(micro_base, name):
    """ByT5's states of the text each caption quotes equal the pipeline's bit for bit, with its mask, as do the
    language model's; a caption quoting nothing (for that pipeline) has none (zeros, as the pipeline's); the text cache
    keeps each caption's real tokens of both and gives back the same conditioning."""
    family = FAMILIES[name]
    components = load_components(ModelConfig(base=str(micro_base(name))))
    with torch.no_grad():
        ours = family.conditioning.encode_prompts(
            components, family.conditioning.tokenize(components.tokenizers, CAPTIONS)
        )
        states, mask, glyphs, glyph_mask = components.pipeline().encode_prompt(
            CAPTIONS, device="cpu", batch_size=len(CAPTIONS)
        )
    assert ours["encoder_hidden_states"].shape[1] == family.conditioning.padded_text_tokens
    assert ours["encoder_hidden_states_2"].shape[1] == family.conditioning.glyph_tokens
    assert (glyph_mask.sum(dim=1) > 0).tolist() == QUOTED[name]
    assert torch.equal(ours["text_mask_2"], glyph_mask.long())  # HunyuanVideo 1.5's mask comes in the text's dtype
    assert torch.equal(ours["encoder_hidden_states_2"], glyphs * glyph_mask[..., None])
    assert torch.equal(ours["encoder_hidden_states"], states * mask[..., None])
    for i in range(len(CAPTIONS)):
        one = {name: value[i] for name, value in ours.items()}
        stored = family.conditioning.cached_conditioning(one)
        assert len(stored["encoder_hidden_states_2"]) == int(glyph_mask[i].sum())
        back = family.conditioning.uncached_conditioning(stored)
        assert all(torch.equal(back[name], one[name]) for name in one)


# Each family's noise for one 4 x 6 latent draw: an image's, a clip's of two latent frames (5 frames).
NOISE = {"hunyuan_image": (2, 16, 4, 6), "hunyuan_video15": (2, 16, 2, 4, 6)}


@pytest.mark.parametrize("name", sorted(NOISE))
def test_the_transformer_is_fed_as_the_pipelines_loop_feeds_it(micro_base, name):
    """One unguided step from sigma 1 to 0 takes the noise to noise - velocity: the pipeline's latents equal the noise
    less difftune's `denoise` of it, for a caption with quoted text and one without in one batch (both texts cut to
    the batch's longest caption: their padding is masked out; HunyuanVideo 1.5's pipeline passes an empty
    conditioning clip and mask and 729 zero image states, difftune one masked zero image state); the quoted text is
    read."""
    family = FAMILIES[name]
    components = load_components(ModelConfig(base=str(micro_base(name))))
    pipeline = components.pipeline()
    pipeline.set_progress_bar_config(disable=True)
    pipeline.guider = ClassifierFreeGuidance(guidance_scale=1.0, enabled=False)
    noise = torch.randn(*NOISE[name], generator=torch.Generator().manual_seed(0))
    side = downsampling(components.vae)
    prompts = CAPTIONS[:2]  # one quoting text, one not
    clip = {"num_frames": 5} if noise.dim() == 5 else {}
    with torch.no_grad():
        drawn = pipeline(
            prompt=prompts,
            height=4 * side,
            width=6 * side,
            **clip,
            num_inference_steps=1,
            sigmas=[1.0],
            latents=noise,
            output_type="latent",
        )
        drawn = drawn.frames if clip else drawn.images
        conditioning = family.conditioning.encode_prompts(
            components, family.conditioning.tokenize(components.tokenizers, prompts)
        )
        timesteps = torch.tensor([1000.0, 1000.0])
        velocity = family.denoise(components, noise, timesteps, conditioning, None)
        without_glyphs = family.denoise(
            components,
            noise,
            timesteps,
            conditioning | {"text_mask_2": torch.zeros_like(conditioning["text_mask_2"])},
            None,
        )
    torch.testing.assert_close(drawn, noise - velocity, rtol=0, atol=1e-5)
    assert (without_glyphs[0] - velocity[0]).abs().max() > 1e-3  # the quoted text is read
    torch.testing.assert_close(without_glyphs[1], velocity[1], rtol=0, atol=1e-5)
