"""Wan 2.1 beyond the conformance suite: its prediction read as the pipeline's sampler reads it, images trained as
one-frame clips and clips beside them, its schedule's shift, and its original module names against diffusers' readers
of the original
layout (musubi-tuner's `lora_unet_` files, ComfyUI's and other trainers' `diffusion_model.` ones)."""

from __future__ import annotations

import json
import re
from unittest.mock import patch

import av
import numpy as np
import pytest
import torch
from diffusers import UniPCMultistepScheduler, WanPipeline
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers
from peft import LoraConfig
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from difftune.adapters import export
from difftune.adapters.files import module_names_of, placed_on_base, read_adapter
from difftune.config import ModelConfig, SampleConfig, load_config
from difftune.data.clips import write_clip
from difftune.data.dataset import CaptionedImages
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components
from difftune.families.common import drawing as sample
from difftune.families.common.drawing import generate_images, sampling_scheduler, save_images
from difftune.families.wan.micro import wan22_pipeline
from difftune.models.autoencoders import downsampling
from difftune.models.dtypes import run_dtypes
from difftune.training import plan
from difftune.training.train import train
from difftune.webui import jobs

from conftest import REPO

FAMILY = FAMILIES["wan"]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("wan", seed=2))


def test_the_prediction_is_the_velocity_the_pipelines_sampler_reads(base):
    """The pipeline's UniPC (`flow_prediction`) turns the transformer's output v at noise level s into the image
    x - s v: the flow-matching target noise - image is that v (difftune's loss trains it). An image's latents go in as
    a one-frame clip and come out as the clip's frame, the same as the 5-D call."""
    components = load_components(ModelConfig(base=base))
    scheduler = UniPCMultistepScheduler.from_pretrained(base, subfolder="scheduler")  # the pipeline's sampler
    assert components.noise_scheduler.config.shift == scheduler.config.flow_shift == 3.0
    scheduler.set_timesteps(4)
    sigma = float(scheduler.sigmas[1])
    scheduler._step_index = 1
    noisy = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    states = torch.randn(
        2, 512, components.text_encoders["text_encoder"].config.d_model, generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        v = FAMILY.denoise(components, noisy, torch.full((2,), sigma * 1000), {"encoder_hidden_states": states}, None)
        clip = FAMILY.denoise(
            components, noisy[:, :, None], torch.full((2,), sigma * 1000), {"encoder_hidden_states": states}, None
        )
    torch.testing.assert_close(clip[:, :, 0], v)
    x0 = scheduler.convert_model_output(v[:, :, None], sample=noisy[:, :, None])[:, :, 0]
    torch.testing.assert_close(x0, noisy - sigma * v)


def test_original_names_are_diffusers_readers(make_config, base, tmp_path):
    """The kohya file is musubi-tuner's (`lora_unet_blocks_0_self_attn_q`, which diffusers reads: the conformance
    suite renders it); the same tensors under the original model's dotted names after `diffusion_model.` are what
    diffusers' reader of those files maps back to difftune's modules, and difftune reads that file as its own."""
    trained = train(
        make_config(
            model__base=base,
            train__output_dir=str(tmp_path / "run"),
            train__max_steps=2,
            optim__learning_rate=2e-2,
            sample__prompts=[],
        )
    ).trained_path
    ours = load_file(trained)
    components = load_components(ModelConfig(base=base))
    adapted = {key.removeprefix("transformer.").rsplit(".lora_", 1)[0] for key in ours}
    assert len(adapted) == 2 * len(FAMILY.targets.default_targets["transformer"])  # two blocks
    original = {
        f"diffusion_model.{FAMILY.layout.original_name(module)}.lora_{kind}.weight": ours[
            f"transformer.{module}.lora_{kind}.weight"
        ]
        for module in adapted
        for kind in "AB"
    }
    theirs = _convert_non_diffusers_wan_lora_to_diffusers(dict(original))
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[key], ours[key]) for key in ours)
    kohya = load_file(export.convert_adapter(trained, tmp_path / "kohya.safetensors", "kohya"))
    assert {key.rsplit(".", 2)[0] if key.endswith("weight") else key.rsplit(".", 1)[0] for key in kohya} == {
        "lora_unet_" + FAMILY.layout.original_name(module).replace(".", "_") for module in adapted
    }
    save_file(original, tmp_path / "original.safetensors")
    modules = module_names_of(components)
    tensors, _, _ = read_adapter(tmp_path / "original.safetensors", lambda metadata: modules)
    tensors = placed_on_base(tensors, modules, tmp_path / "original.safetensors")  # as `sample` and `merge` place it
    assert tensors.keys() == ours.keys() and all(torch.equal(tensors[key], ours[key]) for key in ours)


def test_a_single_file_has_the_original_checkpoints_names(base):
    """`merge --single-file` writes Wan-AI's names (those of `Wan2.1-T2V-1.3B/diffusion_pytorch_model.safetensors`
    and ComfyUI's `wan2.1_t2v_1.3B_fp16.safetensors`): per block its self- and cross-attention with q/k norms, the
    cross-attention's norm as `norm3`, `ffn.0` / `ffn.2`, `modulation`; the head's `head.head` and `head.modulation`;
    diffusers' reader takes them back (the conformance suite reads the file as the same weights)."""
    keys = set(FAMILY.layout.to_single_file(load_components(ModelConfig(base=base))))
    block = {
        f"blocks.0.{attn}.{layer}.{kind}"
        for attn in ("self_attn", "cross_attn")
        for layer in "qkvo"
        for kind in ("weight", "bias")
    }
    block |= {f"blocks.0.{attn}.{norm}.weight" for attn in ("self_attn", "cross_attn") for norm in ("norm_q", "norm_k")}
    block |= {f"blocks.0.{layer}.{kind}" for layer in ("norm3", "ffn.0", "ffn.2") for kind in ("weight", "bias")}
    block |= {"blocks.0.modulation"}
    outside = {
        f"{layer}.{kind}"
        for layer in (
            "patch_embedding",
            "text_embedding.0",
            "text_embedding.2",
            "time_embedding.0",
            "time_embedding.2",
            "time_projection.1",
            "head.head",
        )
        for kind in ("weight", "bias")
    }
    assert {key for key in keys if not key.startswith("blocks.1.")} == block | outside | {"head.modulation"}


def test_clips_and_images_train_in_one_run_cached_as_uncached(make_config, base, tmp_path):
    """A folder of clips and a still: each clip's windows train as (C, t, h, w) latents beside the image's (C, h, w),
    never in one batch, and the latent and text caches (keyed by each window) change nothing: the losses are the
    same."""
    data = tmp_path / "data"
    data.mkdir()
    for name, count, size in (("left", 12, (40, 32)), ("up", 7, (32, 32))):
        frames = [Image.new("RGB", size, (10 * i, 200 - 10 * i, 90)) for i in range(count)]
        write_clip(data / f"{name}.mkv", frames, lossless=True)
        (data / f"{name}.txt").write_text(f"a square moving {name}")
    Image.new("RGB", (32, 32), (250, 20, 20)).save(data / "still.png")
    (data / "still.txt").write_text("a red square")
    losses, seen = {}, []
    original = CaptionedImages.__getitem__

    def recording(self, key):
        item = original(self, key)
        seen.append(tuple((item.get("latent_mean", item.get("pixel_values"))).shape))
        return item

    for cached in (False, True):
        config = make_config(
            model__base=base,
            data__path=str(data),
            data__target_frames=[5],
            data__frame_extraction="chunk",
            train__batch_size=2,
            train__max_steps=4,
            train__output_dir=str(tmp_path / f"run-{cached}"),
            cache__latents=cached,
            cache__text=cached,
            cache__dir=str(tmp_path / "cache"),
            sample__prompts=[],
        )
        with patch.object(CaptionedImages, "__getitem__", recording):
            train(config)
        metrics = [json.loads(line) for line in (tmp_path / f"run-{cached}" / "metrics.jsonl").read_text().splitlines()]
        losses[cached] = [row["loss"] for row in metrics if "loss" in row]
    # As for images (test_cache.py): equal up to float rounding, the cache having encoded other batches.
    assert len(losses[False]) == 4 and losses[True] == pytest.approx(losses[False], rel=1e-5)
    assert set(seen) == {(3, 5, 32, 32), (3, 32, 32), (16, 3, 8, 8), (16, 8, 8)}  # pixels uncached, posteriors cached


def test_the_memory_plan_is_for_the_longest_clip_window(make_config, base, tmp_path):
    """With clips in the data the plan's training step holds the longest window's latents (9 frames: 5 latent frames
    on the micro autoencoder); with images alone the frame settings change nothing. (The micro transformer is small
    beside its 512 text positions, so a clip's step is a fraction more than an image's, not a multiple; and its
    text encoder's peak, larger, hides the step's in the plan's total: the step's own peak is compared.)"""
    images, clips = tmp_path / "images", tmp_path / "clips"
    for folder in (images, clips):
        folder.mkdir()
        Image.new("RGB", (32, 32)).save(folder / "still.png")
    write_clip(clips / "clip.mkv", [Image.new("RGB", (32, 32), (9 * i, 0, 0)) for i in range(12)], lossless=True)

    def planned(folder, frames):
        config = make_config(model__base=base, data__path=str(folder), data__target_frames=frames)
        return plan._step_peak(plan.empty_components(config), config, torch.float32)[0]

    assert planned(images, [9]) == planned(images, [1])
    image, five, nine = planned(images, [9]), planned(clips, [5]), planned(clips, [9, 5])
    assert image < five < nine and nine - image > 2 * (five - image)


def test_samples_are_clips_written_as_mp4_with_their_prompt(base, tiny_base, tmp_path, monkeypatch):
    """`sample.frames` > 1: WanPipeline's own clip for the prompt and seed (the pipeline called directly gives the same
    frames), written as H.264 MP4 that decodes back within the encoder's loss (measured: luma 1.8 levels on average),
    the prompt and settings in its metadata,
    its first frame in the grid; the job page lists it. Without PyAV: an animated WebP, lossless, the same tags in its
    EXIF description. An image family refuses frames by name."""
    components = load_components(ModelConfig(base=base))
    config = SampleConfig(prompts=["a red square moving left"], frames=5, steps=2, resolution=32, fps=8, seed=3)
    [drawn] = generate_images(components, config, torch.device("cpu"))
    assert len(drawn.clip) == 5 and drawn.image is drawn.clip[0] and drawn.image.size == (32, 32)
    pipeline = components.pipeline(sampling_scheduler("auto", components))
    pipeline.set_progress_bar_config(disable=True)
    theirs = pipeline(
        prompt="a red square moving left",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=7.5,
        generator=torch.Generator().manual_seed(3),
        output_type="np",
    ).frames[0]
    ours = np.stack([np.asarray(frame, dtype=np.float32) for frame in drawn.clip])
    assert np.abs(ours - np.round(theirs * 255)).max() <= 1

    out = tmp_path / "samples"
    [path] = save_images([drawn], config, out)
    assert path == out / "000.mp4"
    with av.open(str(path)) as container:
        assert container.metadata["prompt"] == "a red square moving left"
        assert "seed=3 size=32x32x5 fps=8" in container.metadata["parameters"]
        decoded = np.stack([frame.to_ndarray(format="rgb24").astype(np.float32) for frame in container.decode(video=0)])
    luma = np.array([0.299, 0.587, 0.114], dtype=np.float32)  # H.264 (yuv420p) keeps the luma; the colors at half size
    assert decoded.shape == ours.shape and np.abs(decoded @ luma - ours @ luma).mean() < 3
    assert np.array_equal(np.asarray(Image.open(out / "grid.png")), np.asarray(drawn.image))
    assert set(jobs.preview_grids(jobs.Job(tmp_path))) == {path, out / "grid.png"}

    monkeypatch.setattr(sample, "video_encoder_installed", lambda: False)
    [webp] = save_images([drawn], config, tmp_path / "webp")
    with Image.open(webp) as animated:
        assert webp.suffix == ".webp" and animated.n_frames == 5
        for k in range(5):
            animated.seek(k)
            assert np.array_equal(np.asarray(animated.convert("RGB")), ours[k].astype(np.uint8))
        assert "prompt: a red square moving left" in animated.getexif()[0x010E]

    image_family = load_components(ModelConfig(base=str(tiny_base)))
    with pytest.raises(DifftuneError, match="sample.frames = 5: .* bases draw images; set it to 1"):
        generate_images(image_family, config, torch.device("cpu"))


def test_a_runs_samples_are_clips_and_its_parity_check_compares_every_frame(make_config, base, tmp_path):
    """With `sample.frames`, the base's clips before training, the previews and the end-of-run samples are MP4s beside
    their grids; the reloaded adapter redraws the whole clip, every frame within 0 levels in both layouts."""
    run = tmp_path / "run"
    train(
        make_config(
            model__base=base,
            train__output_dir=str(run),
            train__max_steps=2,
            optim__learning_rate=2e-2,
            sample__prompts=["a square moving left"],
            sample__frames=5,
            sample__steps=2,
            sample__before=True,
            sample__every_steps=1,
        )
    )
    for folder in ("samples", "samples/before", "samples/step-000001"):
        assert (run / folder / "000.mp4").is_file() and (run / folder / "grid.png").is_file()
    with av.open(str(run / "samples" / "000.mp4")) as container:
        assert sum(1 for _ in container.decode(video=0)) == 5
    parity = json.loads((run / "parity.json").read_text())
    assert {layout: result["max_pixel_difference"] for layout, result in parity["layouts"].items()} == {
        "diffusers": 0,
        "kohya": 0,
    }


def _drawn(pipeline) -> np.ndarray:
    """A one-frame clip of "a red square" in 4 steps from seed 0: what the expert tests compare pipelines by."""
    arguments = {"height": 32, "width": 32, "num_frames": 1, "num_inference_steps": 4, "output_type": "np"}
    return pipeline("a red square", **arguments, generator=torch.Generator().manual_seed(0)).frames


@pytest.fixture(scope="module")
def a14b(tmp_path_factory):
    path = tmp_path_factory.mktemp("micro-wan22-a14b")
    wan22_pipeline(seed=2, kind="a14b").save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.mark.parametrize("expert", ["high_noise", "low_noise"])
def test_a_wan22_expert_trains_on_its_side_of_the_boundary_and_loads_where_diffusers_puts_it(
    make_config, a14b, tmp_path, expert
):
    """Wan 2.2 A14B, one expert a run (musubi-tuner's way): every noise level drawn is on the expert's side of the
    pipeline's boundary (0.875: `transformer` at time >= 875, `transformer_2` below), the other expert is never
    changed, validation scores the expert's own timesteps, and diffusers' WanPipeline, given the file as its docs say
    (`load_into_transformer_2=True` for the low-noise one), draws what difftune draws with it."""
    drawn = []
    denoise = FAMILY.denoise

    def recording(components, noisy, timesteps, conditioning, geometry):
        drawn.extend(timesteps.flatten().tolist())
        return denoise(components, noisy, timesteps, conditioning, geometry)

    options = {"expert": expert}
    config = make_config(
        model__base=a14b,
        model__family_options=options,
        train__max_steps=6,
        optim__learning_rate=5e-2,
        train__output_dir=str(tmp_path / "run"),
        sample__prompts=["a red square"],
        sample__steps=4,
        validation__path=str(REPO / "examples" / "purple"),
        validation__every_steps=6,
    )
    with patch.object(FAMILY, "denoise", side_effect=recording, autospec=False):
        trained = train(config).trained_path
    training = drawn[: 6 * 2]  # the steps' (the validation's and the samples' come after)
    low = expert == "low_noise"
    assert training and all((t < 875) == low for t in training), training
    assert all((t < 875) == low for t in drawn if t in (100, 300, 500, 700, 900))  # validation's fixed timesteps

    base = WanPipeline.from_pretrained(a14b, dtype=torch.float32)
    ours = load_components(ModelConfig(base=a14b, family_options=options))
    other = base.transformer if low else base.transformer_2
    export.apply_adapters(ours, [(trained, 1.0)])
    pipeline = ours.pipeline(UniPCMultistepScheduler.from_config(base.scheduler.config))  # the pipeline's own sampler
    untouched = pipeline.transformer if low else pipeline.transformer_2
    assert all(
        torch.equal(a, b) for a, b in zip(untouched.state_dict().values(), other.state_dict().values(), strict=True)
    )
    theirs = WanPipeline.from_pretrained(a14b, dtype=torch.float32)
    theirs.load_lora_weights(str(trained), **({"load_into_transformer_2": True} if low else {}))
    assert np.abs(_drawn(pipeline) - _drawn(theirs)).max() * 255 <= 1
    # `difftune sample` and `merge` put the file on the expert its recorded config names, as diffusers does.
    sampled = export.load_with_adapters(a14b, [(trained, 1.0)])
    assert sampled.family_options.expert == expert
    merged = export.merge_into_folder(a14b, [(trained, 1.0)], tmp_path / "merged")[0]
    merged_pipeline = WanPipeline.from_pretrained(merged, dtype=torch.float32)
    merged_pipeline.scheduler = UniPCMultistepScheduler.from_config(
        base.scheduler.config
    )  # saved with difftune's Euler
    assert np.abs(_drawn(merged_pipeline) - _drawn(theirs)).max() * 255 <= 1
    tensors, metadata = load_file(trained), safe_open(str(trained), "pt").metadata()
    other_expert = metadata["difftune_config"].replace(
        f'expert = "{expert}"', f'expert = "{"high_noise" if low else "low_noise"}"'
    )
    save_file(tensors, tmp_path / "other.safetensors", metadata | {"difftune_config": other_expert})
    # A file of each expert loads on both (`expert = "both"`); files for one transformer and an expert do not.
    both = export.base_for_adapters(a14b, [(trained, 1.0), (tmp_path / "other.safetensors", 1.0)])
    assert both.family_options == {"expert": "both"}
    auto = metadata["difftune_config"].replace(f'expert = "{expert}"', 'expert = "auto"')
    save_file(tensors, tmp_path / "auto.safetensors", metadata | {"difftune_config": auto})
    with pytest.raises(DifftuneError, match="they go on different parts; load them one at a time"):
        export.base_for_adapters(a14b, [(trained, 1.0), (tmp_path / "auto.safetensors", 1.0)])
    trained_expert, before = (
        (pipeline.transformer_2, base.transformer_2) if low else (pipeline.transformer, base.transformer)
    )
    inputs = {
        "hidden_states": torch.randn(1, 16, 1, 8, 8, generator=torch.Generator().manual_seed(1)),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, 512, 64),
        "return_dict": False,
    }
    with torch.no_grad():  # the adapter is on the trained expert
        assert (trained_expert(**inputs)[0] - before(**inputs)[0]).abs().max() > 1e-3


def test_the_other_expert_is_loaded_only_where_the_run_draws_before_its_end(make_config, a14b, tmp_path):
    """Training one expert holds the other (28 GB of bf16 at A14B's size) only where previews draw with it; else it
    is loaded for the end samples alone, and the plan's loading phase leaves it out."""
    configs = {
        previews: make_config(
            model__base=a14b,
            model__family_options={"expert": "low_noise"},
            sample__prompts=["a red square"],
            sample__every_steps=2 if previews else 0,
            train__output_dir=str(tmp_path / "run"),
        )
        for previews in (False, True)
    }
    loaded = {
        previews: load_components(config.model, run_dtypes(config).loaded) for previews, config in configs.items()
    }
    assert loaded[False].drawing_parts["transformer"] is None and loaded[True].drawing_parts["transformer"] is not None
    assert all(
        components.denoiser is not None and components.text_encoders["text_encoder"] is not None
        for components in loaded.values()
    )
    expert = loaded[True].drawing_parts["transformer"]
    other = sum(t.numel() * t.element_size() for t in (*expert.parameters(), *expert.buffers()))
    plans = {previews: plan.plan_memory(config, "cpu").host_phases for previews, config in configs.items()}
    assert plans[True]["loading and caching"]["whole base"] - plans[False]["loading and caching"]["whole base"] == other
    assert plans[False]["end of run samples"]["encoders"] == plans[True]["end of run samples"]["encoders"]


def test_an_expert_needs_a_two_expert_base_and_validation_timesteps_on_its_side(make_config, base, a14b, tmp_path):
    with pytest.raises(DifftuneError, match='expert = "low_noise": this base has one transformer'):
        load_components(ModelConfig(base=base, family_options={"expert": "low_noise"}))
    config = make_config(
        model__base=a14b,
        model__family_options={"expert": "high_noise"},
        train__output_dir=str(tmp_path),
        validation__path=str(REPO / "examples" / "purple"),
        validation__timesteps=[100, 500],
    )
    with pytest.raises(
        DifftuneError, match=r"validation.timesteps \[100, 500\]: none is a noise level this run trains"
    ):
        train(config)


def test_wan22_ti2v_reads_a_time_per_token_over_its_own_patching_autoencoder(make_config, tmp_path):
    """TI2V-5B's kind: its autoencoder patches 2x2 itself (8x on the micro one), its transformer reads a time per latent
    token, as its pipeline passes it (`expand_timesteps`): the prediction equals the pipeline's own call's; clips train
    and the saved adapter redraws what training drew (parity 0 in both layouts)."""
    path = tmp_path / "ti2v"
    wan22_pipeline(seed=3, kind="ti2v").save_pretrained(path, safe_serialization=True)
    components = load_components(ModelConfig(base=str(path)))
    assert components.pipeline_options["expand_timesteps"] and downsampling(components.vae) == 8
    noisy = torch.randn(2, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    states = torch.randn(
        2, 512, components.text_encoders["text_encoder"].config.d_model, generator=torch.Generator().manual_seed(1)
    )
    t = torch.tensor([700.0, 300.0])
    with torch.no_grad():
        ours = FAMILY.denoise(components, noisy, t, {"encoder_hidden_states": states}, None)
        per_token = t[:, None].expand(
            -1, 3 * 2 * 2
        )  # the pipeline's `temp_ts` for a text-to-video call: every token at t
        theirs = components.denoiser(
            hidden_states=noisy, timestep=per_token, encoder_hidden_states=states, return_dict=False
        )[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    data = tmp_path / "data"
    data.mkdir()
    write_clip(
        data / "clip.mkv", [Image.new("RGB", (32, 32), (20 * i, 90, 200 - 20 * i)) for i in range(5)], lossless=True
    )
    (data / "clip.txt").write_text("a square moving left")
    train(
        make_config(
            model__base=str(path),
            data__path=str(data),
            data__target_frames=[5],
            train__max_steps=2,
            train__batch_size=1,
            optim__learning_rate=2e-2,
            train__output_dir=str(tmp_path / "run"),
            sample__prompts=["a square"],
            sample__steps=2,
        )
    )  # one clip: a batch of one
    parity = json.loads((tmp_path / "run" / "parity.json").read_text())
    assert {layout: result["max_pixel_difference"] for layout, result in parity["layouts"].items()} == {
        "diffusers": 0,
        "kohya": 0,
    }


def test_both_wan22_experts_train_in_one_run_and_wan_pipeline_loads_them_on_both_transformers(
    make_config, a14b, tmp_path
):
    """Wan 2.2 A14B, both experts in one run (`expert = "both"`): each batch's noise levels lie on one side of the
    boundary and run on that side's expert, both experts learn, the run writes a file per expert in each layout (each
    recording its expert), its parity check redraws with both files at 0 levels (fp8 weights, a block of each expert
    offloaded), and diffusers' WanPipeline, given the
    high-noise file on `transformer` and the low-noise one with `load_into_transformer_2=True`, draws what difftune
    draws with them; `sample` and `merge` take the two files together."""
    batches = []
    denoise = FAMILY.denoise

    def recording(components, noisy, timesteps, conditioning, geometry):
        batches.append(timesteps.flatten().tolist())
        return denoise(components, noisy, timesteps, conditioning, geometry)

    config = make_config(
        model__base=a14b,
        model__family_options={"expert": "both"},
        model__weight_dtype="fp8",  # the experts' frozen weights as A14B runs keep them, a block of each offloaded
        model__offload_blocks=1,
        train__max_steps=8,
        optim__learning_rate=5e-2,
        train__output_dir=str(tmp_path / "run"),
        sample__prompts=["a red square"],
        sample__steps=4,
        export__average_last=2,
        export__every_steps=4,
    )
    with patch.object(FAMILY, "denoise", side_effect=recording, autospec=False):
        result = train(config)
    training = batches[:8]
    assert all(len({t < 875 for t in batch}) == 1 for batch in training), training  # one expert a step
    assert {batch[0] < 875 for batch in training} == {True, False}, training  # both trained
    run = tmp_path / "run"
    written = {path.name for path in run.glob("*.safetensors")}
    assert written == {  # every file of an expert ends in its name, as ai-toolkit's do
        f"{stem}{variant}{suffix}.safetensors"
        for stem in ("pytorch_lora_weights", "run")
        for suffix in ("_high_noise", "_low_noise")
        for variant in ("", *(("_avg",) if stem == "pytorch_lora_weights" else ()))
    }, written
    assert {path.name for path in (run / "snapshots").iterdir()} == {
        f"step-{step:06d}_{expert}.safetensors" for step in (4, 8) for expert in ("high_noise", "low_noise")
    }
    assert result.trained_path == run / "pytorch_lora_weights_high_noise.safetensors"
    resolved = load_config(run / "config.toml")  # what the UI reads a job's state from
    assert export.result_files(resolved, run) == [
        run / "pytorch_lora_weights_high_noise.safetensors",
        run / "pytorch_lora_weights_low_noise.safetensors",
    ]
    parity = json.loads((run / "parity.json").read_text())
    assert {layout: found["max_pixel_difference"] for layout, found in parity["layouts"].items()} == {
        "diffusers": 0,
        "kohya": 0,
    }
    high, low = (run / f"pytorch_lora_weights_{expert}.safetensors" for expert in ("high_noise", "low_noise"))
    for path, expert in ((high, "high_noise"), (low, "low_noise")):
        metadata = safe_open(str(path), "pt").metadata()
        assert f'expert = "{expert}"' in metadata["difftune_config"]
        assert all(key.startswith("transformer.blocks.") for key in load_file(path))

    base = WanPipeline.from_pretrained(a14b, dtype=torch.float32)
    theirs = WanPipeline.from_pretrained(a14b, dtype=torch.float32)
    theirs.load_lora_weights(str(high))
    theirs.load_lora_weights(str(low), load_into_transformer_2=True)
    inputs = {
        "hidden_states": torch.randn(1, 16, 1, 8, 8, generator=torch.Generator().manual_seed(1)),
        "encoder_hidden_states": torch.randn(1, 512, 64),
        "return_dict": False,
    }
    with torch.no_grad():  # each file moves its own expert
        for part in ("transformer", "transformer_2"):
            time = torch.tensor([500.0])
            assert (
                getattr(theirs, part)(**inputs, timestep=time)[0] - getattr(base, part)(**inputs, timestep=time)[0]
            ).abs().max() > 1e-3
    ours = export.load_with_adapters(a14b, [(high, 1.0), (low, 1.0)])
    assert ours.family_options.expert == "both"
    pipeline = ours.pipeline(UniPCMultistepScheduler.from_config(base.scheduler.config))
    assert np.abs(_drawn(pipeline) - _drawn(theirs)).max() * 255 <= 1
    merged = export.merge_into_folder(a14b, [(high, 1.0), (low, 1.0)], tmp_path / "merged")[0]
    merged_pipeline = WanPipeline.from_pretrained(merged, dtype=torch.float32)
    merged_pipeline.scheduler = UniPCMultistepScheduler.from_config(base.scheduler.config)
    assert np.abs(_drawn(merged_pipeline) - _drawn(theirs)).max() * 255 <= 1


def test_both_experts_route_each_sample_by_its_time_and_take_turns_on_the_device(a14b):
    """The pair runs each sample on the expert its time picks (a mixed batch too: split and put back in order), as
    the pipeline switches at `boundary_ratio`; a move to a device takes the trained weights and the resident
    expert's frozen ones there, and leaves the other's in host memory."""
    from difftune.families.common.wan_experts import WanExperts

    components = load_components(ModelConfig(base=a14b, family_options={"expert": "both"}))
    pair = components.denoiser
    assert isinstance(pair, WanExperts) and components.drawing_parts == {}
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(3, 16, 1, 8, 8, generator=generator),
        "encoder_hidden_states": torch.randn(3, 512, 64, generator=generator),
        "return_dict": False,
    }
    times = torch.tensor([900.0, 100.0, 875.0])  # high, low, high (the pipeline: t >= boundary x 1000)
    with torch.no_grad():
        routed = pair(**inputs, timestep=times)[0]
        for i, expert in enumerate((pair.transformer, pair.transformer_2, pair.transformer)):
            alone = expert(
                **{key: value[i : i + 1] if key != "return_dict" else value for key, value in inputs.items()},
                timestep=times[i : i + 1],
            )[0]
            torch.testing.assert_close(routed[i : i + 1], alone, rtol=1e-5, atol=1e-6)
        assert (pair.transformer(**inputs, timestep=times)[0] - routed).abs().max() > 1e-3  # two experts differ

    pair.transformer_2.add_adapter(LoraConfig(r=2, target_modules=["attn1.to_q"]))
    pair.to("meta")
    waiting = [t for t in (*pair.transformer_2.parameters(), *pair.transformer_2.buffers()) if not t.requires_grad]
    trained = [p for p in pair.transformer_2.parameters() if p.requires_grad]
    assert all(t.is_meta for t in (*pair.transformer.parameters(), *pair.transformer.buffers()))
    assert waiting and all(t.device.type == "cpu" for t in waiting)
    assert trained and all(t.is_meta for t in trained)


def test_the_plan_of_both_experts_holds_one_on_the_device_and_the_other_in_host_memory(make_config, a14b, tmp_path):
    configs = {
        expert: make_config(
            model__base=a14b,
            model__family_options={"expert": expert},
            model__weight_dtype="fp8",
            train__output_dir=str(tmp_path),
        )
        for expert in ("high_noise", "both")
    }
    plans = {expert: plan.plan_memory(config, "cuda") for expert, config in configs.items()}
    one, both = plans["high_noise"], plans["both"]
    assert both.device["frozen denoiser weights"] == one.device["frozen denoiser weights"]
    assert both.device["trained weights"] == 2 * one.device["trained weights"]
    expert = load_components(ModelConfig(base=a14b)).drawing_parts["transformer_2"]
    fp8_weights = sum(
        p.numel() * (1 if p.dim() > 1 else 4) for name, p in expert.named_parameters() if name.endswith(".weight")
    )
    assert both.host_phases["training"]["denoiser parts waiting"] == one.device["frozen denoiser weights"] > 0
    assert both.host_phases["training"]["denoiser parts waiting"] < fp8_weights * 4  # stored, not fp32
    assert (
        "denoiser parts waiting" not in one.host_phases["training"]
        or not one.host_phases["training"]["denoiser parts waiting"]
    )


def test_both_experts_refuse_what_cannot_take_turns(make_config, a14b, tmp_path):
    for override, message in (
        ({"model__quantize": "int8"}, 'model.quantize = "int8" with both experts'),
        ({"model__base": str(tmp_path / "wan22.safetensors")}, "a single file holds one expert"),
    ):
        config = make_config(
            **{"model__base": a14b, **override},
            model__family_options={"expert": "both"},
            train__output_dir=str(tmp_path),
        )
        with pytest.raises(DifftuneError, match=re.escape(message)):
            FAMILY.check_config(config)
