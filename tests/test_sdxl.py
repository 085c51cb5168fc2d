"""SDXL through the family interface: detection, conditioning, micro-conditioning, training, export, interop."""

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, StableDiffusionXLPipeline
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from difftune.adapters import export
from difftune.config import DataConfig, ModelConfig
from difftune.data.dataset import CaptionedImages, sample_seed, scan_examples, training_sizes
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, family_of, load_components
from difftune.models.components import place_frozen
from difftune.toy.tiny import build_taesd
from difftune.training.train import train

SDXL = FAMILIES["sdxl"]


def _tall_image_folder(tmp_path: Path) -> Path:
    """One 40x90 image (left half red, right half blue) with a caption."""
    folder = tmp_path / "tall"
    folder.mkdir()
    image = Image.new("RGB", (40, 90), (220, 40, 40))
    image.paste((40, 80, 220), (20, 0, 40, 90))
    image.save(folder / "0.png")
    (folder / "0.txt").write_text("a tall image")
    return folder


def test_time_ids_of_a_flipped_randomly_cropped_bucketed_image(tmp_path):
    """By hand: a 40x90 image, resolution 32 with buckets of step 8 in [16, 64] -> bucket 16x48 (aspect 1/3 is the
    closest to 0.44). Scale max(16/40, 48/90) = 0.533 -> resized 21x48: the crop's left is in [0, 5], its top 0.
    Time ids: original (90, 40), crop (top 0, left), target (48, 16); a flip makes the left 21 - left - 16."""
    config = DataConfig(
        path=str(_tall_image_folder(tmp_path)),
        resolution=32,
        buckets=True,
        bucket_step=8,
        bucket_min_side=16,
        bucket_max_side=64,
        crop="random",
        random_flip=True,
    )
    examples, _ = scan_examples(config)
    assert training_sizes(examples, config) == [(16, 48)]
    dataset = CaptionedImages(examples, config, lambda captions: {}, train_seed=5)
    seen_flips = set()
    for epoch in range(12):
        rng = random.Random(sample_seed(5, epoch, 0))  # the sample's own draws, in the dataset's order
        left, top, flipped = rng.randint(0, 5), rng.randint(0, 0), rng.random() < 0.5
        item = dataset[(epoch, 0)]
        expected_left = 21 - left - 16 if flipped else left
        assert item["geometry"].tolist() == [90, 40, top, expected_left, 48, 16], (epoch, left, flipped)
        # The pixels agree: the crop's right edge is at x = left + 16 of the 21 px wide resize.
        resized = Image.open(examples[0].path).convert("RGB").resize((21, 48), Image.Resampling.BICUBIC)
        window = resized.crop((left, 0, left + 16, 48))
        if flipped:
            window = window.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        expected_pixels = torch.from_numpy(np.asarray(window, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1
        torch.testing.assert_close(item["pixel_values"], expected_pixels)
        seen_flips.add(flipped)
    assert seen_flips == {True, False}


def test_cached_views_carry_the_center_crop_time_ids(tmp_path):
    config = DataConfig(
        path=str(_tall_image_folder(tmp_path)),
        resolution=32,
        buckets=True,
        bucket_step=8,
        bucket_min_side=16,
        bucket_max_side=64,
        random_flip=True,
    )
    examples, _ = scan_examples(config)
    entries = [{"plain": tmp_path / "p.safetensors", "flipped": tmp_path / "f.safetensors"}]
    for path in entries[0].values():
        save_file({"mean": torch.zeros(4, 12, 4), "std": torch.zeros(4, 12, 4)}, path)
    dataset = CaptionedImages(examples, config, lambda captions: {}, train_seed=0, latent_entries=entries)
    geometries = {tuple(dataset[(epoch, 0)]["geometry"].tolist()) for epoch in range(12)}
    # Center crop of the 21 px resize: left 5 // 2 = 2; mirrored: 21 - 2 - 16 = 3.
    assert geometries == {(90, 40, 0, 2, 48, 16), (90, 40, 0, 3, 48, 16)}


def test_family_detection(tiny_base, tiny_sdxl_base, tmp_path):
    assert family_of(ModelConfig(base=str(tiny_base))).name == "sd"
    assert family_of(ModelConfig(base=str(tiny_sdxl_base))).name == "sdxl"
    merged = export.merge_into_folder(str(tiny_sdxl_base), [], tmp_path / "merged", single_file=True)[1]
    assert family_of(ModelConfig(base=str(merged))).name == "sdxl"
    sd_file = export.merge_into_folder(str(tiny_base), [], tmp_path / "sd", single_file=True)[1]
    assert family_of(ModelConfig(base=str(sd_file))).name == "sd"
    # The config's word wins for a pipeline class no family reads, never against the family that reads it.
    with pytest.raises(
        DifftuneError, match=r"model\.family = \"sd\": model\.base .* is a StableDiffusionXLPipeline of the sdxl"
    ):
        family_of(ModelConfig(base=str(tiny_sdxl_base), family="sd"))
    with pytest.raises(
        DifftuneError, match=r"model\.family = \"sdxl\": model\.base .*\.safetensors is a single file of the sd"
    ):
        family_of(ModelConfig(base=str(sd_file), family="sdxl"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "model_index.json").write_text('{"_class_name": "KandinskyPipeline"}')
    with pytest.raises(DifftuneError, match=r"is a KandinskyPipeline; difftune trains .*Stable Diffusion XL"):
        family_of(ModelConfig(base=str(tmp_path / "other")))
    assert family_of(ModelConfig(base=str(tmp_path / "other"), family="sd")).name == "sd"
    save_file({"x": torch.zeros(1)}, tmp_path / "odd.safetensors")
    with pytest.raises(DifftuneError, match="keys match no known family"):
        family_of(ModelConfig(base=str(tmp_path / "odd.safetensors")))


def _trained(make_config, tiny_sdxl_base, tmp_path, kind, **overrides):
    config = make_config(
        model__base=str(tiny_sdxl_base),
        adapter__kind=kind,
        adapter__text_encoder=True,
        train__max_steps=4,
        optim__learning_rate=2e-2,
        train__output_dir=str(tmp_path / kind),
        **overrides,
    )
    return train(config)


def _render(pipeline, prompt="a purple circle") -> np.ndarray:
    """One image with a fixed seed and sampler (a merged folder is saved with DDIM, a base keeps its own)."""
    pipeline.scheduler = DDIMScheduler.from_config(pipeline.scheduler.config)
    pipeline.set_progress_bar_config(disable=True)
    image = pipeline(
        prompt,
        num_inference_steps=4,
        guidance_scale=3.0,
        height=32,
        width=32,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images[0]
    return image


def test_kohya_round_trip_is_bit_identical_with_te1_and_te2_names(make_config, tiny_sdxl_base, tmp_path):
    result = _trained(make_config, tiny_sdxl_base, tmp_path, "dora")
    kohya = export.convert_adapter(result.trained_path, tmp_path / "kohya.safetensors", "kohya")
    back = export.convert_adapter(kohya, tmp_path / "back.safetensors", "diffusers")
    written = load_file(kohya)
    prefixes = {key.split("_")[1] for key in written}
    assert prefixes == {"unet", "te1", "te2"}
    # The text encoders' paths start `text_model_`, as A1111 and ComfyUI map them (transformers 5 included).
    assert all(key.startswith(("lora_unet_", "lora_te1_text_model_", "lora_te2_text_model_")) for key in written)
    assert any(key.endswith(".dora_scale") for key in written) and any(key.endswith(".alpha") for key in written)
    with safe_open(kohya, framework="pt") as handle:
        assert handle.metadata()["ss_base_model_version"] == "sdxl_base_v1-0"
    original, again = load_file(result.trained_path), load_file(back)
    assert original.keys() == again.keys()
    assert all(torch.equal(original[key], again[key]) for key in original)


def test_merge_into_an_sdxl_single_file_that_from_single_file_loads(make_config, tiny_sdxl_base, tmp_path):
    result = _trained(make_config, tiny_sdxl_base, tmp_path, "lora")
    folder, single = export.merge_into_folder(
        str(tiny_sdxl_base), [(result.trained_path, 1.0)], tmp_path / "m", single_file=True
    )
    with safe_open(single, framework="pt") as handle:
        keys = set(handle.keys())
    assert "conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight" in keys
    assert any(key.startswith("conditioner.embedders.0.transformer.text_model.encoder.") for key in keys)
    assert "model.diffusion_model.label_emb.0.0.weight" in keys
    from_file = StableDiffusionXLPipeline.from_single_file(str(single), config=str(folder), dtype=torch.float32)
    from_folder = StableDiffusionXLPipeline.from_pretrained(folder, dtype=torch.float32)
    for part in ("unet", "vae", "text_encoder", "text_encoder_2"):
        a, b = getattr(from_file, part).state_dict(), getattr(from_folder, part).state_dict()
        assert a.keys() == b.keys(), part
        assert all(torch.equal(a[key], b[key]) for key in b), part
    # ...and difftune trains from that file.
    components = load_components(ModelConfig(base=str(single), single_file_config=str(folder)))
    assert components.family is SDXL and set(components.text_encoders) == {"text_encoder", "text_encoder_2"}
    # diffusers' own kohya reader (what A1111-style SDXL files go through) places every te1/te2/unet key and
    # renders the merged model's image.
    kohya = export.convert_adapter(result.trained_path, tmp_path / "kohya.safetensors", "kohya")
    theirs = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_base, dtype=torch.float32)
    theirs.load_lora_weights(str(tmp_path), weight_name=kohya.name)
    loaded = sum(
        "lora_A" in k for part in ("unet", "text_encoder", "text_encoder_2") for k in getattr(theirs, part).state_dict()
    )
    assert loaded == sum(key.endswith("lora_down.weight") for key in load_file(kohya))
    assert np.abs(_render(theirs) - _render(from_folder)).max() < 2e-3


def test_taesd_encodes_for_training_and_decodes_samples(make_config, tiny_sdxl_base, tmp_path):
    build_taesd().save_pretrained(tmp_path / "taesdxl")
    result = _trained(
        make_config,
        tiny_sdxl_base,
        tmp_path,
        "lora",
        model__vae=str(tmp_path / "taesdxl"),
        sample__decoder=str(tmp_path / "taesdxl"),
        sample__prompts=["a red circle"],
        sample__steps=2,
        sample__parity=False,
    )
    assert type(result.components.vae).__name__ == "AutoencoderTiny"
    assert (result.trained_path.parent / "samples" / "000.png").is_file()


def test_the_vae_stays_fp32_under_fp16_unless_it_is_fp16_safe(tiny_sdxl_base, tmp_path):
    components = load_components(ModelConfig(base=str(tiny_sdxl_base)))
    place_frozen(components, torch.device("cpu"), torch.float16)
    assert components.vae.dtype == torch.float32 and components.denoiser.dtype == torch.float16
    components.vae.register_to_config(force_upcast=False)  # what an fp16-fixed VAE's config says
    place_frozen(components, torch.device("cpu"), torch.float16)
    assert components.vae.dtype == torch.float16
    build_taesd().save_pretrained(tmp_path / "taesd")
    tiny = load_components(ModelConfig(base=str(tiny_sdxl_base), vae=str(tmp_path / "taesd")))
    place_frozen(tiny, torch.device("cpu"), torch.float16)
    assert tiny.vae.dtype == torch.float16
