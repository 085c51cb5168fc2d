"""Tencent Hunyuan's text conditioning (difftune/families/hunyuan_text.py) in each family that shares it, against
its own pipeline: the glyph text ByT5 reads (quoted text, as each pipeline finds it) and the language model's states,
bit for bit, and the text cache's round trip."""

from __future__ import annotations

import pytest
import torch

from difftune.config import ModelConfig
from difftune.families import FAMILIES, load_components

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
        ours = family.encode_prompts(components, family.tokenize(components.tokenizers, CAPTIONS))
        states, mask, glyphs, glyph_mask = components.pipeline().encode_prompt(
            CAPTIONS, device="cpu", batch_size=len(CAPTIONS)
        )
    assert ours["encoder_hidden_states"].shape[1] == family.padded_text_tokens
    assert ours["encoder_hidden_states_2"].shape[1] == family.glyph_tokens
    assert (glyph_mask.sum(dim=1) > 0).tolist() == QUOTED[name]
    assert torch.equal(ours["text_mask_2"], glyph_mask.long())  # HunyuanVideo 1.5's mask comes in the text's dtype
    assert torch.equal(ours["encoder_hidden_states_2"], glyphs * glyph_mask[..., None])
    assert torch.equal(ours["encoder_hidden_states"], states * mask[..., None])
    for i in range(len(CAPTIONS)):
        one = {name: value[i] for name, value in ours.items()}
        stored = family.cached_conditioning(one)
        assert len(stored["encoder_hidden_states_2"]) == int(glyph_mask[i].sum())
        back = family.uncached_conditioning(stored)
        assert all(torch.equal(back[name], one[name]) for name in one)
