"""Kandinsky 5 against its own pipeline beyond the conformance suite: the constants its pipeline holds, the transformer
fed as the pipeline's loop feeds it, captions of different lengths in one batch, and samples at the size asked."""

from __future__ import annotations

import pytest
import torch

from difftune.config import ModelConfig
from difftune.families import FAMILIES, load_components
from difftune.families.kandinsky5 import PROMPT_TEMPLATE, TEMPLATE_TOKENS

FAMILY = FAMILIES["kandinsky5"]


@pytest.fixture(scope="module")
def components(micro_base):
    return load_components(ModelConfig(base=str(micro_base("kandinsky5"))))


def test_the_constants_are_the_pipelines(components):
    pipeline = components.pipeline()
    assert PROMPT_TEMPLATE == pipeline.prompt_template
    assert TEMPLATE_TOKENS == pipeline.prompt_template_encode_start_idx


def test_the_transformer_is_fed_as_the_pipelines_loop_feeds_it(components):
    """One unguided step from sigma 1 to 0 takes the noise to noise - velocity: the pipeline's latents (channels last)
    equal the noise less difftune's `denoise` of it."""
    pipeline = components.pipeline()
    pipeline.set_progress_bar_config(disable=True)
    pipeline.resolutions = [(48, 32)]
    noise = torch.randn(1, 16, 4, 6, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        drawn = pipeline(
            prompt="a red circle",
            height=32,
            width=48,
            num_inference_steps=1,
            guidance_scale=1.0,
            latents=noise.permute(0, 2, 3, 1).unsqueeze(1),
            output_type="latent",
        ).image
        conditioning = FAMILY.encode_prompts(components, FAMILY.tokenize(components.tokenizers, ["a red circle"]))
        velocity = FAMILY.denoise(components, noise, torch.tensor([1000.0]), conditioning, None)
    torch.testing.assert_close(drawn[:, 0].permute(0, 3, 1, 2), noise - velocity, rtol=0, atol=1e-5)


def test_captions_of_different_lengths_denoise_in_one_batch_as_each_alone(components):
    """The transformer reads a caption's states without a mask: a batch of captions of two lengths gives each sample
    what it gets alone, at its own length."""
    captions = ["a red circle", "a blue square on the left of a green triangle"]
    noisy = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    timesteps = torch.tensor([300.0, 700.0])
    with torch.no_grad():
        conditioning = FAMILY.encode_prompts(components, FAMILY.tokenize(components.tokenizers, captions))
        lengths = conditioning["text_mask"].sum(dim=1)
        assert lengths[0] < lengths[1]
        together = FAMILY.denoise(components, noisy, timesteps, conditioning, None)
        for i in range(2):
            alone = FAMILY.denoise(
                components,
                noisy[i : i + 1],
                timesteps[i : i + 1],
                {k: v[i : i + 1] for k, v in conditioning.items()},
                None,
            )
            torch.testing.assert_close(together[i : i + 1], alone, rtol=0, atol=1e-6)


def test_samples_are_drawn_at_the_size_asked(components):
    """The pipeline snaps a size to the nearest of its own seven (48 x 32 would be drawn at 1408 x 640)."""
    images = FAMILY.draw(
        components.pipeline(), None, "a red circle", [], 32, 48, num_inference_steps=1, guidance_scale=1.0
    )
    assert images[0].size == (48, 32)
