"""Kandinsky 5 against its own pipelines beyond the conformance suite: the constants they hold, the transformer fed as
their loops feed it, captions of different lengths in one batch, samples at the size asked, and the video models
trained on clips."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import Kandinsky5T2VPipeline

from difftune.config import ModelConfig
from difftune.data.clips import write_clip
from difftune.families import FAMILIES, load_components
from difftune.families import kandinsky5_video as video
from difftune.families.kandinsky5 import PROMPT_TEMPLATE, TEMPLATE_TOKENS
from difftune.toy.tiny import moving_shape_clips
from difftune.training.train import train

FAMILY = FAMILIES["kandinsky5"]


def geometry(height: int, width: int, batch: int = 1) -> torch.Tensor:
    """`data.image_geometry` of uncropped images of this size."""
    return torch.tensor([[height, width, 0, 0, height, width]] * batch)


@pytest.fixture(scope="module")
def components(micro_base):
    return load_components(ModelConfig(base=str(micro_base("kandinsky5"))))


@pytest.fixture(scope="module")
def video_base(micro_base):
    return str(micro_base("kandinsky5_video"))


def test_the_constants_are_the_pipelines(components, video_base):
    pipeline = components.pipeline()
    assert PROMPT_TEMPLATE == pipeline.prompt_template
    assert TEMPLATE_TOKENS == pipeline.prompt_template_encode_start_idx
    video_pipeline = load_components(ModelConfig(base=video_base)).pipeline()
    assert video.PROMPT_TEMPLATE == video_pipeline.prompt_template
    assert video.TEMPLATE_TOKENS == video_pipeline.prompt_template_encode_start_idx
    family = FAMILIES["kandinsky5_video"]
    for size in ((480, 854), (512, 768), (1024, 1024), (32, 32)):
        assert family.rope_scale(*size) == video_pipeline._get_scale_factor(*size)


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
        conditioning = FAMILY.conditioning.encode_prompts(
            components, FAMILY.conditioning.tokenize(components.tokenizers, ["a red circle"])
        )
        velocity = FAMILY.denoise(components, noise, torch.tensor([1000.0]), conditioning, geometry(32, 48))
    torch.testing.assert_close(drawn[:, 0].permute(0, 3, 1, 2), noise - velocity, rtol=0, atol=1e-5)


def test_captions_of_different_lengths_denoise_in_one_batch_as_each_alone(components):
    """The transformer reads a caption's states without a mask: a batch of captions of two lengths gives each sample
    what it gets alone, at its own length."""
    captions = ["a red circle", "a blue square on the left of a green triangle"]
    noisy = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(1))
    timesteps = torch.tensor([300.0, 700.0])
    with torch.no_grad():
        conditioning = FAMILY.conditioning.encode_prompts(
            components, FAMILY.conditioning.tokenize(components.tokenizers, captions)
        )
        lengths = conditioning["text_mask"].sum(dim=1)
        assert lengths[0] < lengths[1]
        together = FAMILY.denoise(components, noisy, timesteps, conditioning, geometry(32, 32, 2))
        for i in range(2):
            alone = FAMILY.denoise(
                components,
                noisy[i : i + 1],
                timesteps[i : i + 1],
                {k: v[i : i + 1] for k, v in conditioning.items()},
                geometry(32, 32),
            )
            torch.testing.assert_close(together[i : i + 1], alone, rtol=0, atol=1e-6)


def test_samples_are_drawn_at_the_size_asked(components):
    """The pipeline snaps a size to the nearest of its own seven (48 x 32 would be drawn at 1408 x 640)."""
    images = FAMILY.drawing.draw(
        components.pipeline(), None, "a red circle", [], 32, 48, num_inference_steps=1, guidance_scale=1.0
    )
    assert images[0].size == (48, 32)


def test_the_video_transformer_is_fed_as_the_pipelines_loop_feeds_it(video_base):
    """As for images, over a 5-frame clip (2 latent frames), with the empty conditioning clip the Lite transformers
    read beside the noisy one."""
    components = load_components(ModelConfig(base=video_base))
    family = components.family
    pipeline = components.pipeline()
    pipeline.set_progress_bar_config(disable=True)
    noise = torch.randn(1, 16, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    empty = torch.zeros(1, 2, 8, 8, 17)  # the conditioning clip and its mask, as the pipeline appends them
    with torch.no_grad():
        drawn = pipeline(
            prompt="a red circle moving left",
            height=32,
            width=32,
            num_frames=5,
            num_inference_steps=1,
            guidance_scale=1.0,
            latents=torch.cat([noise.permute(0, 2, 3, 4, 1), empty], dim=-1),
            output_type="latent",
        ).frames
        captions = ["a red circle moving left"]
        conditioning = family.conditioning.encode_prompts(
            components, family.conditioning.tokenize(components.tokenizers, captions)
        )
        velocity = family.denoise(components, noise, torch.tensor([1000.0]), conditioning, geometry(32, 32))
    assert isinstance(pipeline, Kandinsky5T2VPipeline)
    torch.testing.assert_close(drawn[..., :16].permute(0, 4, 1, 2, 3), noise - velocity, rtol=0, atol=1e-5)


def test_the_video_models_train_on_clips_and_their_files_redraw_every_frame(make_config, video_base, tmp_path):
    """Clips of 5 frames train beside the sampled clips before and after; the adapter reloaded through
    `Kandinsky5T2VPipeline` redraws the whole clip exactly in both layouts."""
    data = tmp_path / "clips"
    data.mkdir()
    for i, (frames, caption) in enumerate(moving_shape_clips(4, seed=0)):
        write_clip(data / f"{i}.mkv", frames, lossless=True)
        (data / f"{i}.txt").write_text(caption)
    run = tmp_path / "run"
    train(
        make_config(
            model__base=video_base,
            data__path=str(data),
            data__target_frames=[5],
            train__output_dir=str(run),
            train__max_steps=2,
            optim__learning_rate=2e-2,
            sample__prompts=["a red circle moving left"],
            sample__frames=5,
            sample__steps=2,
            sample__before=True,
        )
    )
    assert (run / "samples" / "000.mp4").is_file() and (run / "samples" / "before" / "000.mp4").is_file()
    parity = json.loads((run / "parity.json").read_text())
    assert {layout: result["max_pixel_difference"] for layout, result in parity["layouts"].items()} == {
        "diffusers": 0,
        "kohya": 0,
    }
