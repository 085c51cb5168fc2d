"""Z-Image Omni against its own pipeline beyond the conformance suite: the transformer called as the pipeline's omni
call feeds it, with and without reference images (their prompt segments, SigLIP2 features and latents each checked
against the pipeline's), edit pairs trained cached as uncached and drawn with their references in the pipeline, and
single files told apart from Z-Image's by the omni transformer's SigLIP embedder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
from PIL import Image

from difftune.config import ModelConfig
from difftune.families import FAMILIES, load_components
from difftune.families.common.conditioning import reference_dimensions
from difftune.families.z_image_omni import inputs_in_dtype
from difftune.models.autoencoders import encode_posterior, reference_latents
from difftune.toy.tiny import recolor_pairs
from difftune.training.metrics import read_metrics
from difftune.training.train import train

from conftest import drawn_edit_settings, edit_settings

FAMILY = FAMILIES["z_image_omni"]


@pytest.fixture(scope="module")
def components(micro_base):
    return load_components(ModelConfig(base=str(micro_base("z_image_omni"))))


def _one_unguided_step(pipeline, prompt: str, noise: torch.Tensor, **references) -> torch.Tensor:
    """The latents the pipeline makes of `noise` in one unguided step from sigma 1 to 0 (32 px), its bfloat16 encode of
    `references` (`image=`) fed the autoencoder's dtype."""
    pipeline.set_progress_bar_config(disable=True)
    with inputs_in_dtype(pipeline.vae.encoder, pipeline.vae.dtype):
        return pipeline(
            prompt=prompt,
            height=32,
            width=32,
            num_inference_steps=1,
            sigmas=[1.0],
            guidance_scale=0.0,
            latents=noise,
            output_type="latent",
            **references,
        ).images


def test_the_transformer_is_fed_as_the_pipelines_omni_call_feeds_it(components):
    """One unguided step from sigma 1 to 0 takes the noise to noise - velocity: the pipeline's latents equal the noise
    less difftune's `denoise` of it (the omni call's lists; Z-Image's time and sign)."""
    noise = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        drawn = _one_unguided_step(components.pipeline(), "a red circle", noise)
        conditioning = FAMILY.conditioning.encode_prompts(
            components, FAMILY.conditioning.tokenize(components.tokenizers, ["a red circle"])
        )
        velocity = FAMILY.denoise(components, noise, torch.tensor([1000.0]), conditioning, None)
    torch.testing.assert_close(drawn, noise - velocity, rtol=0, atol=1e-5)


def _references() -> list[Image.Image]:
    """Two references of different sizes, each at least the 64 px the pipeline takes."""
    first, second = (control for control, _, _ in recolor_pairs(2, seed=5))
    return [first.resize((64, 64)), second.resize((96, 64))]


def test_prompts_with_references_are_encoded_as_the_pipeline_encodes_them(components):
    """A caption with two references: its four segments' states, one after the other, equal the pipeline's
    `encode_prompt` (to float rounding: it reads each segment at 512 tokens, we at the batch's longest, as Z-Image's
    family does), and each reference's SigLIP2 features its `prepare_siglip_embeds`."""
    pipeline, references = components.pipeline(), _references()
    captions = ["make it red", "make it green, and keep the shape"]
    with torch.no_grad():
        ours = FAMILY.conditioning.encode_prompts(
            components, FAMILY.conditioning.tokenize(components.tokenizers, captions, [references] * 2)
        )
        theirs, _ = pipeline.encode_prompt(
            captions, device="cpu", do_classifier_free_guidance=False, num_condition_images=2
        )
        siglip = pipeline.prepare_siglip_embeds(references, 1, "cpu", torch.float32)[0]
    for i, segments in enumerate(theirs):
        assert len(segments) == 4
        states = torch.cat(segments)
        torch.testing.assert_close(ours["encoder_hidden_states"][i, : len(states)], states, rtol=0, atol=1e-5)
        assert not ours["encoder_hidden_states"][i, len(states) :].any()
        assert ours["text_segments"][i, : len(states)].tolist() == [
            s + 1 for s, segment in enumerate(segments) for _ in segment
        ]
    features = FAMILY.siglip_features(ours, 1)
    assert features[-1] is None and len(features) == 3
    for expected, got in zip(siglip, features, strict=False):
        assert torch.equal(got, expected)  # (4, 4, C) and, for the 96 x 64 one, (3, 5, C): its own patch grid


def test_the_transformer_reads_references_as_the_pipelines_omni_call(components):
    """One unguided step from sigma 1 with two references: the pipeline's latents equal the noise less our `denoise`
    of it, with the references' latents encoded from the pixels the pipeline encodes (it rounds them to bfloat16) and
    their SigLIP features from our prompts. Without the references the prediction differs."""
    pipeline, references = components.pipeline(), _references()
    noise = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        drawn = _one_unguided_step(pipeline, "make it red", noise, image=references)
        conditioning = FAMILY.conditioning.encode_prompts(
            components, FAMILY.conditioning.tokenize(components.tokenizers, ["make it red"], [references])
        )
        pixels = [
            pipeline.image_processor.preprocess(r, r.height, r.width, resize_mode="crop").bfloat16().float()
            for r in references
        ]
        conditioning["control_latents"] = [
            reference_latents(encode_posterior(components.vae, p)[0], components.latent_normalization) for p in pixels
        ]
        velocity = FAMILY.denoise(components, noise, torch.tensor([1000.0]), conditioning, None)
        text_alone = {name: conditioning[name] for name in ("encoder_hidden_states", "text_mask")}
        without = FAMILY.denoise(components, noise, torch.tensor([1000.0]), text_alone, None)
    torch.testing.assert_close(drawn, noise - velocity, rtol=0, atol=1e-5)
    assert (velocity - without).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("target", "reference", "expected"),
    [((1024, 1024), (2048, 1536), (1184, 880)), ((32, 32), (96, 64), (96, 64)), ((512, 512), (80, 320), (256, 1024))],
)
def test_references_train_at_the_targets_area_in_sizes_the_pipeline_takes(target, reference, expected):
    """The target's area, the reference's aspect, sides multiples of 16 and at least 64 px; the pipeline takes a
    reference so sized and keeps it as it is."""
    size = FAMILY.conditioning.control_size(target, reference)
    assert size == reference_dimensions(target[0] * target[1], reference) == expected
    Flux2ImageProcessor.check_image_input(Image.new("RGB", size))  # raises where the pipeline would refuse it


def test_pairs_train_cached_as_uncached_and_draw_with_their_references(micro_base, pairs, make_config, tmp_path):
    """Edit pairs (32 px targets, references trained at 64 px): the same losses with the latent and text caches as
    without, the text cache keyed by the references, and the run's sample of an instruction with a reference drawn as
    ZImageOmniPipeline draws it with the adapter loaded."""
    base = micro_base("z_image_omni")
    losses = {}
    for cached in (False, True):
        settings = edit_settings(
            base,
            pairs,
            tmp_path / f"run-{cached}",
            cache__latents=cached,
            cache__text=cached,
            cache__dir=str(tmp_path / "cache"),
            train__max_steps=3,
        )
        train(make_config(**settings))
        losses[cached] = [row["loss"] for row in read_metrics(tmp_path / f"run-{cached}")]
    assert np.allclose(losses[False], losses[True], rtol=1e-5, atol=1e-7)
    assert len(set((tmp_path / "cache" / "text").rglob("*.safetensors"))) == 6 * 2  # each pair's and its dropped

    settings, control = drawn_edit_settings(base, pairs, tmp_path / "drawn")
    result = train(make_config(**settings))
    pipeline = FAMILY.pipeline_class.from_pretrained(base, dtype=torch.float32)
    pipeline.load_lora_weights(str(result.trained_path.parent), weight_name=result.trained_path.name)
    pipeline.scheduler = FAMILY.drawing.sampler("auto").from_config(pipeline.scheduler.config)
    pipeline.set_progress_bar_config(disable=True)
    with inputs_in_dtype(pipeline.vae.encoder, pipeline.vae.dtype):
        image = pipeline(
            image=[Image.open(control).convert("RGB").resize((64, 64))],
            prompt="make it purple",
            guidance_scale=0.0,
            num_inference_steps=3,
            height=32,
            width=32,
            generator=torch.Generator("cpu").manual_seed(0),
        ).images[0]
    ours = np.asarray(Image.open(tmp_path / "drawn" / "samples" / "000.png"), dtype=np.int16)
    assert np.abs(ours - np.asarray(image, dtype=np.int16)).max() <= 2


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
