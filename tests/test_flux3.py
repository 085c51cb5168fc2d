"""FLUX.3 against its own modular pipeline and readers beyond the conformance suite: the constants its blocks hold,
the transformer fed as the pipeline's denoise step feeds it (with references too), captions of different text windows
in one batch, a long caption cut before the template's end, edit pairs trained and drawn as the pipeline draws them,
the single file as diffusers' reader of BFL's layout reads it, and a modular base whose parts live in another
folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import ClassifierFreeGuidance, Flux3AutoBlocks, Flux3DistilledModularPipeline
from diffusers.loaders.single_file_utils import convert_flux3_transformer_checkpoint_to_diffusers
from diffusers.modular_pipelines.flux3.before_denoise import (
    Flux3PrepareImageCondLatentsStep,
    Flux3PrepareLatentsStep,
    Flux3SetTimestepsStep,
    Flux3TextRoPEInputsStep,
    _prepare_image_ids,
)
from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep
from PIL import Image

from difftune.config import ModelConfig
from difftune.data.dataset import image_to_tensor
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, family_of, load_components
from difftune.families.flux3 import (
    IMAGE_ROPE_SCALE,
    MAX_TEXT_TOKENS,
    PAD_MULTIPLE,
    TEXT_LAYERS,
    position_ids,
    reference_tokens,
    template_ends,
)
from difftune.models.autoencoders import downsampling, encode_posterior, reference_latents
from difftune.toy.tiny import recolor_pairs
from difftune.training.metrics import read_metrics
from difftune.training.train import train

from conftest import drawn_edit_settings

FAMILY = FAMILIES["flux3"]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("flux3"))


def test_the_constants_are_the_modular_blocks(base):
    text_step = Flux3TextEncoderStep()
    assert PAD_MULTIPLE == text_step.pad_multiple
    assert TEXT_LAYERS == next(p.default for p in text_step.inputs if p.name == "text_encoder_out_layers")
    assert IMAGE_ROPE_SCALE == Flux3PrepareLatentsStep().image_rope_scale
    assert set(FAMILY.loading.left_out_steps) <= set(Flux3AutoBlocks().sub_blocks)  # the steps it leaves out exist
    components = load_components(ModelConfig(base=base))
    assert components.noise_scheduler.config.shift == Flux3SetTimestepsStep().shift  # the scheduler the blocks make
    assert torch.equal(position_ids(torch.arange(12), 4, IMAGE_ROPE_SCALE), _prepare_image_ids(3, 4, IMAGE_ROPE_SCALE))
    assert torch.equal(position_ids(torch.arange(7)), Flux3TextRoPEInputsStep._prepare_text_ids(torch.zeros(1, 7)))
    assert IMAGE_ROPE_SCALE == Flux3PrepareImageCondLatentsStep().image_rope_scale
    references = [torch.zeros(1, 3, 2, 3), torch.zeros(1, 3, 4, 1)]
    assert torch.equal(
        reference_tokens(references)[1],
        torch.cat([_prepare_image_ids(2, 3, IMAGE_ROPE_SCALE, -1), _prepare_image_ids(4, 1, IMAGE_ROPE_SCALE, -2)]),
    )


def _one_unguided_step(components, prompt: str, noise: torch.Tensor, **references) -> torch.Tensor:
    """The latents the pipeline makes of `noise` (B, C, h, w) in one unguided step from sigma 1 to 0 (the pipeline's
    one-step sigmas, shift or not), with `references` (`image=`) if any."""
    pipeline = components.pipeline()
    pipeline.update_components(guider=ClassifierFreeGuidance(guidance_scale=1.0))
    side = downsampling(components.vae)  # pixels a (patched) latent pixel covers
    height, width = noise.shape[-2:]
    return pipeline(
        prompt=prompt,
        height=height * side,
        width=width * side,
        num_inference_steps=1,
        latents=noise,
        output="latents",
        **references,
    )


def test_the_transformer_is_fed_as_the_pipelines_denoise_step_feeds_it(base):
    """One unguided step from sigma 1 to 0 (the pipeline's one-step sigmas, shift or not) takes the noise to noise -
    velocity: the pipeline's image equals the noise less difftune's `denoise` of it."""
    components = load_components(ModelConfig(base=base))
    noise = torch.randn(1, components.denoiser.config.in_channels, 2, 3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        drawn = _one_unguided_step(components, "a red circle", noise)
        conditioning = FAMILY.conditioning.encode_prompts(
            components, FAMILY.conditioning.tokenize(components.tokenizers, ["a red circle"])
        )
        velocity = FAMILY.denoise(components, noise, torch.tensor([1000.0]), conditioning, None)
    torch.testing.assert_close(drawn, noise - velocity, rtol=0, atol=1e-5)


def test_the_transformer_reads_references_as_the_pipelines_image_conditioned_call(base):
    """One unguided step from sigma 1 with two references of different sizes (on the pipeline's 16 px grid and at least
    64 px a side, which its image step keeps as they are): the pipeline's latents equal the noise less difftune's
    `denoise` of it, the references' latents encoded from difftune's own pixels of them. Without the references the
    prediction differs."""
    components = load_components(ModelConfig(base=base))
    first, second = (control for control, _, _ in recolor_pairs(2, seed=5))
    references = [first.resize((64, 64)), second.resize((96, 64))]  # the least the pipeline keeps as it is, and more
    noise = torch.randn(1, components.denoiser.config.in_channels, 2, 3, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        drawn = _one_unguided_step(components, "make it red", noise, image=references)
        conditioning = FAMILY.conditioning.encode_prompts(
            components, FAMILY.conditioning.tokenize(components.tokenizers, ["make it red"])
        )
        text_alone = dict(conditioning)
        conditioning["control_latents"] = [
            reference_latents(
                encode_posterior(components.vae, image_to_tensor(r)[None])[0], components.latent_normalization
            )
            for r in references
        ]
        velocity = FAMILY.denoise(components, noise, torch.tensor([1000.0]), conditioning, None)
        without = FAMILY.denoise(components, noise, torch.tensor([1000.0]), text_alone, None)
    torch.testing.assert_close(drawn, noise - velocity, rtol=0, atol=1e-5)
    assert (velocity - without).abs().max() > 1e-2


def test_pairs_train_and_draw_with_their_reference_as_the_pipeline_does(base, pairs, make_config, tmp_path):
    """Edit pairs beside nothing else: the run's losses are finite and its sample of an instruction with a control is
    what `Flux3ModularPipeline` draws with the trained adapter loaded and the control as its image. The adapter leaves
    the references' own blocks (`image_cond`) as they are."""
    settings, control = drawn_edit_settings(base, pairs, tmp_path / "run")
    result = train(make_config(**settings))
    assert all(np.isfinite(row["loss"]) for row in read_metrics(tmp_path / "run") if "loss" in row)
    components = load_components(ModelConfig(base=base))
    pipeline = components.pipeline()
    pipeline.load_lora_weights(str(result.trained_path.parent), weight_name=result.trained_path.name)
    assert not any("image_cond" in name for name, _ in pipeline.transformer.named_modules() if "lora_A" in name)
    pipeline.update_components(
        guider=ClassifierFreeGuidance(guidance_scale=1.0),
        scheduler=FAMILY.drawing.sampler("auto").from_config(components.noise_scheduler.config),
    )
    reference = Image.open(control).convert("RGB")
    assert FAMILY.conditioning.control_size((32, 32), reference.size) == (
        64,
        64,
    )  # the least the pipeline keeps as it is

    def drawn(output: str, **image):
        with torch.no_grad():
            return pipeline(
                prompt="make it purple",
                height=32,
                width=32,
                num_inference_steps=3,
                generator=torch.Generator("cpu").manual_seed(0),
                output=output,
                **image,
            )

    theirs = np.asarray(drawn("images", image=[reference.resize((64, 64))])[0], dtype=np.int16)
    ours = np.asarray(Image.open(tmp_path / "run" / "samples" / "000.png"), dtype=np.int16)
    assert np.abs(ours - theirs).max() <= 2
    # The reference is read: the latents differ without it (the micro autoencoder's decoder blurs that away).
    assert (drawn("latents", image=[reference.resize((64, 64))]) - drawn("latents")).abs().max() > 1e-2


def test_captions_of_different_windows_denoise_in_one_batch_as_each_alone(base):
    """The transformer reads a caption's whole window, padding included, and takes no mask: a batch of an 80- and a
    160-token window gives each sample what it gets alone."""
    components = load_components(ModelConfig(base=base))
    captions = ["a red circle", "a blue square " * 20]
    noisy = torch.randn(2, components.denoiser.config.in_channels, 2, 2, generator=torch.Generator().manual_seed(1))
    timesteps = torch.tensor([300.0, 700.0])
    with torch.no_grad():
        conditioning = FAMILY.conditioning.encode_prompts(
            components, FAMILY.conditioning.tokenize(components.tokenizers, captions)
        )
        tokens = (FAMILY.conditioning.tokenize(components.tokenizers, captions)["text_encoder"] >= 0).sum(dim=1)
        windows = conditioning["text_mask"].sum(dim=1)
        assert windows.tolist() == (-(-tokens // PAD_MULTIPLE) * PAD_MULTIPLE).tolist() and windows[0] < windows[1]
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


def test_a_long_caption_is_cut_before_the_templates_end(base):
    """The pipeline reads 8192 tokens; difftune keeps `MAX_TEXT_TOKENS` of the templated caption, ending as the
    template ends (the generation prompt the model was trained to read last); a short caption is read as the
    pipeline reads it, right-padded."""
    components = load_components(ModelConfig(base=base))
    processor = components.tokenizers["tokenizer"]
    ids = FAMILY.conditioning.tokenize(components.tokenizers, ["a red circle " * 200, "a red circle"])["text_encoder"]
    long, short = (row[row >= 0].tolist() for row in ids)
    before, after = template_ends(processor)
    suffix = processor.tokenizer(after)["input_ids"]
    assert len(long) == MAX_TEXT_TOKENS and long[-len(suffix) :] == suffix
    text = processor.apply_chat_template(
        [{"role": "user", "content": "a red circle"}], tokenize=False, add_generation_prompt=True
    )
    assert short == processor.tokenizer(text)["input_ids"]
    assert (ids[1, len(short) :] == -1).all()


def test_the_single_file_is_bfls_layout_as_diffusers_reads_it(base):
    """The transformer alone under BFL's names (`content_mode_blocks.image.0.q_proj`, the final modulation's halves
    swapped): diffusers' reader of that layout gives back every weight, difftune reads it back the same, and no other
    family claims it."""
    components = load_components(ModelConfig(base=base))
    single = FAMILY.layout.to_single_file(components)
    assert {"content_mode_blocks.image.0.q_proj.weight", "single_blocks.0.mlp_in.weight", "txt_in.weight"} <= set(
        single
    )
    expected = components.denoiser.state_dict()
    comfyui_file = {f"model.diffusion_model.{key}" for key in single}  # as ComfyUI saves it
    for read in (
        convert_flux3_transformer_checkpoint_to_diffusers(dict(single)),
        FAMILY.layout.diffusers_names(dict(single)),
    ):
        assert set(read) == set(expected)
        assert all(torch.equal(read[key], expected[key]) for key in expected)
    assert FAMILY.layout.reads_single_file(comfyui_file)
    assert [name for name in FAMILIES if FAMILIES[name].layout.reads_single_file(set(single))] == [FAMILY.name]


def test_a_modular_base_whose_parts_live_elsewhere_loads_them_from_there(base, tmp_path):
    """A modular base is its `modular_model_index.json`: each part is loaded from where its spec points (here every
    part from the micro base's folder, the index alone in another), and planned from there too."""
    index = json.loads((Path(base) / "modular_model_index.json").read_text())
    for entry in index.values():
        if isinstance(entry, list):
            entry[2]["pretrained_model_name_or_path"] = base
    (tmp_path / "modular_model_index.json").write_text(json.dumps(index))
    components = load_components(ModelConfig(base=str(tmp_path)))
    expected = load_components(ModelConfig(base=base))
    assert components.family is FAMILY
    for ours, theirs in ((components.denoiser, expected.denoiser), (components.vae, expected.vae)):
        assert all(
            torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values(), strict=True)
        )


def test_the_step_distilled_pipeline_is_refused_by_name(base, tmp_path):
    """Its transformer is a flow map (it reads the timestep each step jumps to): no family trains it, and detection
    says what the base is."""
    index = json.loads((Path(base) / "modular_model_index.json").read_text())
    index["_class_name"] = Flux3DistilledModularPipeline.__name__
    (tmp_path / "modular_model_index.json").write_text(json.dumps(index))
    with pytest.raises(DifftuneError, match="is a Flux3DistilledModularPipeline; difftune trains"):
        family_of(ModelConfig(base=str(tmp_path)))
