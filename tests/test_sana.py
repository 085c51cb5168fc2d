"""Sana beyond the conformance suite: a caption longer than the text the transformer reads, encoded as the pipeline
encodes it; the noise levels and samples at the pipeline's sampler's shift; Sana Sprint refused by name."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch
from diffusers import (
    DPMSolverMultistepScheduler,
    FlowMatchEulerDiscreteScheduler,
    SanaPipeline,
    SanaSprintPipeline,
)

from difftune.config import ModelConfig
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, family_of, load_components
from difftune.families.sana import TEXT_TOKENS

FAMILY = FAMILIES["sana"]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("sana"))


def test_a_long_caption_is_read_as_the_pipeline_reads_it(base):
    """The pipeline keeps the first position and the last 299 of the instruction and the caption: a caption longer
    than that fills all 300, cut where the pipeline cuts it (its states equal, bit for bit, its mask full); a short
    one beside it in the batch keeps its own."""
    components = load_components(ModelConfig(base=base))
    captions = ["a red circle " * 40, "a blue square"]
    instruction = inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default
    with torch.no_grad():
        token_ids = FAMILY.conditioning.tokenize(components.tokenizers, captions)
        ours = FAMILY.conditioning.encode_prompts(components, token_ids)
        states, mask, *_ = components.pipeline().encode_prompt(
            captions, do_classifier_free_guidance=False, device="cpu", complex_human_instruction=instruction
        )
    assert TEXT_TOKENS == inspect.signature(SanaPipeline.__call__).parameters["max_sequence_length"].default
    assert mask.shape[1] == TEXT_TOKENS and mask[0].all() and not mask[1].all()
    assert torch.equal(ours["text_mask"], mask.long())
    assert torch.equal(ours["encoder_hidden_states"], states * mask[..., None])


def test_noise_levels_and_samples_take_the_pipeline_samplers_shift(base):
    """The pipeline's DPM-Solver shifts flow sigmas by its `flow_shift` at every size: training draws its noise levels
    with it (`loss.flow_shift_by_resolution`), and difftune's Euler sampler is built at it."""
    components = load_components(ModelConfig(base=base))
    flow_shift = DPMSolverMultistepScheduler.from_pretrained(base, subfolder="scheduler").config.flow_shift
    assert components.noise_scheduler.config.shift == flow_shift == 3.0
    assert not components.noise_scheduler.config.use_dynamic_shifting
    for tokens in (16, 1024, 4096):
        assert FAMILY.objective.resolution_shift(components, tokens) == flow_shift
    sampler = FAMILY.drawing.sampler("auto").from_config(components.noise_scheduler.config)
    assert isinstance(sampler, FlowMatchEulerDiscreteScheduler) and sampler.config.shift == flow_shift


def test_sana_sprint_is_refused_by_name(base, tmp_path):
    """Sana Sprint is consistency-distilled (TrigFlow, sampled by `SCMScheduler` in 1 to 4 steps): no family trains it,
    and detection says what the base is."""
    index = json.loads((Path(base) / "model_index.json").read_text())
    index["_class_name"] = SanaSprintPipeline.__name__
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(DifftuneError, match="is a SanaSprintPipeline; difftune trains"):
        family_of(ModelConfig(base=str(tmp_path)))
