"""Qwen-Image-Layered against its own pipeline beyond the conformance suite: the prompt template, the transformer called
on the image and its layers as `QwenImageLayeredPipeline` calls it, the noise levels its scheduler draws, an RGBA image
encoded as the pipeline encodes the image it splits; and its data: layers found beside each image (musubi-tuner's
layout), their transparency kept, a sample without layers refused."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from PIL import Image

from difftune.config import DataConfig, ModelConfig, PromptWithControls, SampleConfig, load_config
from difftune.data.dataset import CaptionedImages, scan_examples
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components
from difftune.families.common.drawing import generate_images, save_images
from difftune.families.common.flow import shifted
from difftune.families.common.tokens import pack, unpack
from difftune.families.qwen_image import PROMPT_TEMPLATE, TEMPLATE_TOKENS
from difftune.families.qwen_image_layered import layered_shift
from difftune.models.autoencoders import encode_posterior
from difftune.toy.tiny import layered_shapes, write_layered_folder
from difftune.training.metrics import read_metrics
from difftune.training.train import train
from difftune.training.validation import Validator

FAMILY = FAMILIES["qwen_image_layered"]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("qwen_image_layered"))


@pytest.fixture
def layered(tmp_path) -> Path:
    write_layered_folder(tmp_path / "layered", layered_shapes(3, seed=0))
    return tmp_path / "layered"


def test_the_prompt_template_is_the_pipelines(base):
    pipeline = load_components(ModelConfig(base=base)).pipeline()
    assert (pipeline.prompt_template_encode, pipeline.prompt_template_encode_start_idx) == (
        PROMPT_TEMPLATE,
        TEMPLATE_TOKENS,
    )


def test_layers_are_found_beside_each_image_and_a_bare_image_is_reported(layered):
    """`0000.png` with `0000_1.png`, `0000_2.png`: one example whose controls are its layers, in order; an image without
    layers, or with a gap in their numbers, is left out and named."""
    Image.new("RGBA", (32, 32)).save(layered / "bare.png")
    (layered / "bare.txt").write_text("a bare image", encoding="utf-8")
    (layered / "0002_2.png").rename(layered / "0002_3.png")  # a gap: _1, _3
    examples, bad = scan_examples(DataConfig(path=str(layered)), layers=True)
    assert [(e.path.name, [c.name for c in e.control_paths]) for e in examples] == [
        ("0000.png", ["0000_1.png", "0000_2.png"]),
        ("0001.png", ["0001_1.png", "0001_2.png"]),
    ]
    assert {b.path.name: "without gaps" in b.reason for b in bad} == {"0002.png": True, "bare.png": True}
    # Read by a text-to-image family, the layers would be uncaptioned images of their own.
    with pytest.raises(DifftuneError, match="0000_1.png has no caption file"):
        scan_examples(DataConfig(path=str(layered)))


def test_a_metadata_file_lists_the_layers_and_a_sample_without_them_is_refused(tmp_path):
    folder = tmp_path / "listed"
    write_layered_folder(folder, layered_shapes(2, seed=0))
    lines = [
        {"file_name": "0000.png", "text": "a red circle", "control_files": ["0000_1.png", "0000_2.png"]},
        {"file_name": "0001.png", "text": "a red square"},
    ]
    (folder / "metadata.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    examples, _ = scan_examples(DataConfig(path=str(folder)), layers=True)
    assert [c.name for c in examples[0].control_paths] == ["0000_1.png", "0000_2.png"]
    with pytest.raises(DifftuneError, match="0001.png has no layers"):
        FAMILY.conditioning.check_controls(examples, "data.path")


def test_the_layers_keep_their_transparency(layered):
    """Read by the family's data settings, the image and its layers are RGBA: the shape layer is transparent (alpha
    -1 in [-1, 1]) where the background layer is opaque; composited instead, they would all be opaque."""
    data = FAMILY.conditioning.data_settings(DataConfig(path=str(layered), resolution=32))
    assert data.keep_alpha
    examples, _ = scan_examples(data, layers=True)
    dataset = CaptionedImages(
        examples, data, lambda captions: {}, 0, control_sizes=[((32, 32), (32, 32))] * len(examples)
    )
    item = dataset[(0, 0)]
    image, (background, shape) = item["pixel_values"], item["control_pixels"]
    assert image.shape == background.shape == shape.shape == (4, 32, 32)
    assert (image[3] == 1).all() and (background[3] == 1).all()
    assert (shape[3] == -1).float().mean() > 0.3 and (shape[3] == 1).any()
    composited = CaptionedImages(
        examples, data.model_copy(update={"keep_alpha": False}), lambda captions: {}, 0, control_sizes=[((32, 32),) * 2]
    )
    assert composited[(0, 0)]["control_pixels"][1].shape == (3, 32, 32)


def test_an_rgba_image_is_encoded_as_the_pipeline_encodes_the_image_it_splits(base):
    components = load_components(ModelConfig(base=base))
    pipeline = components.pipeline()
    [image, *_], _ = layered_shapes(1, seed=1)[0]
    pixels = pipeline.image_processor.preprocess(image, 32, 32)
    assert pixels.shape[1] == 4
    with torch.no_grad():
        theirs = pipeline._encode_vae_image(pixels[:, :, None], generator=None)[:, :, 0]
        ours = components.latent_normalization.apply(encode_posterior(components.vae, pixels)[0])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_the_transformer_is_called_on_the_image_and_its_layers_as_the_pipeline_calls_it(base):
    """A step of `QwenImageLayeredPipeline` (2 layers, 32 px) with the transformer's call recorded: difftune's
    `denoise` of the same noisy stack, condition and text predicts what the pipeline's transformer predicted for the
    stack (the condition's tokens dropped), token for token."""
    components = load_components(ModelConfig(base=base))
    pipeline = components.pipeline()
    pipeline.set_progress_bar_config(disable=True)
    calls = []
    forward = pipeline.transformer.forward

    def recorded(**arguments):
        output = forward(**arguments)
        calls.append((arguments, output[0]))
        return output

    pipeline.transformer.forward = recorded
    [image, *_], caption = layered_shapes(1, seed=2)[0]
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_layered as module

    original = module.calculate_dimensions
    module.calculate_dimensions = lambda area, ratio: (32, 32)
    try:
        pipeline(image=image, prompt=caption, layers=2, resolution=640, num_inference_steps=2, output_type="np")
    finally:
        module.calculate_dimensions = original
    (arguments, theirs), _ = calls  # its first step (one step alone: its terminal stretch divides by zero)
    h = w = 8  # 32 px at 4x
    tokens = (h // 2) * (w // 2)
    hidden = arguments["hidden_states"]
    noisy = torch.stack([unpack(part, h, w) for part in hidden[:, : 3 * tokens].split(tokens, dim=1)], dim=2)
    with torch.no_grad():
        conditioning = FAMILY.conditioning.encode_prompts(
            components, FAMILY.conditioning.tokenize(components.tokenizers, [caption])
        )
        conditioning["image_latents"] = unpack(hidden[:, 3 * tokens :], h, w)
        ours = FAMILY.denoise(components, noisy, arguments["timestep"] * 1000, conditioning, None)
    packed = torch.cat([pack(frame) for frame in ours.unbind(2)], dim=1)
    torch.testing.assert_close(packed, theirs[:, : 3 * tokens], rtol=0, atol=1e-5)
    assert arguments["img_shapes"] == [[(1, 4, 4)] * 4]  # the image, 2 layers, the condition


def test_training_draws_the_noise_levels_its_scheduler_samples(base):
    """The pipeline asks its scheduler for mu = sqrt(image tokens / 256) under its exponential time shift: training's
    shift (`layered_shift`, counted on the image alone, not the stack) gives the same sigmas."""
    config = load_components(ModelConfig(base=base)).noise_scheduler.config
    # Its sampling sigmas are stretched to end at `shift_terminal`; training's are not, at any base's.
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config, shift_terminal=None)
    sigmas = np.linspace(1.0, 0, 11)[:-1]
    image_tokens = (640 // 16) ** 2
    scheduler.set_timesteps(sigmas=sigmas, mu=math.sqrt(image_tokens / 256))
    ours = shifted(torch.tensor(sigmas), layered_shift(None, image_tokens))
    torch.testing.assert_close(scheduler.sigmas[:-1].double(), ours, rtol=1e-5, atol=1e-6)
    stack = torch.zeros(1, 16, 5, 80, 80)  # 4 layers and the image, at 640 px
    assert FAMILY.image_tokens(stack) == image_tokens


def test_a_run_trains_the_stack_and_validates_it_as_it_trains(base, layered, make_config, tmp_path):
    """A run on layered images records the alpha it kept in its resolved config; its validation set is read as its
    data is (layers beside each image, RGBA) and scored on the stacks (the image and its 2 layers); the loop's
    validation loss is the Validator's."""
    config = make_config(
        model__base=base,
        data__path=str(layered),
        validation__path=str(layered),
        validation__timesteps=[500],
        train__max_steps=2,
        sample__prompts=[],
    )
    result = train(config)
    resolved = load_config(result.trained_path.parent / "config.toml")
    assert resolved.data.keep_alpha and not config.data.keep_alpha
    validator = Validator(result.components, resolved, torch.device("cpu"))
    [group] = validator.groups
    assert group["latents"].shape[2] == 3 and group["from_pixels"]["image_latents"].dim() == 4
    assert read_metrics(result.trained_path.parent)[-1]["val_loss"] == pytest.approx(
        validator.loss(result.components), rel=1e-6
    )


def test_a_sample_is_its_layers_side_by_side_and_the_grid_shows_them_over_white(base, tmp_path):
    """`model.family_options.layers` layers of the named image, drawn at its size, in one RGBA PNG (their alpha kept);
    the grid shows the image at its own aspect beside them, transparency over white."""
    components = load_components(ModelConfig(base=base, family_options={"layers": 3}))
    [image, *_], caption = layered_shapes(1, seed=4)[0]
    image.save(tmp_path / "image.png")
    config = SampleConfig(
        prompts=[PromptWithControls(prompt=caption, controls=[str(tmp_path / "image.png")])], steps=2, resolution=32
    )
    [sample] = generate_images(components, config, torch.device("cpu"))
    assert sample.image.mode == "RGBA" and sample.image.size == (3 * 32, 32)
    assert sample.controls[0].size == (32, 32)
    save_images([sample], config, tmp_path / "samples")
    assert Image.open(tmp_path / "samples" / "000.png").mode == "RGBA"
    grid = np.asarray(Image.open(tmp_path / "samples" / "grid.png").convert("RGB"), dtype=np.float32)
    layers = np.asarray(sample.image, dtype=np.float32)
    shown = grid[-64:, -3 * 64 :][::2, ::2] / 255  # the layers' panel under its label, scaled up 2x (nearest)
    alpha = layers[..., 3:] / 255
    over_white = (layers[..., :3] * alpha + 255 * (1 - alpha)) / 255
    np.testing.assert_allclose(shown, over_white, atol=2 / 255)


def test_a_sample_prompt_without_the_image_to_split_is_refused_before_any_work(base, make_config):
    config = make_config(model__base=base, sample__prompts=["a red circle"])
    with pytest.raises(DifftuneError, match=r"pipelines split one: write it as \{prompt = 'a red circle', controls"):
        FAMILY.check_config(config)
