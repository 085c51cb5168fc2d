"""Qwen-Image 2.1 against its own pipeline and readers beyond the conformance suite: the prompt template and the system
turn it drops, a long caption cut before the template's end, images encoded as the RGBA its autoencoder reads, the
single file as diffusers' reader of ComfyUI's layout reads it, and the sides it cannot train refused."""

from __future__ import annotations

import pytest
import torch
from diffusers.loaders.single_file_utils import convert_qwen_image21_transformer_checkpoint_to_diffusers

from difftune.config import ModelConfig
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components
from difftune.families.qwen_image21 import PROMPT_SUFFIX, PROMPT_TEMPLATE, TEXT_TOKENS, system_tokens
from difftune.models.autoencoders import encode_posterior

FAMILY = FAMILIES["qwen_image21"]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("qwen_image21"))


def test_the_prompt_template_and_the_dropped_system_turn_are_the_pipelines(base):
    pipeline = load_components(ModelConfig(base=base)).pipeline()
    assert PROMPT_TEMPLATE == pipeline.prompt_template_t2i
    assert system_tokens(pipeline.processor.tokenizer) == pipeline._drop_idx  # counted by its chat template there


def test_a_long_caption_is_cut_before_the_templates_end(base):
    """The pipeline reads a caption whole; difftune keeps `TEXT_TOKENS` of the user turn, ending as the template ends
    (the assistant turn the model was trained to read last), and a short caption is read as the pipeline reads it."""
    components = load_components(ModelConfig(base=base))
    tokenizer = components.tokenizers["processor"].tokenizer
    ids = FAMILY.conditioning.tokenize(components.tokenizers, ["a red circle " * 200, "a red circle"])["text_encoder"]
    long, short = (row[row >= 0].tolist() for row in ids)
    suffix = tokenizer(PROMPT_SUFFIX)["input_ids"]
    assert len(long) == system_tokens(tokenizer) + TEXT_TOKENS and long[-len(suffix) :] == suffix
    assert short == tokenizer(PROMPT_TEMPLATE.format("a red circle"))["input_ids"]
    assert (ids[1, : ids.shape[1] - len(short)] == -1).all()  # left-padded, as the pipeline's processor pads


def test_an_rgb_image_is_encoded_as_the_opaque_rgba_its_autoencoder_reads(base):
    """diffusers' Qwen-Image 2.1 script converts every image to RGBA (alpha 255: 1 in [-1, 1]) for this autoencoder;
    difftune's RGB pixels get the same opaque alpha, and decoding returns the RGB."""
    vae = load_components(ModelConfig(base=base)).vae
    assert vae.config.in_channels == 4
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        mean, _ = encode_posterior(vae, pixels)
        rgba = torch.cat([pixels, torch.ones(2, 1, 32, 32)], dim=1)
        theirs = vae.encode(rgba[:, :, None]).latent_dist.mode()[:, :, 0]
    torch.testing.assert_close(mean, theirs, rtol=0, atol=0)
    from difftune.models.autoencoders import decode_latents

    with torch.no_grad():
        assert decode_latents(vae, torch.zeros(1, mean.shape[1], 2, 2)).shape == (1, 3, 32, 32)


def test_a_batch_of_prompts_is_drawn_with_guidance_each_as_drawn_alone(base):
    """The eval and the sampler draw a prompt's samples as one batch with one negative prompt, which the pipeline
    encodes as a batch of one (its transformer then fails on the batch); each of the batch is what that seed draws
    alone."""
    components = load_components(ModelConfig(base=base))
    pipeline = components.pipeline()
    guidance = FAMILY.drawing.sampling_arguments(components, 3.0, "")

    def drawn(prompts, seeds):
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        images = FAMILY.drawing.draw(
            pipeline,
            components.family_options,
            prompts,
            [],
            32,
            32,
            num_inference_steps=2,
            generator=generators,
            output_type="pt",
            **guidance,
        )
        return torch.stack(list(images))

    batch = drawn(["a red circle"] * 2, [0, 1])
    torch.testing.assert_close(batch[1:], drawn(["a red circle"], [1]), rtol=0, atol=1e-5)


def test_the_single_file_is_comfyuis_layout_as_diffusers_reads_it(base):
    """The transformer alone, each MLP's gate and up projections fused into `img_mlp.gate_up` (gate rows first):
    diffusers' reader of that layout gives back every weight; difftune reads it back the same, and no other family
    claims it."""
    components = load_components(ModelConfig(base=base))
    single = FAMILY.layout.to_single_file(components)
    assert "transformer_blocks.0.img_mlp.gate_up.weight" in single
    assert not any(".gate_layer." in key or ".img_mlp.proj." in key for key in single)
    expected = components.denoiser.state_dict()
    comfyui_file = {f"model.diffusion_model.{key}": value for key, value in single.items()}  # as ComfyUI saves it
    for read in (
        convert_qwen_image21_transformer_checkpoint_to_diffusers(dict(comfyui_file)),
        FAMILY.layout.diffusers_names(dict(single)),
    ):
        assert set(read) == set(expected)
        assert all(torch.equal(read[key], expected[key]) for key in expected)
    assert [name for name in FAMILIES if FAMILIES[name].layout.reads_single_file(set(single))] == [FAMILY.name]


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"data__resolution": 1000}, "data.resolution = 1000"),
        ({"sample__resolution": 48}, "sample.resolution = 48"),
        ({"data__resolution": 512, "data__buckets": True, "data__bucket_step": 16}, "data.bucket_step = 16"),
    ],
)
def test_sides_the_transformer_cannot_read_are_refused_by_name(base, make_config, settings, named):
    """Its image slots hold 2 x 2 latent tokens at 16x: a side not a multiple of 32 px would fail inside the
    transformer (`img_shapes accounts for ...`); it is refused before any work, with the side to use."""
    config = make_config(model__base=base, **settings)
    with pytest.raises(DifftuneError, match=rf"{named}: Qwen-Image 2\.1 draws and trains sides in multiples of 32"):
        FAMILY.check_config(config)
    FAMILY.check_config(make_config(model__base=base))  # 32 px: read
