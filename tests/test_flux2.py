"""FLUX.2 [dev] and [klein] beyond the conformance suite: single files in BFL's layout, read back by diffusers' own
single-file reader as the same weights, the guidance each pipeline takes, and references (multi-reference edits): the
transformer fed as the pipelines feed it, their sizes as the pipelines keep them, and edit pairs trained and drawn as
the pipelines draw them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import Flux2Transformer2DModel
from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
from PIL import Image
from safetensors.torch import save_file

from difftune.config import Config, ModelConfig
from difftune.data.dataset import image_to_tensor
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components
from difftune.families.flux2 import LARGEST_REFERENCE
from difftune.models.autoencoders import downsampling, encode_posterior, reference_latents
from difftune.toy.tiny import recolor_pairs
from difftune.training.metrics import read_metrics
from difftune.training.train import train

from conftest import drawn_edit_settings

NAMES = ("flux2", "flux2_klein")


@pytest.fixture(scope="module", params=NAMES)
def base(request, micro_base):
    return request.param, micro_base(request.param, seed=2)


def test_a_single_file_is_bfls_layout_and_diffusers_reads_it_as_the_same_weights(base, tmp_path):
    name, path = base
    components = load_components(ModelConfig(base=str(path)))
    file = tmp_path / "flux-2.safetensors"  # unprefixed, as BFL ships it: diffusers' FLUX.2 converter reads no prefix
    tensors = FAMILIES[name].layout.to_single_file(components)
    save_file(tensors, file)
    assert {
        "double_blocks.0.img_attn.qkv.weight",
        "single_blocks.0.linear1.weight",
        "final_layer.adaLN_modulation.1.weight",
        "double_blocks.0.txt_attn.norm.key_norm.scale",
    } <= set(tensors)
    assert ("guidance_in.in_layer.weight" in tensors) == (name == "flux2")  # [dev] is guidance-distilled
    assert not any(".to_q." in key or "_embedder" in key for key in tensors)
    # difftune reads it back from the same table it wrote it with, ComfyUI's prefix too (diffusers' converter reads
    # none).
    save_file({f"model.diffusion_model.{key}": value for key, value in tensors.items()}, tmp_path / "comfy.safetensors")
    again = load_components(ModelConfig(base=str(tmp_path / "comfy.safetensors"), single_file_config=str(path)))
    assert again.family is FAMILIES[name]
    theirs = Flux2Transformer2DModel.from_single_file(
        str(file), config=str(path), subfolder="transformer", torch_dtype=torch.float32
    )
    ours = components.denoiser.state_dict()
    assert theirs.state_dict().keys() == ours.keys()
    assert all(torch.equal(value, ours[key]) for key, value in theirs.state_dict().items())
    assert all(torch.equal(value, ours[key]) for key, value in again.denoiser.state_dict().items())


def test_dev_takes_the_scale_as_its_guidance_embedding_and_no_negative_prompt(base):
    name, path = base
    family = FAMILIES[name]
    components = load_components(ModelConfig(base=str(path)))
    assert components.denoiser.config.guidance_embeds == (name == "flux2")
    assert family.drawing.sampling_arguments(components, 3.5, "") == {"max_sequence_length": 512, "guidance_scale": 3.5}
    with pytest.raises(DifftuneError, match=r"sample\.negative_prompt: Flux2\w*Pipeline .*leave it empty"):
        family.check_config(Config(model={"base": str(path)}, sample={"negative_prompt": "blurry"}))
    # Training conditions a distilled base on model.family_options.guidance; klein's transformer takes none.
    components.family_options = components.family_options.model_copy(update={"guidance": 3.5})
    guidance = family.guidance(components, 2, "cpu")
    assert (guidance is None) if name == "flux2_klein" else torch.equal(guidance, torch.full((2,), 3.5))


def _last_latents(pipeline, **call) -> torch.Tensor:
    """The packed latents (B, h x w, C) after the pipeline's last step (klein's `output_type="latent"` unpacks them
    and [dev]'s does not: its step callback sees both the same)."""
    last = {}

    def keep(pipeline, step, timestep, tensors):
        last["latents"] = tensors["latents"]
        return tensors

    pipeline(**call, output_type="latent", callback_on_step_end=keep)
    return last["latents"]


def _guided_as_the_pipeline(components, scale: float) -> None:
    """Training's guidance as the pipeline's `guidance_scale`: [dev]'s embedding reads it (klein's ignores it)."""
    components.family_options = components.family_options.model_copy(update={"guidance": scale})


def test_the_transformer_reads_references_as_the_pipelines_image_call(base):
    """One step from sigma 1 to 0 (unguided for klein: scale 1) with two references of different sizes (on the 16 px
    grid and at least 64 px, which the pipelines keep as they are): the pipeline's latents equal the noise less
    difftune's `denoise` of it, the references' latents encoded from difftune's own pixels of them. Without the
    references the prediction differs."""
    name, path = base
    family = FAMILIES[name]
    components = load_components(ModelConfig(base=str(path)))
    _guided_as_the_pipeline(components, 1.0)
    first, second = (control for control, _, _ in recolor_pairs(2, seed=5))
    references = [first.resize((64, 64)), second.resize((96, 64))]
    noise = torch.randn(1, components.denoiser.config.in_channels, 2, 3, generator=torch.Generator().manual_seed(0))
    side = downsampling(components.vae)
    with torch.no_grad():
        drawn = _last_latents(
            components.pipeline(),
            prompt="make it red",
            image=references,
            height=2 * side,
            width=3 * side,
            num_inference_steps=1,
            guidance_scale=1.0,
            max_sequence_length=family.max_sequence_length(components),
            latents=noise,
        )
        conditioning = family.conditioning.encode_prompts(
            components, family.conditioning.tokenize(components.tokenizers, ["make it red"])
        )
        text_alone = dict(conditioning)
        conditioning["control_latents"] = [
            reference_latents(
                encode_posterior(components.vae, image_to_tensor(r)[None])[0], components.latent_normalization
            )
            for r in references
        ]
        velocity = family.denoise(components, noise, torch.tensor([1000.0]), conditioning, None)
        without = family.denoise(components, noise, torch.tensor([1000.0]), text_alone, None)
    torch.testing.assert_close(drawn, (noise - velocity).flatten(2).transpose(1, 2), rtol=0, atol=1e-5)
    assert (velocity - without).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("target", "reference"), [((32, 32), (40, 24)), ((1024, 1024), (3000, 2000)), ((2048, 1536), (900, 1600))]
)
def test_references_train_at_a_size_the_pipelines_keep(target, reference):
    """A reference trains at its target's area, aspect kept, on the 16 px grid, at least 64 px a side and at most the
    pipelines' 1024 x 1024 pixels: what `Flux2ImageProcessor` then neither scales nor crops."""
    width, height = FAMILIES["flux2"].conditioning.control_size(target, reference)
    assert width % 16 == height % 16 == 0 and min(width, height) >= 64
    assert width * height <= LARGEST_REFERENCE
    assert abs(width / height - reference[0] / reference[1]) < 0.2
    if target[0] * target[1] <= LARGEST_REFERENCE // 2:
        assert abs(width * height - max(target[0] * target[1], 64 * 64 * 1.5)) / (width * height) < 0.3
    else:
        assert width * height > 0.9 * LARGEST_REFERENCE  # as large as the pipelines keep
    image = Image.new("RGB", (width, height))
    kept = Flux2ImageProcessor._resize_if_exceeds_area(image, LARGEST_REFERENCE)
    assert kept is image
    Flux2ImageProcessor.check_image_input(image)


def test_pairs_train_and_draw_with_their_reference_as_the_pipeline_does(base, pairs, make_config, tmp_path):
    """Edit pairs beside nothing else: the run's losses are finite and its sample of an instruction with a control is
    what the family's pipeline draws with the trained adapter loaded and the control (sized as difftune trains it)
    as its image."""
    name, path = base
    family = FAMILIES[name]
    settings, control = drawn_edit_settings(path, pairs, tmp_path / "run")
    result = train(make_config(**settings))
    assert all(np.isfinite(row["loss"]) for row in read_metrics(tmp_path / "run") if "loss" in row)
    components = load_components(ModelConfig(base=str(path)))
    pipeline = components.pipeline()
    pipeline.load_lora_weights(str(result.trained_path.parent), weight_name=result.trained_path.name)
    pipeline.scheduler = family.drawing.sampler("auto").from_config(components.noise_scheduler.config)
    reference = Image.open(control).convert("RGB")
    sized = reference.resize(family.conditioning.control_size((32, 32), reference.size))
    assert sized.size == (64, 64)  # the least the pipelines keep as it is

    call = {
        "prompt": "make it purple",
        "height": 32,
        "width": 32,
        "num_inference_steps": 3,
        "guidance_scale": 1.0,
        "max_sequence_length": family.max_sequence_length(components),
    }
    with torch.no_grad():
        theirs = pipeline(**call, image=[sized], generator=torch.Generator().manual_seed(0)).images[0]
        # The reference is read: the latents differ without it (the micro autoencoder's decoder blurs that away).
        with_reference, without = (
            _last_latents(pipeline, **call, **image, generator=torch.Generator().manual_seed(0))
            for image in ({"image": [sized]}, {})
        )
    ours = np.asarray(Image.open(tmp_path / "run" / "samples" / "000.png"), dtype=np.int16)
    assert np.abs(ours - np.asarray(theirs, dtype=np.int16)).max() <= 2
    assert (with_reference - without).abs().max() > 1e-3  # identical calls agree to the bit
