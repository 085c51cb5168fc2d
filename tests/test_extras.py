"""What users of other trainers expect on top: LoRA+, rsLoRA, PiSSA/OLoRA, Prodigy, schedule-free AdamW."""

import json

import pytest
import torch
from safetensors.torch import load_file

from difftune.adapters import export
from difftune.adapters.trained import adapter_state_dict, add_adapters
from difftune.config import ModelConfig, OptimConfig, load_config
from difftune.errors import DifftuneError
from difftune.families import load_components
from difftune.training.metrics import read_metrics
from difftune.training.optim import build_optimizer
from difftune.training.train import train

from conftest import unet_inputs

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]


def _overrides(settings: dict) -> list[str]:
    """`section.key=value` overrides; text fields take their text as it is."""
    return [f"{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in settings.items()]


def _adapted(tiny_base, **adapter):
    """The tiny base with an adapter on the UNet and text encoder, moved away from its start at random."""
    config = load_config(
        None,
        [
            f"model.base={tiny_base}",
            "adapter.rank=4",
            "adapter.alpha=8",
            "adapter.text_encoder=true",
            f"adapter.target_modules={json.dumps(ATTENTION)}",
            *_overrides({f"adapter.{key}": value for key, value in adapter.items()}),
        ],
    )
    components = load_components(config.model)
    add_adapters(components, config.adapter)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in (components.denoiser, components.text_encoders["text_encoder"]):
            for name, param in module.named_parameters():
                if "lora_" in name:
                    param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    return components, config


def _outputs(components):
    latents, timesteps, states = unet_inputs(components.denoiser)
    ids = components.tokenizers["tokenizer"](["a red circle"], padding="max_length", return_tensors="pt").input_ids
    with torch.no_grad():
        return components.denoiser(latents, timesteps, states).sample, components.text_encoders["text_encoder"](ids)[0]


@pytest.mark.parametrize("layout", ["diffusers", "kohya"])
@pytest.mark.parametrize(
    "adapter", [{"rank_stabilized": True}, {"init": "pissa"}, {"init": "olora", "rank_stabilized": True}]
)
def test_rslora_and_pissa_files_reproduce_the_adapted_model_on_the_untouched_base(tiny_base, tmp_path, layout, adapter):
    """rsLoRA's scale reaches both layouts (kohya's through alpha); a PiSSA/OLoRA adapter, trained on a base with its
    principal part taken out, is saved as the change from its start: on the untouched base it gives the same model."""
    adapted, config = _adapted(tiny_base, **adapter)
    tensors, lora_configs = adapter_state_dict(adapted, config.adapter)
    path = export.write_adapter(tmp_path / "a.safetensors", tensors, lora_configs, config.to_toml(), layout)
    loaded = load_components(ModelConfig(base=str(tiny_base)))
    export.apply_adapters(loaded, [(path, 1.0)])
    for ours, theirs in zip(_outputs(adapted), _outputs(loaded), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    untouched = _outputs(load_components(ModelConfig(base=str(tiny_base))))
    assert (untouched[0] - _outputs(loaded)[0]).abs().max() > 1e-3
    if "init" in adapter:  # twice the rank, and nothing that would run PiSSA again in a loader
        assert lora_configs["unet.r"] == 8 and lora_configs["unet.init_lora_weights"] is True
        assert tensors["unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight"].shape[0] == 8


def test_pissa_starts_at_the_base_model(tiny_base):
    """Before training, the residual base plus the principal adapter is the base (what makes PiSSA a LoRA init)."""
    components, config = _adapted(tiny_base)  # gaussian, moved: a control that does change the outputs
    base = load_components(ModelConfig(base=str(tiny_base)))
    pissa = load_components(ModelConfig(base=str(tiny_base)))
    add_adapters(pissa, load_config(None, [f"model.base={tiny_base}", "adapter.init=pissa", "adapter.rank=4"]).adapter)
    torch.testing.assert_close(_outputs(pissa)[0], _outputs(base)[0], rtol=1e-4, atol=1e-4)
    q = pissa.denoiser.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q
    assert q.lora_B["default"].weight.abs().max() > 0  # not the zero start of a plain LoRA
    assert not torch.allclose(
        q.base_layer.weight, base.denoiser.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q.weight
    )


def test_loraplus_steps_b_at_its_ratio():
    named = {
        "unet.a.lora_A.default.weight": torch.nn.Parameter(torch.ones(2, 4)),
        "unet.a.lora_B.default.weight": torch.nn.Parameter(torch.ones(4, 2)),
        "unet.a.lora_magnitude_vector.default.weight": torch.nn.Parameter(torch.ones(4)),
        "text_encoder.b.lora_A.default.weight": torch.nn.Parameter(torch.ones(2, 4)),
        "text_encoder.b.lora_B.default.weight": torch.nn.Parameter(torch.ones(4, 2)),
    }
    config = OptimConfig(learning_rate=1e-3, text_encoder_learning_rate=1e-4, loraplus_ratio=16)
    optimizer = build_optimizer(named, ("text_encoder",), config, torch.device("cpu"), lr_scale=2.0)
    groups = [(group["lr"], {id(p) for p in group["params"]}) for group in optimizer.param_groups]
    ids = {name: id(param) for name, param in named.items()}
    assert groups == [
        (pytest.approx(2e-3), {ids["unet.a.lora_A.default.weight"]}),
        (
            pytest.approx(32e-3),
            {ids["unet.a.lora_B.default.weight"], ids["unet.a.lora_magnitude_vector.default.weight"]},
        ),
        (pytest.approx(2e-4), {ids["text_encoder.b.lora_A.default.weight"]}),
        (pytest.approx(32e-4), {ids["text_encoder.b.lora_B.default.weight"]}),
    ]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"optim.optimizer": "adamw_schedule_free", "optim.lr_schedule": "cosine"}, "replaces the schedule"),
        ({"optim.optimizer": "adamw_schedule_free", "ema.enabled": True}, "an average already"),
        ({"optim.optimizer": "prodigy", "optim.text_encoder_learning_rate": 0.5}, "one step size for all parameters"),
        ({"optim.loraplus_ratio": 16, "adapter.kind": "none"}, "has none: set it to 0"),
        ({"adapter.init": "pissa", "adapter.kind": "dora"}, 'needs init = "gaussian"'),
        ({"adapter.init": "olora", "model.quantize": "int8"}, "use one or the other"),
        ({"validation.early_stop_patience": 3}, "validation.early_stop_patience needs validation.path"),
        ({"adapter.kind": "loha", "adapter.rank_stabilized": True}, "has no such scale in peft"),
        ({"data.masks": "folder"}, "needs data.mask_path"),
        ({"prior.num_class_images": 4}, "needs prior.class_prompt"),
        ({"prior.class_path": "x", "adapter.kind": "embedding"}, "changes no model weights"),
    ],
)
def test_settings_that_do_not_mix_are_refused(settings, message):
    with pytest.raises(DifftuneError, match=message):
        load_config(None, _overrides(settings))


def test_schedule_free_saves_its_averaged_weights_and_resumes_exactly(make_config, tmp_path):
    """What schedule-free AdamW saves and validates is its average x, not the point y its gradients are taken at;
    checkpoints keep y and the optimizer state, so a resumed run ends where an uninterrupted one does."""
    pytest.importorskip("schedulefree")
    settings = {
        "optim__optimizer": "adamw_schedule_free",
        "optim__warmup_steps": 2,
        "checkpoint__every_steps": 2,
        "validation__path": make_config().data.path,
        "validation__every_steps": 2,
        "train__max_steps": 4,
    }
    whole = train(make_config(train__output_dir=str(tmp_path / "whole"), **settings))
    saved = load_file(whole.trained_path)
    tensors, _ = adapter_state_dict(whole.components, whole_config := make_config(**settings).adapter)
    assert all(torch.equal(saved[key], value) for key, value in tensors.items())  # finish left the average in place
    whole.optimizer.train()  # back to y: not what was saved
    at_y, _ = adapter_state_dict(whole.components, whole_config)
    assert max((saved[key] - value).abs().max().item() for key, value in at_y.items()) > 1e-6

    train(make_config(train__output_dir=str(tmp_path / "parts"), **{**settings, "train__max_steps": 2}))
    resumed = train(make_config(train__output_dir=str(tmp_path / "parts"), **settings), resume="auto")
    assert [r["loss"] for r in read_metrics(tmp_path / "parts")] == [
        r["loss"] for r in read_metrics(tmp_path / "whole")
    ]
    assert [r.get("val_loss") for r in read_metrics(tmp_path / "parts")] == [
        r.get("val_loss") for r in read_metrics(tmp_path / "whole")
    ]
    assert all(torch.equal(value, load_file(resumed.trained_path)[key]) for key, value in saved.items())


def test_prodigy_trains(make_config):
    pytest.importorskip("prodigyopt")
    result = train(make_config(optim__optimizer="prodigy", optim__learning_rate=1.0, train__max_steps=20))
    d = result.optimizer.param_groups[0]["d"]
    assert d > 1.5e-6  # it raised its step size from d0 = 1e-6 (2.1e-6 after 20 steps here)
    assert all(torch.isfinite(t).all() for t in load_file(result.trained_path).values())


def _scripted_validation(monkeypatch, losses_by_step: dict[int, float]):
    """The validation loss as a function of the step, so which validation is best is known in advance."""
    from difftune.training import validation

    calls = []

    def loss(self, components):
        calls.append(None)
        return losses_by_step[len(calls)]

    monkeypatch.setattr(validation.Validator, "loss", loss)


def test_the_lowest_validation_loss_is_kept_as_best(make_config, tmp_path, shapes):
    """`_best` is the adapter of the step with the lowest validation loss: the snapshot of that step, bit for bit."""
    run = train(
        make_config(
            validation__path=str(shapes),
            validation__every_steps=1,
            train__max_steps=5,
            export__every_steps=1,
            optim__learning_rate=1e-2,
        )
    )
    rows = read_metrics(tmp_path / "run")
    best_step = min(rows, key=lambda row: row["val_loss"])["step"]
    best = json.loads((tmp_path / "run" / "best.json").read_text())
    assert best["records"]["val_loss"] == {
        "step": best_step,
        "value": min(r["val_loss"] for r in rows),
        "file": "pytorch_lora_weights_best.safetensors",
    }
    kept = load_file(run.trained_path.with_name("pytorch_lora_weights_best.safetensors"))
    snapshot = load_file(tmp_path / "run" / "snapshots" / f"step-{best_step:06d}.safetensors")
    assert kept.keys() == snapshot.keys() and all(torch.equal(kept[k], snapshot[k]) for k in kept)


def test_early_stopping_ends_the_run_with_its_files_and_resumes_knowing_its_best(
    make_config, tmp_path, shapes, monkeypatch, capsys
):
    scripted = {1: 1.0, 2: 0.5, 3: 0.6, 4: 0.7, 5: 0.8, 6: 0.9}
    _scripted_validation(monkeypatch, scripted)
    settings = {
        "validation__path": str(shapes),
        "validation__every_steps": 1,
        "validation__early_stop_patience": 2,
        "train__max_steps": 6,
        "checkpoint__every_steps": 1,
    }
    result = train(make_config(**settings))
    rows = read_metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]  # two validations (3, 4) without beating step 2's
    assert (
        result.trained_path.exists() and result.trained_path.with_name("pytorch_lora_weights_best.safetensors").exists()
    )
    out = capsys.readouterr().out
    assert "stopped early at step 4: 2 validations without a lower validation loss" in out
    assert "best val_loss 0.5 at step 2: pytorch_lora_weights_best.safetensors" in out
    best = json.loads((tmp_path / "run" / "best.json").read_text())
    assert best["early_stopped"] and best["since_improved"] == 2

    # A run stopped by max_steps at step 3, resumed: its best so far came back from the checkpoint.
    _scripted_validation(monkeypatch, scripted)
    train(make_config(**{**settings, "train__max_steps": 3, "train__output_dir": str(tmp_path / "parts")}))
    _scripted_validation(monkeypatch, {1: 0.7, 2: 0.8, 3: 0.9})  # steps 4, 5, 6 after the resume
    train(make_config(**{**settings, "train__output_dir": str(tmp_path / "parts")}), resume="auto")
    assert [row["step"] for row in read_metrics(tmp_path / "parts")] == [1, 2, 3, 4]
    assert json.loads((tmp_path / "parts" / "best.json").read_text())["records"]["val_loss"]["step"] == 2


def test_judged_scores_at_validation_keep_the_best_scoring_result(make_config, tmp_path, shapes):
    train(
        make_config(
            validation__path=str(shapes),
            validation__every_steps=2,
            validation__eval_concept="purple",
            validation__eval_samples_per_prompt=1,
            train__max_steps=2,
            sample__steps=2,
        )
    )
    [row] = [row for row in read_metrics(tmp_path / "run") if "eval_score" in row]
    assert 0 <= row["eval_concept"] <= 1 and 0 <= row["eval_seen"] <= 1
    assert row["eval_score"] == pytest.approx((row["eval_concept"] + row["eval_seen"]) / 2)
    assert (tmp_path / "run" / "pytorch_lora_weights_best_eval.safetensors").exists()
    with pytest.raises(
        DifftuneError,
        match="validation.eval_concept = 'teal': not a concept an installed judge scores \\(the shapes bases' colors: "
        "red",
    ):
        train(make_config(validation__path=str(shapes), validation__eval_concept="teal", train__overwrite=True))


def test_the_ui_plots_validation_with_its_best_point(tmp_path):
    from difftune.training.validation import read_best
    from difftune.webui import jobs

    rows = [
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 0.9, "val_loss": 0.5},
        {"step": 4, "loss": 0.8, "val_loss": 0.4},
    ]
    assert jobs.validation_frame(rows[:1], read_best(tmp_path)) is None
    (tmp_path / "best.json").write_text(json.dumps({"records": {"val_loss": {"step": 4, "value": 0.4, "file": "x"}}}))
    frame = jobs.validation_frame(rows, read_best(tmp_path))
    assert frame.values.tolist() == [[2, 0.5, "validation"], [4, 0.4, "validation"], [4, 0.4, "best"]]


# Caption tools.


def _tagged_folder(shapes, path):
    """The shapes images captioned with comma-separated tags, a trigger word first."""
    import shutil

    path.mkdir()
    for image in sorted(shapes.glob("*.png")):
        shutil.copy(image, path / image.name)
        words = (shapes / f"{image.stem}.txt").read_text().split()
        (path / f"{image.stem}.txt").write_text(", ".join(["sks", *words[1:], "plain background", "centered"]))
    return path


def test_tag_shuffle_and_dropout_keep_the_leading_tags():
    import random

    from difftune.config import DataConfig
    from difftune.data.dataset import vary_caption

    caption = "sks, red, circle, small, bright, plain"
    shuffled = DataConfig(shuffle_tags=True, keep_tokens=1)
    draws = [vary_caption(caption, shuffled, random.Random(seed)) for seed in range(50)]
    assert all(draw.startswith("sks, ") for draw in draws)
    assert all(sorted(draw.split(", ")) == sorted(caption.split(", ")) for draw in draws)  # a permutation
    assert len(set(draws)) > 20  # of the 120 orders of the other five, many are drawn
    dropped = DataConfig(tag_dropout=0.5, keep_tokens=2)
    counts = [len(vary_caption(caption, dropped, random.Random(seed)).split(", ")) - 2 for seed in range(400)]
    assert sum(counts) / len(counts) == pytest.approx(4 * 0.5, abs=0.25)  # each of the 4 others kept half the time
    assert all(vary_caption(caption, dropped, random.Random(s)).startswith("sks, red") for s in range(20))
    spaced = DataConfig(shuffle_tags=True, tag_separator=" ")
    assert sorted(vary_caption("a b c", spaced, random.Random(0)).split(" ")) == ["a", "b", "c"]


def test_caption_variants_are_fixed_per_caption_and_listed_for_the_cache():
    import random

    from difftune.config import DataConfig
    from difftune.data.dataset import CaptionDrawer

    config = DataConfig(shuffle_tags=True, caption_variants=3, caption_prefix="photo of ", caption_suffix=".")
    drawer = CaptionDrawer(config, train_seed=7)
    caption = "red, circle, small, bright, plain, centered"
    variants = drawer.variants(caption)
    assert (
        variants == CaptionDrawer(config, train_seed=7).variants(caption) and len(set(variants)) == 3
    )  # of 720 orders
    assert all(v.startswith("photo of ") and v.endswith(".") for v in variants)
    drawn = {drawer.draw(caption, random.Random(seed)) for seed in range(60)}
    assert drawn == set(variants) and drawer.possible({caption}) == set(variants) | {""}
    plain = CaptionDrawer(DataConfig(caption_prefix="sks, "), 0)
    assert plain.draw("a red circle", random.Random(0)) == "sks, a red circle"
    assert plain.possible({"a red circle"}) == {"sks, a red circle", ""}


def test_shuffled_captions_train_cached_like_uncached(make_config, tmp_path, shapes):
    """With caption variants the text cache holds each variant once, and the run is the uncached run."""
    tagged = _tagged_folder(shapes, tmp_path / "tagged")
    common = {
        "data__path": str(tagged),
        "data__shuffle_tags": True,
        "data__keep_tokens": 1,
        "data__tag_dropout": 0.2,
        "data__caption_variants": 3,
        "data__caption_dropout": 0.2,
        "train__max_steps": 4,
        "cache__dir": str(tmp_path / "cache"),
    }
    train(make_config(train__output_dir=str(tmp_path / "plain"), **common))
    train(make_config(train__output_dir=str(tmp_path / "cached"), cache__text=True, **common))
    losses = [[row["loss"] for row in read_metrics(tmp_path / name)] for name in ("plain", "cached")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    from difftune.data.dataset import CaptionDrawer

    captions = {path.read_text() for path in tagged.glob("*.txt")}
    config = make_config(**common)
    cached = CaptionDrawer(config.data, 0).possible(captions)
    assert len(cached) > 2 * len(captions)  # most captions' 3 variants differ
    # one entry per token sequence: the tiny tokenizer's short context makes some variants the same tokens
    components = load_components(config.model)
    tokens = {
        tuple(ids[0].tolist())
        for caption in cached
        for ids in components.family.conditioning.tokenize(components.tokenizers, [caption]).values()
    }
    assert len(list((tmp_path / "cache" / "text").rglob("*.safetensors"))) == len(tokens)


def test_fresh_caption_draws_turn_the_text_cache_off(make_config):
    assert make_config(data__shuffle_tags=True, cache__text="auto").cache.text == "off"
    assert make_config(data__shuffle_tags=True, data__caption_variants=4, cache__text="auto").cache.text == "on"
    with pytest.raises(DifftuneError, match="needs data.caption_variants > 0"):
        make_config(data__tag_dropout=0.1, cache__text=True)


def test_folder_names_caption_uncaptioned_images(tmp_path, shapes):
    import shutil

    from difftune.config import DataConfig
    from difftune.data.dataset import scan_examples

    folder = tmp_path / "data" / "3_sks dog"
    folder.mkdir(parents=True)
    for image in sorted(shapes.glob("*.png"))[:2]:
        shutil.copy(image, folder / image.name)
    (folder / f"{sorted(shapes.glob('*.png'))[0].stem}.txt").write_text("its own caption")
    examples, _ = scan_examples(DataConfig(path=str(tmp_path / "data"), missing_caption="folder"))
    assert sorted(e.caption for e in examples) == ["its own caption"] * 3 + ["sks dog"] * 3
    shutil.copy(sorted(shapes.glob("*.png"))[2], tmp_path / "data" / "loose.png")
    with pytest.raises(DifftuneError, match="loose.png has no caption file .* not in an `N_name` folder"):
        scan_examples(DataConfig(path=str(tmp_path / "data"), missing_caption="folder"))


# Masked loss.


def _halves(path, alpha=False):
    """A 48x32 image, red on the left half and blue on the right; with `alpha`, the right half transparent."""
    from PIL import Image

    pixels = torch.zeros(32, 48, 4, dtype=torch.uint8)
    pixels[:, :24, 0] = 255
    pixels[:, 24:, 2] = 255
    pixels[..., 3] = 255
    if alpha:
        pixels[:, 24:, 3] = 0
    Image.fromarray(pixels.numpy(), "RGBA").convert("RGBA" if alpha else "RGB").save(path)


def _left_mask(path):
    from PIL import Image

    mask = torch.zeros(32, 48, dtype=torch.uint8)
    mask[:, :24] = 255
    Image.fromarray(mask.numpy(), "L").save(path)


@pytest.mark.parametrize("source", ["folder", "alpha"])
def test_a_mask_follows_its_image_through_crop_flip_and_buckets(tmp_path, source):
    import random

    from difftune.config import DataConfig
    from difftune.data.dataset import load_image

    _halves(tmp_path / "img.png", alpha=source == "alpha")
    (tmp_path / "masks").mkdir()
    _left_mask(tmp_path / "masks" / "img.png")
    config = DataConfig(
        path=str(tmp_path),
        resolution=16,
        crop="random",
        random_flip=True,
        masks=source,
        mask_path=str(tmp_path / "masks"),
        alpha_background=(0, 0, 255),
    )
    for seed in range(12):
        for size in ((16, 16), (24, 16), (16, 24)):
            pixels, _, mask, *_ = load_image(tmp_path / "img.png", config, random.Random(seed), size)
            assert mask.shape == (1, size[1], size[0])
            red = pixels[0] > 0  # red channel: where the left half landed
            assert torch.equal(mask[0] > 0.5, red), (seed, size)


def test_masks_that_cannot_work_are_reported_and_missing_ones_train_whole(tmp_path, shapes):
    import shutil

    from PIL import Image

    from difftune.config import DataConfig
    from difftune.data.dataset import scan_examples

    data, masks = tmp_path / "data", tmp_path / "masks"
    shutil.copytree(shapes, data)
    masks.mkdir()
    images = sorted(data.glob("*.png"))
    Image.new("L", (32, 32), 0).save(masks / images[0].name)  # all black
    Image.new("L", (16, 16), 255).save(masks / images[1].name)  # wrong size
    examples, bad = scan_examples(DataConfig(path=str(data), masks="folder", mask_path=str(masks)))
    reasons = {b.path.name: b.reason for b in bad}
    assert "all black" in reasons[images[0].name] and "masks must match their image" in reasons[images[1].name]
    assert len(examples) == len(images) - 2  # the rest have no mask: they train whole


def test_masked_loss_trains_cached_like_uncached_and_white_masks_change_nothing(make_config, tmp_path, shapes):
    from PIL import Image

    masks, white = tmp_path / "masks", tmp_path / "white"
    masks.mkdir(), white.mkdir()
    for image in shapes.glob("*.png"):
        mask = Image.new("L", (32, 32), 0)
        mask.paste(255, (0, 0, 20, 32))
        mask.save(masks / image.name)
        Image.new("L", (32, 32), 255).save(white / image.name)
    common = {"train__max_steps": 3, "data__random_flip": True, "cache__dir": str(tmp_path / "cache")}

    def losses(name, **settings):
        train(make_config(train__output_dir=str(tmp_path / name), **common, **settings))
        return [row["loss"] for row in read_metrics(tmp_path / name)]

    plain = losses("plain")
    masked = losses("masked", data__masks="folder", data__mask_path=str(masks))
    assert losses("cached", data__masks="folder", data__mask_path=str(masks), cache__latents=True) == pytest.approx(
        masked, rel=1e-5
    )
    assert losses("white", data__masks="folder", data__mask_path=str(white)) == pytest.approx(plain, rel=1e-5)
    assert losses(
        "ignored", data__masks="folder", data__mask_path=str(masks), data__unmasked_weight=1.0
    ) == pytest.approx(plain, rel=1e-5)
    assert masked != pytest.approx(plain, rel=1e-3)


def test_latent_mask_averages_each_patch_and_lifts_the_unmasked():
    from difftune.training.train import latent_mask

    mask = torch.zeros(1, 1, 16, 16)
    mask[..., :, :4] = 1.0  # half of the first 8-pixel column of patches
    weights = latent_mask(mask, (2, 2), 0.0)
    torch.testing.assert_close(weights, torch.tensor([[[[0.5, 0.0], [0.5, 0.0]]]]))
    torch.testing.assert_close(latent_mask(mask, (2, 2), 0.2), 0.2 + 0.8 * weights)


# Prior preservation.


def test_class_images_are_drawn_once_resumably_and_reproducibly(make_config, tmp_path, monkeypatch):
    from difftune.training import prior

    settings = {
        "prior__class_path": str(tmp_path / "class"),
        "prior__class_prompt": "a red circle",
        "prior__num_class_images": 3,
        "prior__steps": 2,
        "prior__batch_size": 2,
    }
    config = make_config(**settings)
    components = load_components(config.model)
    folder = prior.class_folder(config, components)

    def fill(config):
        return prior.fill_class_images(config, components, torch.device("cpu"), prior.class_folder(config, components))

    assert prior.fill_class_images(config, components, torch.device("cpu"), folder) == 3
    images = sorted((tmp_path / "class").glob("*.png"))
    assert [p.name for p in images] == ["class_00000.png", "class_00001.png", "class_00002.png"]
    assert all(p.with_suffix(".txt").read_text() == "a red circle" for p in images)
    first = {p.name: p.read_bytes() for p in images}
    assert fill(config) == 0  # all there: nothing drawn
    images[1].unlink()  # an interrupted fill: drawn again, the same image
    assert fill(config) == 1
    assert (tmp_path / "class" / "class_00001.png").read_bytes() == first["class_00001.png"]
    # Images of the user's own count toward the number.
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "mine.png").write_bytes(first["class_00000.png"])
    own = make_config(**{**settings, "prior__class_path": str(tmp_path / "own")})
    assert fill(own) == 2


def test_prior_preservation_mixes_class_images_at_their_weight(make_config, tmp_path, shapes, monkeypatch):
    from difftune.training import train as train_module

    weights = []
    original = train_module._training_loss

    def recording(components, batch, config, device, *rest):
        weights.extend(zip(batch["path"], batch["loss_weight"].tolist(), strict=True))
        return original(components, batch, config, device, *rest)

    monkeypatch.setattr(train_module, "_training_loss", recording)
    result = train(
        make_config(
            prior__class_prompt="a blue square",
            prior__num_class_images=2,
            prior__steps=2,
            prior__loss_weight=0.5,
            cache__dir=str(tmp_path / "cache"),
            train__max_steps=8,
        )
    )
    assert result.trained_path.exists()
    drawn = [(path, weight) for path, weight in weights if "class_images" in path]
    own = [(path, weight) for path, weight in weights if "class_images" not in path]
    assert drawn and own and {w for _, w in drawn} == {0.5} and {w for _, w in own} == {1.0}
    assert len(drawn) == pytest.approx(len(own), abs=4)  # as many class as instance images per epoch
    # The drawn images are kept in the cache folder and reused by the next run.
    folders = list((tmp_path / "cache" / "class_images").iterdir())
    assert len(folders) == 1 and len(list(folders[0].glob("*.png"))) == 2


def test_prior_loss_weight_scales_each_class_sample(make_config, tmp_path, shapes, monkeypatch):
    """A class sample's loss is the plain loss times prior.loss_weight: weight 0 trains on the instances alone."""
    from difftune.training import train as train_module

    losses = []
    original_loss = train_module._training_loss

    def recording(components, batch, config, device, *rest):
        loss = original_loss(components, batch, config, device, *rest)
        losses.append((batch["loss_weight"].clone(), loss.detach().clone()))
        return loss

    monkeypatch.setattr(train_module, "_training_loss", recording)
    train(make_config(prior__class_path=str(shapes), prior__loss_weight=0.0, train__max_steps=4, train__batch_size=4))
    weights = torch.cat([w for w, _ in losses])
    values = torch.cat([v for _, v in losses])
    assert (weights == 0).any() and (values[weights == 0] == 0).all() and (values[weights == 1] > 0).all()


# LyCORIS: LoHa and LoKr.


def _lycoris_delta(kohya: dict, name: str, shape) -> torch.Tensor:
    """A LyCORIS module's weight change as ComfyUI's and A1111's loaders compute it from the file alone (their
    documented formulas, written out here independently of difftune's reader)."""

    def tucker(core, a, b):  # a Tucker core `core` (r, r, k, k) with its out (a) and in (b) factors, (r, out/in) each
        return torch.einsum("i j k l, j r, i p -> p r k l", core, b, a).contiguous()

    if f"{name}.hada_w1_a" in kohya:
        factors = []
        for i in (1, 2):
            a, b = kohya[f"{name}.hada_w{i}_a"], kohya[f"{name}.hada_w{i}_b"]
            core = kohya.get(f"{name}.hada_t{i}")
            factors.append(a @ b if core is None else tucker(core, a, b))
        return (factors[0] * factors[1]).reshape(shape) * kohya[f"{name}.alpha"] / kohya[f"{name}.hada_w1_b"].shape[0]
    dim = None
    w1 = kohya.get(f"{name}.lokr_w1")
    if w1 is None:
        dim = kohya[f"{name}.lokr_w1_b"].shape[0]
        w1 = kohya[f"{name}.lokr_w1_a"] @ kohya[f"{name}.lokr_w1_b"]
    w2 = kohya.get(f"{name}.lokr_w2")
    if w2 is None:
        dim = kohya[f"{name}.lokr_w2_b"].shape[0]
        a, b, core = kohya[f"{name}.lokr_w2_a"], kohya[f"{name}.lokr_w2_b"], kohya.get(f"{name}.lokr_t2")
        w2 = a @ b if core is None else tucker(core, a, b)
    if w2.ndim == 4:
        w1 = w1[:, :, None, None]
    scale = kohya[f"{name}.alpha"] / dim if dim is not None and f"{name}.alpha" in kohya else 1.0
    return torch.kron(w1, w2).reshape(shape) * scale


# What the lycoris-lora library writes for each network option: (algo, dim, alpha, further create_network options).
LYCORIS_VARIANTS = {
    "lokr-full-matrix-preset": ("lokr", 10000, 1, {}),  # dim 10000: every factor full, alpha stored = 10000
    "lokr-dim4": ("lokr", 4, 2, {}),  # full factors on small layers (alpha stored = 4), low-rank on larger ones
    "lokr-decompose-both": ("lokr", 2, 1, {"decompose_both": True}),
    "lokr-tucker": ("lokr", 2, 1, {"use_tucker": True}),
    "lokr-factor-4": ("lokr", 2, 1, {"factor": 4}),
    "lokr-full-matrix": ("lokr", 4, 1, {"full_matrix": True}),
    "lokr-rs-lora": ("lokr", 2, 1, {"rs_lora": True}),
    "lokr-unbalanced": ("lokr", 2, 1, {"unbalanced_factorization": True, "decompose_both": True}),
    "loha": ("loha", 4, 2, {}),
    "loha-tucker": ("loha", 2, 1, {"use_tucker": True}),
}
# Attention, MLP, resnets, samplers and the UNet's own convolutions: layers of every shape the tiny base has.
LYCORIS_PRESET = """
enable_conv = true
unet_target_module = ["Transformer2DModel", "ResnetBlock2D", "Downsample2D", "Upsample2D"]
unet_target_name = ["conv_in", "conv_out", "time_embedding.linear_1", "time_embedding.linear_2"]
text_encoder_target_module = ["CLIPAttention", "CLIPMLP"]
text_encoder_target_name = []
"""


def _lycoris_network(tiny_base, tmp_path, algo: str, dim: int, alpha: float, **options):
    """A network made and saved by the lycoris-lora library itself, its factors moved from their start at random;
    the file and each module's weight change as LyCORIS computes it in its forward (by kohya module name)."""
    lycoris_kohya = pytest.importorskip("lycoris.kohya")
    from diffusers import StableDiffusionPipeline

    pipeline = StableDiffusionPipeline.from_pretrained(tiny_base, safety_checker=None, dtype=torch.float32)
    preset = tmp_path / "preset.toml"
    preset.write_text(LYCORIS_PRESET)
    torch.manual_seed(0)
    network = lycoris_kohya.create_network(
        1.0,
        dim,
        alpha,
        pipeline.vae,
        pipeline.text_encoder,
        pipeline.unet,
        algo=algo,
        preset=str(preset),
        conv_dim=dim,
        conv_alpha=alpha,
        **options,
    )
    network.apply_to(pipeline.text_encoder, pipeline.unet, True, True)
    with torch.no_grad():
        for param in network.parameters():
            param.normal_(std=0.1)
    path = tmp_path / "lycoris.safetensors"
    network.save_weights(str(path), torch.float32, None)
    with torch.no_grad():
        deltas = {module.lora_name: module.get_weight(module.shape) * module.scalar for module in network.loras}
    return path, deltas


def _kohya_weights(components) -> dict[str, torch.Tensor]:
    """Every adaptable layer's weight by its kohya module name."""
    prefixes = components.family.layout.kohya_prefixes
    return {
        prefixes[part] + name.replace(".", "_"): module.weight.detach().clone()
        for part, model in components.parts().items()
        if part in prefixes
        for name, module in model.named_modules()
        if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d))
    }


@pytest.mark.parametrize("variant", list(LYCORIS_VARIANTS))
def test_files_the_lycoris_library_writes_merge_as_its_math_says(tiny_base, tmp_path, variant):
    """Each LoKr/LoHa variant LyCORIS writes: difftune's merge (straight from the file, and after converting it to the
    diffusers layout) changes every layer by what LyCORIS's own forward computes, which is also ComfyUI's formula.
    The full-factor LoKr scale was read as alpha / its factor's size (1250x under the full-matrix preset)."""
    algo, dim, alpha, options = LYCORIS_VARIANTS[variant]
    path, deltas = _lycoris_network(tiny_base, tmp_path, algo, dim, alpha, **options)
    kohya = load_file(path)
    base = _kohya_weights(load_components(ModelConfig(base=str(tiny_base))))
    for name, delta in deltas.items():  # the two references agree with each other
        torch.testing.assert_close(
            _lycoris_delta(kohya, name, base[name].shape), delta.reshape(base[name].shape), rtol=1e-4, atol=1e-6
        )
    converted = export.convert_adapter(path, tmp_path / "converted.safetensors", "diffusers", str(tiny_base))
    for source in (path, converted):
        merged = load_components(ModelConfig(base=str(tiny_base)))
        export.merge_adapters(merged, [(source, 1.0)])
        weights = _kohya_weights(merged)
        worst = max(
            (weights[name] - base[name] - delta.reshape(base[name].shape)).abs().max().item()
            for name, delta in deltas.items()
        )
        assert worst < 1e-5, (source.name, worst)
        assert sum(not torch.equal(weights[name], base[name]) for name in deltas) == len(deltas)


def test_a_lycoris_file_with_weight_decomposition_is_refused_by_name(tiny_base, tmp_path):
    path, _ = _lycoris_network(tiny_base, tmp_path, "lokr", 2, 1, dora_wd=True)
    merged = load_components(ModelConfig(base=str(tiny_base)))
    with pytest.raises(DifftuneError, match=r"dora_scale: a LoHa/LoKr with weight decomposition \(LyCORIS dora_wd\)"):
        export.merge_adapters(merged, [(path, 1.0)])


@pytest.mark.parametrize("kind", ["loha", "lokr"])
@pytest.mark.parametrize("rank", [2, 8])  # LoKr: rank 8 keeps its second factor full on these 32-wide layers
def test_lycoris_files_load_back_merge_and_read_as_comfyui_reads_them(tiny_base, tmp_path, kind, rank):
    adapted, config = _adapted(tiny_base, kind=kind, rank=rank)
    tensors, lora_configs = adapter_state_dict(adapted, config.adapter)
    assert all(key.split(".")[-1].startswith({"loha": "hada_", "lokr": "lokr_"}[kind]) for key in tensors)
    for layout in ("diffusers", "kohya"):
        path = export.write_adapter(tmp_path / f"{layout}.safetensors", tensors, lora_configs, config.to_toml(), layout)
        loaded = load_components(ModelConfig(base=str(tiny_base)))
        export.apply_adapters(loaded, [(path, 1.0)])
        for ours, theirs in zip(_outputs(adapted), _outputs(loaded), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    merged = load_components(ModelConfig(base=str(tiny_base)))
    export.merge_adapters(merged, [(tmp_path / "kohya.safetensors", 1.0)])
    assert not any("hada_" in key or "lokr_" in key for key in merged.denoiser.state_dict())
    for ours, theirs in zip(_outputs(adapted), _outputs(merged), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=2e-5)

    # ComfyUI's / A1111's reading of the kohya file: base weight + the change their formula gives.
    kohya = load_file(tmp_path / "kohya.safetensors")
    base = load_components(ModelConfig(base=str(tiny_base)))
    q = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    weight = dict(base.denoiser.named_parameters())[f"{q}.weight"]
    expected = dict(merged.denoiser.named_parameters())[f"{q}.weight"]
    name = "lora_unet_" + q.replace(".", "_")
    torch.testing.assert_close(weight + _lycoris_delta(kohya, name, weight.shape), expected, rtol=1e-4, atol=1e-6)
    metadata = json.loads(
        __import__("safetensors").safe_open(tmp_path / "kohya.safetensors", "pt").metadata()["ss_network_args"]
    )
    assert metadata == {"algo": kind}


def test_a_lycoris_run_trains_saves_and_redraws_its_sample(make_config, tmp_path):
    for kind, layout in (("loha", "kohya"), ("lokr", "diffusers")):
        out = tmp_path / kind
        train(
            make_config(
                adapter__kind=kind,
                adapter__text_encoder=True,
                export__format=layout,
                train__max_steps=3,
                sample__prompts=["a red circle"],
                sample__steps=3,
                train__output_dir=str(out),
            )
        )
        report = json.loads((out / "parity.json").read_text())
        assert set(report["layouts"]) == {"diffusers", "kohya"}
        assert all(r["max_pixel_difference"] <= report["warn_above_levels"] for r in report["layouts"].values()), report
