"""Z-Image Omni against its own pipeline beyond the conformance suite: the transformer called as the pipeline's omni
call feeds it, and single files told apart from Z-Image's by the omni transformer's SigLIP embedder."""

from __future__ import annotations

import pytest
import torch

from difftune.config import ModelConfig
from difftune.families import FAMILIES, load_components

FAMILY = FAMILIES["z_image_omni"]


@pytest.fixture(scope="module")
def components(micro_base):
    return load_components(ModelConfig(base=str(micro_base("z_image_omni"))))


def test_the_transformer_is_fed_as_the_pipelines_omni_call_feeds_it(components):
    """One unguided step from sigma 1 to 0 takes the noise to noise - velocity: the pipeline's latents equal the noise
    less difftune's `denoise` of it (the omni call's lists; Z-Image's time and sign)."""
    pipeline = components.pipeline()
    pipeline.set_progress_bar_config(disable=True)
    noise = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        drawn = pipeline(
            prompt="a red circle",
            height=32,
            width=32,
            num_inference_steps=1,
            sigmas=[1.0],
            guidance_scale=0.0,
            latents=noise,
            output_type="latent",
        ).images
        conditioning = FAMILY.encode_prompts(components, FAMILY.tokenize(components.tokenizers, ["a red circle"]))
        velocity = FAMILY.denoise(components, noise, torch.tensor([1000.0]), conditioning, None)
    torch.testing.assert_close(drawn, noise - velocity, rtol=0, atol=1e-5)


def test_an_omni_single_file_is_read_as_omni_and_a_z_image_one_as_z_image(components, micro_base):
    """The two transformers' files share Z-Image's keys; the omni one alone has the SigLIP embedder."""
    omni = set(FAMILY.layout.to_single_file(components))
    z_image = set(
        FAMILIES["z_image"].layout.to_single_file(load_components(ModelConfig(base=str(micro_base("z_image")))))
    )
    assert any(key.startswith("siglip_embedder.") for key in omni)
    # (Lumina 2 claims both too, by the caption embedder they share: `model.single_file_config` picks among readers.)
    omni_readers = {name for name in FAMILIES if FAMILIES[name].layout.reads_single_file(omni)}
    z_image_readers = {name for name in FAMILIES if FAMILIES[name].layout.reads_single_file(z_image)}
    assert "z_image_omni" in omni_readers and "z_image" not in omni_readers
    assert "z_image" in z_image_readers and "z_image_omni" not in z_image_readers
