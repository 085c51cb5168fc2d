"""SDXL through the family interface: detection, conditioning, micro-conditioning, training, export, interop."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, StableDiffusionXLPipeline
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from difftune import export
from difftune.cli import main
from difftune.config import DataConfig, ModelConfig
from difftune.data import CaptionedImages, sample_seed, scan_examples, training_sizes
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, family_of, load_components
from difftune.models import place_frozen
from difftune.tiny import build_taesd
from difftune.train import train

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
    config = DataConfig(path=str(_tall_image_folder(tmp_path)), resolution=32, buckets=True, bucket_step=8,
                        bucket_min_side=16, bucket_max_side=64, crop="random", random_flip=True)
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
        resized = Image.open(examples[0].image_path).convert("RGB").resize((21, 48), Image.Resampling.BICUBIC)
        window = resized.crop((left, 0, left + 16, 48))
        if flipped:
            window = window.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        expected_pixels = torch.from_numpy(np.asarray(window, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1
        torch.testing.assert_close(item["pixel_values"], expected_pixels)
        seen_flips.add(flipped)
    assert seen_flips == {True, False}


def test_cached_views_carry_the_center_crop_time_ids(tmp_path):
    config = DataConfig(path=str(_tall_image_folder(tmp_path)), resolution=32, buckets=True, bucket_step=8,
                        bucket_min_side=16, bucket_max_side=64, random_flip=True)
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
    with pytest.raises(DifftuneError, match=r"model\.family = \"sd\": model\.base .* is a StableDiffusionXLPipeline of the sdxl"):
        family_of(ModelConfig(base=str(tiny_sdxl_base), family="sd"))
    with pytest.raises(DifftuneError, match=r"model\.family = \"sdxl\": model\.base .*\.safetensors is a single file of the sd"):
        family_of(ModelConfig(base=str(sd_file), family="sdxl"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "model_index.json").write_text('{"_class_name": "KandinskyPipeline"}')
    with pytest.raises(DifftuneError, match=r"is a KandinskyPipeline; difftune trains .*Stable Diffusion XL"):
        family_of(ModelConfig(base=str(tmp_path / "other")))
    assert family_of(ModelConfig(base=str(tmp_path / "other"), family="sd")).name == "sd"
    save_file({"x": torch.zeros(1)}, tmp_path / "odd.safetensors")
    with pytest.raises(DifftuneError, match="keys match no known family"):
        family_of(ModelConfig(base=str(tmp_path / "odd.safetensors")))


def test_prompt_conditioning_is_what_the_sdxl_pipeline_makes(tiny_sdxl_base):
    components = load_components(ModelConfig(base=str(tiny_sdxl_base)))
    pipeline = components.pipeline()
    prompts = ["a red circle", "a blue square"]
    with torch.no_grad():
        states, _, pooled, _ = pipeline.encode_prompt(prompts, device="cpu", do_classifier_free_guidance=False)
        ours = SDXL.encode_prompts(components, SDXL.tokenize(components.tokenizers, prompts))
    assert ours["encoder_hidden_states"].shape == (2, 32, 64 + 96)
    torch.testing.assert_close(ours["encoder_hidden_states"], states, rtol=0, atol=0)
    torch.testing.assert_close(ours["pooled_prompt_embeds"], pooled, rtol=0, atol=0)


def _trained(make_config, tiny_sdxl_base, tmp_path, kind, **overrides):
    config = make_config(
        model__base=str(tiny_sdxl_base), adapter__kind=kind, adapter__text_encoder=True, train__max_steps=4,
        optim__learning_rate=2e-2, train__output_dir=str(tmp_path / kind), **overrides,
    )
    return train(config)


def _render(pipeline, prompt="a purple circle") -> np.ndarray:
    """One image with a fixed seed and sampler (a merged folder is saved with DDIM, a base keeps its own)."""
    pipeline.scheduler = DDIMScheduler.from_config(pipeline.scheduler.config)
    pipeline.set_progress_bar_config(disable=True)
    image = pipeline(prompt, num_inference_steps=4, guidance_scale=3.0, height=32, width=32,
                     generator=torch.Generator().manual_seed(0), output_type="np").images[0]
    return image


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_sdxl_adapter_loads_in_diffusers_and_matches_our_merged_model(make_config, tiny_sdxl_base, tmp_path, kind):
    """Trained on both text encoders and the UNet: diffusers' own `load_lora_weights` renders what our merged
    model renders, and what difftune's in-training pipeline drew (parity.json)."""
    result = _trained(make_config, tiny_sdxl_base, tmp_path, kind, sample__prompts=["a purple circle"], sample__steps=4,
                      sample__guidance_scale=3.0)
    with safe_open(result.trained_path, framework="pt") as handle:
        parts = {key.split(".")[0] for key in handle.keys()}
    assert parts == {"unet", "text_encoder", "text_encoder_2"}
    parity = json.loads((result.trained_path.parent / "parity.json").read_text())
    assert all(layout["max_pixel_difference"] <= 2 for layout in parity["layouts"].values()), parity

    theirs = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_base, dtype=torch.float32)
    theirs.load_lora_weights(str(result.trained_path.parent), weight_name=result.trained_path.name)
    merged_dir = tmp_path / "merged"
    export.merge_into_folder(str(tiny_sdxl_base), [(result.trained_path, 1.0)], merged_dir)
    merged = StableDiffusionXLPipeline.from_pretrained(merged_dir, dtype=torch.float32)
    base = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_base, dtype=torch.float32)
    ours, loaded, untouched = _render(merged), _render(theirs), _render(base)
    assert np.abs(ours - loaded).max() < 2e-3
    assert np.abs(ours - untouched).max() > 0.05  # the adapter changes the image
    # `difftune sample` (the UI's Sample tab runs the same code) redraws the in-training sample.
    assert main(["sample", "--base", str(tiny_sdxl_base), "--adapter", str(result.trained_path), "--prompt",
                 "a purple circle", "--steps", "4", "--guidance-scale", "3.0", "--resolution", "32",
                 "--out", str(tmp_path / "cli")]) == 0
    drawn = np.asarray(Image.open(tmp_path / "cli" / "000.png"), dtype=np.int16)
    in_training = np.asarray(Image.open(result.trained_path.parent / "samples" / "000.png"), dtype=np.int16)
    assert np.abs(drawn - in_training).max() <= 2


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
    folder, single = export.merge_into_folder(str(tiny_sdxl_base), [(result.trained_path, 1.0)], tmp_path / "m", single_file=True)
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
    loaded = sum("lora_A" in k for part in ("unet", "text_encoder", "text_encoder_2") for k in getattr(theirs, part).state_dict())
    assert loaded == sum(key.endswith("lora_down.weight") for key in load_file(kohya))
    assert np.abs(_render(theirs) - _render(from_folder)).max() < 2e-3


def test_taesd_encodes_for_training_and_decodes_samples(make_config, tiny_sdxl_base, tmp_path):
    build_taesd().save_pretrained(tmp_path / "taesdxl")
    result = _trained(make_config, tiny_sdxl_base, tmp_path, "lora", model__vae=str(tmp_path / "taesdxl"),
                      sample__decoder=str(tmp_path / "taesdxl"), sample__prompts=["a red circle"], sample__steps=2,
                      sample__parity=False)
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


def test_cached_latents_and_text_train_exactly_as_encoding_each_step(make_config, tiny_sdxl_base, tmp_path):
    """The text cache holds SDXL's whole conditioning (both encoders' states and the pooled embedding), the latent
    cache both views with their time ids: cached and uncached runs give the same losses."""
    settings = {"model__base": str(tiny_sdxl_base), "data__random_flip": True, "train__max_steps": 3}
    plain = train(make_config(train__output_dir=str(tmp_path / "plain"), **settings))
    cached = train(make_config(train__output_dir=str(tmp_path / "cached"), cache__latents=True, cache__text=True,
                               cache__dir=str(tmp_path / "cache"), **settings))
    assert cached.components.text_encoders == {"text_encoder": None, "text_encoder_2": None}  # released
    entry = next((tmp_path / "cache" / "text").rglob("*.safetensors"))
    assert set(load_file(entry)) == {"encoder_hidden_states", "pooled_prompt_embeds"}
    assert cached.losses == pytest.approx(plain.losses, rel=1e-5)


def test_every_family_module_is_registered_and_complete():
    """A family is one module in difftune/families/: found by its file name, accepted as `model.family`, and
    naming everything the rest of difftune asks of it for each of its parts."""
    from difftune.config import FAMILY_NAMES

    modules = {p.stem for p in (Path(__file__).parents[1] / "difftune" / "families").glob("*.py")} - {"__init__", "family"}
    assert set(FAMILIES) == set(FAMILY_NAMES) == modules
    for name, family in FAMILIES.items():
        ModelConfig(family=name)  # accepted by the schema
        assert set(family.kohya_prefixes) == set(family.parts()) == set(family.default_targets), name
        assert len(set(family.kohya_prefixes.values())) == len(family.parts()), name
        assert len(family.text_encoder_names) == len(family.tokenizer_names), name
        assert family.pipeline_class.__name__ in family.pipeline_classes, name
