"""Wan image-to-video beyond the conformance suite: the first frame's condition made as `WanImageToVideoPipeline`
makes it from the image it animates (bit for bit), clips trained cached as uncached, and what it refuses by name."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import WanImageToVideoPipeline
from PIL import Image
from transformers import CLIPVisionConfig, CLIPVisionModel

from difftune.config import ModelConfig
from difftune.data.clips import write_clip
from difftune.data.dataset import image_to_tensor
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components
from difftune.training.train import train

FAMILY = FAMILIES["wan_i2v"]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("wan_i2v", seed=2))


def test_the_first_frame_is_read_as_the_pipeline_gives_it_the_image(base):
    """The pipeline's `prepare_latents` turns the image into [mask, condition] beside its noise; difftune makes the
    same from the training window's first frame (`pixel_conditioning`, then `denoise`), so the transformer reads the
    same input: equal predictions."""
    components = load_components(ModelConfig(base=base))
    pipeline = WanImageToVideoPipeline.from_pretrained(base, dtype=torch.float32)
    frame = Image.new("RGB", (32, 32), (30, 160, 220))
    frame.paste((240, 40, 40), (8, 8, 20, 20))
    pixels = image_to_tensor(frame)[None]  # as the pipeline's video processor: [-1, 1]
    noise, condition = pipeline.prepare_latents(
        pixels, 1, 16, 32, 32, 5, torch.float32, "cpu", torch.Generator().manual_seed(0)
    )
    assert condition.shape == (1, 2 + 16, 3, 8, 8)  # the mask's 2 channels (the micro temporal factor), the latents
    clip = torch.cat([pixels[:, :, None], torch.rand(1, 3, 4, 32, 32) * 2 - 1], dim=2)  # later frames do not matter
    with torch.no_grad():
        ours = FAMILY.pixel_conditioning(components, clip)["first_frame_latents"]
        torch.testing.assert_close(components.latent_normalization.apply(ours), condition[:, 2:], rtol=0, atol=1e-6)
        states = torch.randn(1, 512, 64, generator=torch.Generator().manual_seed(1))
        t = torch.tensor([600.0])
        predicted = FAMILY.denoise(
            components, noise, t, {"encoder_hidden_states": states, "first_frame_latents": ours}, None
        )
        theirs = pipeline.transformer(
            hidden_states=torch.cat([noise, condition], dim=1),
            timestep=t,
            encoder_hidden_states=states,
            return_dict=False,
        )[0]
    torch.testing.assert_close(predicted, theirs, rtol=1e-5, atol=1e-5)


def test_clips_train_cached_as_uncached(make_config, base, tmp_path):
    """The first frame's latents are cached beside each window's posterior (flipped with it): the same losses."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("left", "right"):
        frames = [Image.new("RGB", (32, 32), (200, 12 * i, 40 if name == "left" else 160)) for i in range(9)]
        write_clip(data / f"{name}.mkv", frames, lossless=True)
        (data / f"{name}.txt").write_text(f"a square moving {name}")
    losses = {}
    for cached in (False, True):
        run = tmp_path / f"run-{cached}"
        train(
            make_config(
                model__base=base,
                data__path=str(data),
                data__target_frames=[5],
                data__frame_extraction="chunk",
                data__random_flip=True,
                cache__latents=cached,
                cache__text=cached,
                cache__dir=str(tmp_path / "cache"),
                train__max_steps=4,
                train__output_dir=str(run),
            )
        )
        losses[cached] = [
            json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line
        ]
    assert len(losses[False]) == 4 and losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_what_it_cannot_train_or_draw_is_refused_by_name(base, tmp_path):
    pipeline = WanImageToVideoPipeline.from_pretrained(base, dtype=torch.float32)
    with_encoder = WanImageToVideoPipeline(
        **pipeline.components
        | {
            "image_encoder": CLIPVisionModel(
                CLIPVisionConfig(
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    image_size=32,
                    patch_size=16,
                )
            ),
        }
    )
    with_encoder.save_pretrained(tmp_path / "wan21-i2v")
    with pytest.raises(
        DifftuneError, match="a Wan 2.1 image-to-video base: its transformer also reads CLIP image states"
    ):
        load_components(ModelConfig(base=str(tmp_path / "wan21-i2v")))
    assert FAMILY.prompt_control_problems(["a square moving left"]) == [
        "sample.prompts: 'a square moving left' has 0 images; Wan 2.1 / 2.2 image-to-video pipelines "
        "animate one: write it as {prompt = 'a square moving left', controls = [\"first_frame.png\"]}"
    ]
