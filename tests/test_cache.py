"""Latent and text caches: the same run, faster; invalidated by content, never stale."""

from functools import partial

import pytest
import torch
from PIL import Image

from difftune.config import load_config
from difftune.data.cache import fill_latents, latent_entries, model_identity
from difftune.data.dataset import scan_examples, training_sizes
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components
from difftune.toy.tiny import build_vae
from difftune.training.metrics import read_metrics
from difftune.training.train import train


def _losses(path):
    return [row["loss"] for row in read_metrics(path)]


@pytest.mark.parametrize("flip", [False, True])
def test_a_cached_run_trains_like_an_uncached_one(make_config, tmp_path, flip):
    common = {
        "train__max_steps": 4,
        "data__random_flip": flip,
        "data__caption_dropout": 0.5,
        "cache__dir": str(tmp_path / "cache"),
    }
    plain = train(make_config(train__output_dir=str(tmp_path / "plain"), **common))
    cached = train(
        make_config(train__output_dir=str(tmp_path / "cached"), cache__latents=True, cache__text=True, **common)
    )
    assert _losses(tmp_path / "cached") == pytest.approx(_losses(tmp_path / "plain"), rel=1e-5)
    assert plain.losses[0] == pytest.approx(cached.losses[0], rel=1e-6)
    assert any((tmp_path / "cache" / "latents").rglob("*.safetensors"))
    assert any((tmp_path / "cache" / "text").rglob("*.safetensors"))
    # Nothing needed the encoders during the run, so they were released.
    assert cached.components.vae is None and cached.components.text_encoders == {"text_encoder": None}


def test_a_warm_cache_encodes_nothing_and_changes_invalidate(make_config, tmp_path, shapes):
    images = tmp_path / "images"
    images.mkdir()
    for path in shapes.iterdir():
        (images / path.name).write_bytes(path.read_bytes())
    config = make_config(data__path=str(images), cache__latents=True, cache__dir=str(tmp_path / "cache"))
    components = load_components(config.model)
    examples, _ = scan_examples(config.data)
    sizes = training_sizes(examples, config.data)
    identity = model_identity(components.vae)
    entries = latent_entries(examples, sizes, identity, config)
    assert fill_latents([e.path for e in examples], sizes, entries, components.vae, config, 4) == 8
    assert (
        fill_latents(
            [e.path for e in examples],
            sizes,
            latent_entries(examples, sizes, identity, config),
            components.vae,
            config,
            4,
        )
        == 0
    )

    Image.new("RGB", (32, 32), (1, 2, 3)).save(images / "0003.png")  # one image changes
    changed = latent_entries(examples, sizes, identity, config)
    assert [a["plain"] != b["plain"] for a, b in zip(entries, changed, strict=True)] == [
        e.path.name == "0003.png" for e in examples
    ]
    assert fill_latents([e.path for e in examples], sizes, changed, components.vae, config, 4) == 1

    torch.manual_seed(123)
    other_vae = build_vae(scaling_factor=components.vae.config.scaling_factor)  # another VAE: everything misses
    other = latent_entries(examples, sizes, model_identity(other_vae), config)
    assert not {e["plain"] for e in other} & {e["plain"] for e in changed}
    assert fill_latents([e.path for e in examples], sizes, other, other_vae, config, 4) == 8


def _filled_latent_cache(make_config, tmp_path):
    """The shapes folder's latents cached: (config, components, examples, sizes, cache entries)."""
    config = make_config(cache__latents=True, cache__dir=str(tmp_path / "cache"))
    components = load_components(config.model)
    examples, _ = scan_examples(config.data)
    sizes = training_sizes(examples, config.data)
    entries = latent_entries(examples, sizes, model_identity(components.vae), config)
    fill_latents([e.path for e in examples], sizes, entries, components.vae, config, 3)
    return config, components, examples, sizes, entries


def test_a_cached_latent_is_the_posterior_of_its_image(make_config, tmp_path):
    from safetensors.torch import load_file

    from difftune.data.dataset import image_to_tensor, open_image, resize_and_crop
    from difftune.models.autoencoders import encode_posterior

    config, components, examples, sizes, entries = _filled_latent_cache(make_config, tmp_path)
    image = resize_and_crop(open_image(examples[0].path, config.data), (32, 32), "center")
    with torch.no_grad():
        mean, std = encode_posterior(components.vae, image_to_tensor(image)[None])
    entry = load_file(entries[0]["plain"])
    torch.testing.assert_close(entry["mean"], mean[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entry["std"], std[0], rtol=1e-5, atol=1e-6)


def test_entries_read_once_stay_in_ram_up_to_the_budget(make_config, tmp_path):
    from difftune.data.dataset import CaptionedImages

    config, components, examples, sizes, entries = _filled_latent_cache(make_config, tmp_path)
    entry_bytes = 2 * 4 * 8 * 8 * 4  # mean and std, (4, 8, 8) float32
    keys = [(0, index) for index in range(len(examples))]
    tokenize = partial(components.family.conditioning.tokenize, components.tokenizers)
    from_disk = CaptionedImages(examples, config.data, tokenize, 0, entries, sizes=sizes)
    in_ram = CaptionedImages(examples, config.data, tokenize, 0, entries, sizes=sizes, memory_bytes=3 * entry_bytes)
    expected, first_read = [from_disk[key] for key in keys], [in_ram[key] for key in keys]
    for entry in entries:
        entry["plain"].unlink()
    served = []
    for key in keys:  # the first three entries are kept; the rest must be read again, and are gone
        if key[1] < 3:
            served.append(in_ram[key])
        else:
            with pytest.raises(FileNotFoundError):
                in_ram[key]
    for want, got in zip(expected + expected[:3], first_read + served, strict=True):  # served: the first three
        torch.testing.assert_close(got["latent_mean"], want["latent_mean"], rtol=0, atol=0)
        torch.testing.assert_close(got["token_ids"], want["token_ids"], rtol=0, atol=0)


@pytest.mark.parametrize("first_flip", [False, True])
def test_a_cache_made_under_other_flip_settings_is_completed_not_misread(make_config, tmp_path, first_flip):
    """The same cache.dir, flips toggled between runs (either order): the second run encodes the views it lacks
    and trains exactly like an uncached run with its own settings."""
    cache = {"cache__latents": True, "cache__dir": str(tmp_path / "cache"), "train__max_steps": 4}
    train(make_config(train__output_dir=str(tmp_path / "first"), data__random_flip=first_flip, **cache))
    views_after_first = len(list((tmp_path / "cache" / "latents").rglob("*.safetensors")))
    train(make_config(train__output_dir=str(tmp_path / "second"), data__random_flip=not first_flip, **cache))
    train(make_config(train__output_dir=str(tmp_path / "plain"), data__random_flip=not first_flip, train__max_steps=4))
    assert _losses(tmp_path / "second") == pytest.approx(_losses(tmp_path / "plain"), rel=1e-5)
    # 8 images: the plain views once, the mirrored ones once, whichever run wrote them.
    assert views_after_first == (16 if first_flip else 8)
    assert len(list((tmp_path / "cache" / "latents").rglob("*.safetensors"))) == 16


def test_alpha_background_is_part_of_a_latent_entry(make_config, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for i in range(4):
        rgba = Image.new("RGBA", (32, 32), (0, 0, 0, 0))
        rgba.paste((200, 40 * i, 60, 255), (8, 8, 24, 24))
        rgba.save(images / f"{i}.png")
        (images / f"{i}.txt").write_text("a square")
    common = {"data__path": str(images), "train__max_steps": 3, "cache__dir": str(tmp_path / "cache")}
    for color, background in (("white", "[255, 255, 255]"), ("black", "[0, 0, 0]")):
        for cached in (True, False):
            out = tmp_path / f"{color}-{'cached' if cached else 'plain'}"
            train(
                make_config(
                    train__output_dir=str(out), cache__latents=cached, data__alpha_background=background, **common
                )
            )
        assert _losses(tmp_path / f"{color}-cached") == pytest.approx(_losses(tmp_path / f"{color}-plain"), rel=1e-5)
    assert _losses(tmp_path / "white-cached") != pytest.approx(_losses(tmp_path / "black-cached"), rel=1e-3)
    assert len(list((tmp_path / "cache" / "latents").rglob("*.safetensors"))) == 8


def test_text_entries_follow_the_token_ids(make_config, tmp_path):
    from difftune.data.cache import text_entries
    from difftune.data.dataset import Prompt
    from difftune.toy.tiny import build_tokenizer

    config = make_config(cache__text=True, cache__dir=str(tmp_path / "cache"))
    tokenizer = build_tokenizer()
    tokenize = partial(FAMILIES["sd"].conditioning.tokenize, {"tokenizer": tokenizer})
    prompt = Prompt("a red circle")
    full = text_entries({prompt}, "encoder", config, tokenize)
    tokenizer.model_max_length = 4  # a shorter context: other ids, another entry
    short = text_entries({prompt}, "encoder", config, tokenize)
    assert full[prompt] != short[prompt]
    assert text_entries({prompt}, "other encoder", config, tokenize)[prompt] != short[prompt]


def test_cache_settings_that_cannot_work_are_refused():
    with pytest.raises(DifftuneError, match=r"cache\.latents needs data\.crop = \"center\""):
        load_config(None, ["cache.latents=true", "data.crop=random"])
    with pytest.raises(DifftuneError, match=r"cache\.text needs adapter\.text_encoder = false"):
        load_config(None, ["cache.text=true", "adapter.text_encoder=true"])


def test_caches_are_on_by_default_where_the_settings_allow():
    defaults = load_config(None, [])
    assert (defaults.cache.latents, defaults.cache.text) == ("on", "on")
    # A random crop has no single cached view; a trained text encoder's outputs change: those stay uncached.
    assert load_config(None, ["data.crop=random"]).cache.latents == "off"
    assert load_config(None, ["adapter.text_encoder=true"]).cache.text == "off"
    # Files written when the switches were booleans still read.
    old = load_config(None, ["cache.latents=false", "cache.text=true"])
    assert (old.cache.latents, old.cache.text) == ("off", "on")


def test_a_default_run_caches_and_trains_without_its_encoders(make_config, tmp_path):
    """`auto` resolves in the run's saved config, the caches are written, and with nothing to preview the VAE and
    the text encoder leave memory for the whole run (the result's components come back without them)."""
    config = make_config(
        cache__latents="auto", cache__text="auto", cache__dir=str(tmp_path / "cache"), train__max_steps=2
    )
    result = train(config)
    saved = load_config(tmp_path / "run" / "config.toml")
    assert (saved.cache.latents, saved.cache.text) == ("on", "on")
    assert any((tmp_path / "cache" / "latents").rglob("*.safetensors"))
    assert any((tmp_path / "cache" / "text").rglob("*.safetensors"))
    assert result.components.vae is None
    assert all(encoder is None for encoder in result.components.text_encoders.values())


def test_released_encoders_come_back_for_the_final_samples(make_config, tmp_path):
    config = make_config(
        cache__latents=True,
        cache__text=True,
        cache__dir=str(tmp_path / "cache"),
        train__max_steps=2,
        sample__prompts=["a red circle"],
        sample__steps=2,
    )
    result = train(config)
    assert (tmp_path / "run" / "samples" / "000.png").is_file()
    assert result.components.vae is not None and result.components.text_encoders["text_encoder"] is not None


def test_buckets_train_cached_and_uncached_alike(make_config, tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for i, size in enumerate([(32, 32), (48, 24), (24, 48), (50, 26), (30, 30), (26, 52)]):
        Image.new("RGB", size, (40 * i, 100, 200 - 30 * i)).save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(f"shape {i}")
    common = {
        "data__path": str(images),
        "data__buckets": True,
        "data__bucket_step": 8,
        "data__bucket_min_side": 16,
        "data__bucket_max_side": 64,
        "train__max_steps": 4,
        "cache__dir": str(tmp_path / "cache"),
    }
    train(make_config(train__output_dir=str(tmp_path / "plain"), **common))
    train(make_config(train__output_dir=str(tmp_path / "cached"), cache__latents=True, **common))
    assert _losses(tmp_path / "cached") == pytest.approx(_losses(tmp_path / "plain"), rel=1e-5)
