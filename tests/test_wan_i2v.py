"""Wan image-to-video beyond the conformance suite: the first frame's condition made as `WanImageToVideoPipeline`
makes it from the image it animates (bit for bit), clips trained cached as uncached, and what it refuses by name; Wan
2.1's kind, whose transformer also reads CLIP image states: those states as the pipeline's `encode_image` makes them,
trained cached as uncached, drawn by the pipeline with the adapter as difftune draws, and counted in the plan."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline
from PIL import Image
from safetensors.torch import load_file

from difftune.adapters import export
from difftune.config import ModelConfig
from difftune.data.clips import write_clip
from difftune.data.dataset import image_to_tensor
from difftune.families import FAMILIES, load_components
from difftune.families.wan_i2v import micro
from difftune.toy.micro import MicroSizes
from difftune.toy.tiny import render_tensors
from difftune.training.plan import plan_memory
from difftune.training.train import train

FAMILY = FAMILIES["wan_i2v"]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("wan_i2v", seed=2))


@pytest.fixture(scope="module")
def wan21_base(tmp_path_factory):
    """A micro Wan 2.1 image-to-video pipeline folder: a CLIP image encoder and its processor beside Wan's parts."""
    torch.manual_seed(3)
    folder = tmp_path_factory.mktemp("micro-wan21-i2v")
    micro.wan21_pipeline(micro.autoencoder(render_tensors(64, 3)), MicroSizes()).save_pretrained(folder)
    return str(folder)


def _frame() -> Image.Image:
    frame = Image.new("RGB", (32, 32), (30, 160, 220))
    frame.paste((240, 40, 40), (8, 8, 20, 20))
    return frame


def _animated(pipeline, steps: int) -> np.ndarray:
    """`_frame()` animated as "a square moving left", 5 frames from seed 0: what the pipelines are compared by."""
    arguments = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": steps, "output_type": "np"}
    return pipeline(
        image=_frame(), prompt="a square moving left", **arguments, generator=torch.Generator().manual_seed(0)
    ).frames


def _clips(folder):
    folder.mkdir()
    for name in ("left", "right"):
        frames = [Image.new("RGB", (32, 32), (200, 12 * i, 40 if name == "left" else 160)) for i in range(9)]
        write_clip(folder / f"{name}.mkv", frames, lossless=True)
        (folder / f"{name}.txt").write_text(f"a square moving {name}")
    return folder


def _train_on_clips(make_config, base: str, folder, name: str, **overrides):
    """A run of `base` on `_clips(folder / "data")` (5-frame windows, flipped at random), written to `folder / name`:
    its trained file and its logged losses."""
    data = folder / "data" if (folder / "data").is_dir() else _clips(folder / "data")
    trained = train(
        make_config(
            model__base=base,
            data__path=str(data),
            data__target_frames=[5],
            data__frame_extraction="chunk",
            data__random_flip=True,
            cache__dir=str(folder / "cache"),
            train__output_dir=str(folder / name),
            **overrides,
        )
    ).trained_path
    metrics = (folder / name / "metrics.jsonl").read_text().splitlines()
    return trained, [json.loads(line)["loss"] for line in metrics if '"loss"' in line]


def _cached_and_uncached_losses(make_config, base: str, folder, steps: int) -> tuple[list[float], list[float]]:
    return tuple(
        _train_on_clips(
            make_config,
            base,
            folder,
            f"run-{cached}",
            cache__latents=cached,
            cache__text=cached,
            train__max_steps=steps,
        )[1]
        for cached in (False, True)
    )


def test_the_first_frame_is_read_as_the_pipeline_gives_it_the_image(base):
    """The pipeline's `prepare_latents` turns the image into [mask, condition] beside its noise; difftune makes the
    same from the training window's first frame (`pixel_conditioning`, then `denoise`), so the transformer reads the
    same input: equal predictions."""
    components = load_components(ModelConfig(base=base))
    pipeline = WanImageToVideoPipeline.from_pretrained(base, dtype=torch.float32)
    pixels = image_to_tensor(_frame())[None]  # as the pipeline's video processor: [-1, 1]
    noise, condition = pipeline.prepare_latents(
        pixels, 1, 16, 32, 32, 5, torch.float32, "cpu", torch.Generator().manual_seed(0)
    )
    assert condition.shape == (1, 2 + 16, 3, 8, 8)  # the mask's 2 channels (the micro temporal factor), the latents
    clip = torch.cat([pixels[:, :, None], torch.rand(1, 3, 4, 32, 32) * 2 - 1], dim=2)  # later frames do not matter
    with torch.no_grad():
        ours = FAMILY.conditioning.pixel_conditioning(components, clip)["first_frame_latents"]
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
    uncached, cached = _cached_and_uncached_losses(make_config, base, tmp_path, steps=4)
    assert len(uncached) == 4 and cached == pytest.approx(uncached, rel=1e-5)


def test_wan21_reads_the_clip_image_states_the_pipeline_makes(wan21_base):
    """`WanImageToVideoPipeline.encode_image` reads the image it animates through its CLIP processor and encoder; from
    the same frame as a training tensor difftune makes the same states bit for bit, and its prediction with them is
    the transformer's as the pipeline calls it (a wrong or missing image input changes it)."""
    components = load_components(ModelConfig(base=wan21_base))
    assert set(components.pixel_encoders) == {"image_encoder"}
    pipeline = WanImageToVideoPipeline.from_pretrained(wan21_base, dtype=torch.float32)
    frame = _frame()
    clip = torch.cat([image_to_tensor(frame)[None, :, None], torch.rand(1, 3, 4, 32, 32) * 2 - 1], dim=2)
    with torch.no_grad():
        ours = FAMILY.conditioning.pixel_conditioning(components, clip)
        theirs = pipeline.encode_image(frame, "cpu")
        assert ours["image_embeds"].shape == (1, 17, micro.CLIP_WIDTH) and torch.equal(ours["image_embeds"], theirs)
        noise, condition = pipeline.prepare_latents(
            image_to_tensor(frame)[None], 1, 16, 32, 32, 5, torch.float32, "cpu", torch.Generator().manual_seed(0)
        )
        states = torch.randn(1, 512, 64, generator=torch.Generator().manual_seed(1))
        t = torch.tensor([600.0])
        predicted = FAMILY.denoise(components, noise, t, {"encoder_hidden_states": states, **ours}, None)
        expected = pipeline.transformer(
            hidden_states=torch.cat([noise, condition], dim=1),
            timestep=t,
            encoder_hidden_states=states,
            encoder_hidden_states_image=theirs,
            return_dict=False,
        )[0]
        other = FAMILY.denoise(
            components,
            noise,
            t,
            {"encoder_hidden_states": states, **ours, "image_embeds": torch.zeros_like(theirs)},
            None,
        )
    torch.testing.assert_close(predicted, expected, rtol=1e-5, atol=1e-5)
    assert (other - expected).abs().max() > 1e-3


def test_wan21_trains_cached_as_uncached_and_its_adapter_draws_in_the_pipeline(make_config, wan21_base, tmp_path):
    """The CLIP states are cached beside each window's posterior (the image encoder released with the autoencoder):
    the same losses. The adapter covers the image key and value projections too (musubi-tuner's `k_img`, `v_img`), and
    `WanImageToVideoPipeline.load_lora_weights` draws what difftune's adapted pipeline draws from the same image."""
    uncached, cached = _cached_and_uncached_losses(make_config, wan21_base, tmp_path, steps=3)
    assert len(uncached) == 3 and cached == pytest.approx(uncached, rel=1e-5)
    trained, _ = _train_on_clips(
        make_config, wan21_base, tmp_path, "drawn", train__max_steps=3, optim__learning_rate=5e-2
    )
    adapted = {key.removeprefix("transformer.").rsplit(".lora_", 1)[0] for key in load_file(trained)}
    assert {"blocks.0.attn2.add_k_proj", "blocks.1.attn2.add_v_proj"} <= adapted
    kohya = load_file(export.convert_adapter(trained, tmp_path / "kohya.safetensors", "kohya"))
    assert "lora_unet_blocks_0_cross_attn_k_img.lora_down.weight" in kohya

    ours = load_components(ModelConfig(base=wan21_base))
    export.apply_adapters(ours, [(trained, 1.0)])
    theirs = WanImageToVideoPipeline.from_pretrained(wan21_base, dtype=torch.float32)
    theirs.load_lora_weights(str(trained))
    drawn_ours, drawn_theirs = _animated(ours.pipeline(theirs.scheduler), 3), _animated(theirs, 3)
    untrained = _animated(WanImageToVideoPipeline.from_pretrained(wan21_base, dtype=torch.float32), 3)
    assert np.abs(drawn_ours - drawn_theirs).max() * 255 <= 1
    assert np.abs(drawn_ours - untrained).max() * 255 > 1  # the adapter changed what is drawn


def test_latent_entries_of_a_pixel_conditioned_family_are_its_own(wan21_base):
    """Wan 2.2's text-to-video and image-to-video bases share an autoencoder, but an image-to-video entry holds the
    first frame's latents (and Wan 2.1's its CLIP states) too: the cache keys them by the family and its image encoder,
    so neither run reads the other's entries."""
    components = load_components(ModelConfig(base=wan21_base))
    identities = {
        FAMILIES["wan"].conditioning.latent_identity(components),
        FAMILY.conditioning.latent_identity(components),
    }
    with torch.no_grad():
        next(components.pixel_encoders["image_encoder"].parameters()).add_(1)
    identities.add(FAMILY.conditioning.latent_identity(components))
    assert len(identities) == 3


def test_the_plan_counts_the_image_encoder(make_config, wan21_base, tmp_path):
    """The CLIP image encoder loads with the encoders and caches with the autoencoder: the plan's encoders are its
    weights more than those of the same base without it."""
    without = WanImageToVideoPipeline.from_pretrained(wan21_base, dtype=torch.float32)
    encoder = without.image_encoder
    encoder_bytes = sum(t.numel() * t.element_size() for t in (*encoder.parameters(), *encoder.buffers()))
    without.image_encoder = without.image_processor = None
    without.register_modules(image_encoder=None, image_processor=None)
    without.save_pretrained(tmp_path / "without")

    def encoders(base: str) -> int:
        phases = plan_memory(make_config(model__base=base, cache__latents=True, cache__text=True), "cpu").host_phases
        return phases["loading and caching"]["encoders"]

    assert encoders(wan21_base) - encoders(str(tmp_path / "without")) == encoder_bytes


def test_what_it_cannot_draw_is_refused_by_name():
    assert FAMILY.drawing.prompt_control_problems(["a square moving left"]) == [
        "sample.prompts: 'a square moving left' has 0 images; Wan 2.1 / 2.2 image-to-video pipelines "
        "animate one: write it as {prompt = 'a square moving left', controls = [\"first_frame.png\"]}"
    ]


def test_both_wan22_i2v_experts_train_in_one_run_and_draw_in_the_pipeline(make_config, base, tmp_path):
    """Wan 2.2 I2V A14B's kind (two experts switching at 0.9, no image encoder), both experts in one run: a file per
    expert, which `WanImageToVideoPipeline` loads on its two transformers (the low-noise one with
    `load_into_transformer_2=True`) and draws what difftune's pipeline of both draws from the same image."""
    two = tmp_path / "a14b-i2v"
    pipeline = WanImageToVideoPipeline.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(4)
    second = type(pipeline.transformer).from_config(pipeline.transformer.config)
    WanImageToVideoPipeline(**pipeline.components | {"transformer_2": second}, boundary_ratio=0.9).save_pretrained(two)
    _train_on_clips(
        make_config,
        str(two),
        tmp_path,
        "both",
        model__family_options={"expert": "both"},
        train__max_steps=6,
        optim__learning_rate=5e-2,
    )
    high, low = (
        tmp_path / "both" / f"pytorch_lora_weights_{expert}.safetensors" for expert in ("high_noise", "low_noise")
    )
    ours = export.load_with_adapters(str(two), [(high, 1.0), (low, 1.0)])
    theirs = WanImageToVideoPipeline.from_pretrained(two, dtype=torch.float32)
    theirs.load_lora_weights(str(high))
    theirs.load_lora_weights(str(low), load_into_transformer_2=True)
    assert np.abs(_animated(ours.pipeline(theirs.scheduler), 4) - _animated(theirs, 4)).max() * 255 <= 1
    untouched = WanImageToVideoPipeline.from_pretrained(two, dtype=torch.float32)
    config = untouched.transformer.config
    inputs = {
        "hidden_states": torch.randn(1, config.in_channels, 2, 8, 8, generator=torch.Generator().manual_seed(1)),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, 512, config.text_dim, generator=torch.Generator().manual_seed(2)),
        "return_dict": False,
    }
    with torch.no_grad():  # each file moved its own expert
        for part in ("transformer", "transformer_2"):
            moved = getattr(theirs, part)(**inputs)[0] - getattr(untouched, part)(**inputs)[0]
            assert moved.abs().max() > 1e-3, part
