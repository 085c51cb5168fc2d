"""Edit pairs: control images found in the layouts users have, reported when bad, cut and flipped with their target,
cached, and read by an edit base (FLUX.1 Kontext) as its own diffusers pipeline reads them."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from difftune.adapters import export
from difftune.cli import main
from difftune.config import DataConfig, ModelConfig
from difftune.data.dataset import BAD_FILES_REPORT, CaptionedImages, load_image, scan_examples
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components
from difftune.models.autoencoders import encode_posterior, reference_latents
from difftune.toy.tiny import recolor_pairs, write_pair_folder
from difftune.training.metrics import read_metrics
from difftune.training.train import train

from conftest import edit_settings


def test_controls_are_found_by_stem_numbered_or_listed_and_bad_ones_reported(tmp_path):
    images = [target for _, target, _ in recolor_pairs(5, seed=1)]
    folder = tmp_path / "data"
    (folder / "control").mkdir(parents=True)
    for i, image in enumerate(images):
        image.save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text("make it red")
    images[0].save(folder / "control" / "0.png")  # one control, by stem
    images[1].save(folder / "control" / "1_0.png")  # two, numbered
    images[2].save(folder / "control" / "1_1.jpg")
    images[2].save(folder / "control" / "2_0.png")  # numbered with a gap: left out, reported
    images[2].save(folder / "control" / "2_2.png")
    (folder / "control" / "3.png").write_bytes(b"not an image")  # a bad control: its pair left out, reported
    # 4.png has no control: it trains as text-to-image beside the pairs
    examples, bad = scan_examples(DataConfig(path=str(folder)))
    found = {e.path.name: [c.name for c in e.control_paths] for e in examples}
    assert found == {"0.png": ["0.png"], "1.png": ["1_0.png", "1_1.jpg"], "4.png": []}
    reasons = {b.path.name: b.reason for b in bad}
    assert set(reasons) == {"2.png", "3.png"}
    assert "2_0.png, 2_2.png" in reasons["2.png"] and "without gaps" in reasons["2.png"]
    assert reasons["3.png"].startswith(f"control {folder / 'control' / '3.png'}: cannot be decoded")

    # metadata.jsonl lists them; a missing one is reported for its line, never a crash
    listed = tmp_path / "listed"
    shutil.copytree(folder, listed)
    lines = [
        {"file_name": "0.png", "text": "make it red", "control_files": ["control/0.png", "control/1_1.jpg"]},
        {"file_name": "1.png", "text": "make it red", "control_files": "control/1_0.png"},
        {"file_name": "4.png", "text": "make it red", "control_files": ["control/gone.png"]},
    ]
    (listed / "metadata.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    examples, bad = scan_examples(DataConfig(path=str(listed)))
    assert {e.path.name: [c.name for c in e.control_paths] for e in examples} == {
        "0.png": ["0.png", "1_1.jpg"],
        "1.png": ["1_0.png"],
    }
    assert [(b.path.name, b.reason) for b in bad] == [
        ("4.png", "control control/gone.png (line 3 of metadata.jsonl) does not exist")
    ]
    (listed / "metadata.jsonl").write_text(
        json.dumps({"file_name": "0.png", "text": "x", "control_files": ["../0.png"]})
    )
    with pytest.raises(DifftuneError, match="control file '../0.png' leads outside"):
        scan_examples(DataConfig(path=str(listed)))


def test_a_control_is_cut_and_flipped_with_its_target(tmp_path):
    """A control identical to its target comes out identical under random crops and flips, at another size too."""
    source = Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 80, 3), dtype=np.uint8))
    source.save(tmp_path / "target.png")
    source.resize((160, 96)).save(tmp_path / "control.png")  # the same picture at twice the size
    config = DataConfig(path=str(tmp_path), resolution=32, crop="random", random_flip=True)
    flips = set()
    for seed in range(8):
        view = load_image(
            tmp_path / "target.png", config, random.Random(seed), (32, 32), [(tmp_path / "control.png", (32, 32))]
        )
        assert (view.controls[0] - view.pixels).abs().mean() < 0.05  # resampling differs, the place does not
        flips.add(int(view.geometry[3]))
    assert len(flips) > 2  # crops and flips did vary


def test_pairs_train_cached_as_uncached_and_a_changed_control_is_encoded_again(
    kontext_base, pairs, make_config, tmp_path
):
    losses = {}
    for cached in (False, True):
        settings = edit_settings(
            kontext_base,
            pairs,
            tmp_path / f"run-{cached}",
            cache__latents=cached,
            cache__text=cached,
            cache__dir=str(tmp_path / "cache"),
            train__max_steps=3,
        )
        train(make_config(**settings))
        losses[cached] = [row["loss"] for row in read_metrics(tmp_path / f"run-{cached}")]
    assert np.allclose(losses[False], losses[True], rtol=1e-5, atol=1e-7)
    entries = set((tmp_path / "cache" / "latents").rglob("*.safetensors"))
    assert len(entries) == 12  # six targets and six controls
    Image.open(pairs / "control" / "0001.png").transpose(Image.Transpose.ROTATE_90).save(pairs / "control" / "0001.png")
    train(
        make_config(
            **edit_settings(
                kontext_base,
                pairs,
                tmp_path / "again",
                cache__latents=True,
                cache__dir=str(tmp_path / "cache"),
                train__max_steps=1,
            )
        )
    )
    assert len(set((tmp_path / "cache" / "latents").rglob("*.safetensors")) - entries) == 1


def test_kontext_reads_a_control_as_its_pipeline_does(kontext_base, pairs):
    """The transformer's prediction in training (our packing, position ids and control latents) equals the one
    FluxKontextPipeline makes from the same noisy latents, timestep and control image (its prepare_latents)."""
    components = load_components(ModelConfig(base=str(kontext_base)))
    family = components.family
    pipeline = family.pipeline_class.from_pretrained(kontext_base, dtype=torch.float32)
    control = Image.open(pairs / "control" / "0000.png").convert("RGB")
    pixels = pipeline.image_processor.preprocess(control, 32, 32)
    side = 32 // pipeline.vae_scale_factor
    noisy = torch.randn(1, 16, side, side, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        packed, image_latents, latent_ids, image_ids = pipeline.prepare_latents(
            pixels, 1, 16, 32, 32, torch.float32, "cpu", None, pipeline._pack_latents(noisy, 1, 16, side, side)
        )
        states, pooled, text_ids = pipeline.encode_prompt(
            "make it red", "make it red", device="cpu", max_sequence_length=32
        )
        theirs = pipeline.transformer(
            hidden_states=torch.cat([packed, image_latents], dim=1),
            timestep=torch.tensor([0.7]),
            guidance=torch.tensor([1.0]),
            pooled_projections=pooled,
            encoder_hidden_states=states,
            txt_ids=text_ids,
            img_ids=torch.cat([latent_ids, image_ids]),
            return_dict=False,
        )[0][:, : packed.shape[1]]
        token_ids = family.conditioning.tokenize(components.tokenizers, ["make it red"])
        conditioning = family.conditioning.encode_prompts(components, token_ids)
        conditioning["control_latents"] = [
            reference_latents(encode_posterior(components.vae, pixels)[0], components.latent_normalization)
        ]
        ours = family.denoise(components, noisy, torch.tensor([700.0]), conditioning, None)
    assert torch.allclose(pipeline._unpack_latents(theirs, 32, 32, pipeline.vae_scale_factor), ours, atol=1e-5)
    without = family.denoise(components, noisy, torch.tensor([700.0]), conditioning | {"control_latents": []}, None)
    assert (without - ours).abs().max() > 1e-3  # the control is read


def test_a_kontext_adapter_edits_in_its_pipeline_as_in_ours(kontext_base, pairs, make_config, tmp_path):
    """Trained on pairs, with a preview prompt carrying its control and validation on held-out pairs: the adapter,
    loaded by FluxKontextPipeline with the same control, draws what `difftune sample --control` and the run's own
    samples draw; the grid shows control | before | after."""
    write_pair_folder(tmp_path / "held-out", recolor_pairs(2, seed=9))
    control = str(pairs / "control" / "0000.png")
    settings = edit_settings(
        kontext_base,
        pairs,
        tmp_path / "run",
        train__max_steps=4,
        optim__learning_rate=2e-2,
        sample__prompts=[{"prompt": "make it purple", "controls": [control]}],
        sample__steps=4,
        sample__guidance_scale=3.0,
        sample__before=True,
        validation__path=str(tmp_path / "held-out"),
        validation__every_steps=2,
    )
    result = train(make_config(**settings))
    assert all(np.isfinite(row["val_loss"]) for row in read_metrics(tmp_path / "run") if "val_loss" in row)
    parity = json.loads((result.trained_path.parent / "parity.json").read_text())
    assert all(layout["max_pixel_difference"] <= 2 for layout in parity["layouts"].values()), parity
    grid = Image.open(tmp_path / "run" / "samples" / "grid.png")
    band = grid.height - 64  # the labels over the panels, scaled up to 64 px so the words fit
    assert grid.size == (3 * 64, 64 + band) and band > 0  # control | before | after
    shown = Image.open(control).convert("RGB").resize((32, 32)).resize((64, 64), Image.NEAREST)
    assert np.array_equal(np.asarray(grid)[band:, :64], np.asarray(shown))

    assert (
        main(
            [
                "sample",
                "--base",
                str(kontext_base),
                "--adapter",
                str(result.trained_path),
                "--prompt",
                "make it purple",
                "--control",
                control,
                "--steps",
                "4",
                "--guidance-scale",
                "3.0",
                "--resolution",
                "32",
                "--out",
                str(tmp_path / "cli"),
            ]
        )
        == 0
    )
    ours = np.asarray(Image.open(tmp_path / "cli" / "000.png"), dtype=np.int16)
    assert np.abs(ours - np.asarray(Image.open(tmp_path / "run" / "samples" / "000.png"), dtype=np.int16)).max() <= 2

    pipeline = FAMILIES["flux_kontext"].pipeline_class.from_pretrained(kontext_base, dtype=torch.float32)
    pipeline.load_lora_weights(str(result.trained_path.parent), weight_name=result.trained_path.name)
    pipeline.scheduler = FAMILIES["flux_kontext"].drawing.sampler("auto").from_config(pipeline.scheduler.config)
    pipeline.set_progress_bar_config(disable=True)
    theirs = pipeline(
        image=Image.open(control).convert("RGB"),
        prompt="make it purple",
        num_inference_steps=4,
        guidance_scale=3.0,
        height=32,
        width=32,
        max_area=32 * 32,
        _auto_resize=False,
        max_sequence_length=32,
        generator=torch.Generator("cpu").manual_seed(0),
    ).images[0]
    assert np.abs(ours - np.asarray(theirs, dtype=np.int16)).max() <= 2
    base_sample = np.asarray(Image.open(tmp_path / "run" / "samples" / "before" / "000.png"), dtype=np.int16)
    assert np.abs(ours - base_sample).max() > 10  # the adapter changed the edit

    export.merge_into_folder(str(kontext_base), [(result.trained_path, 1.0)], tmp_path / "merged")
    assert "FluxKontextPipeline" in (tmp_path / "merged" / "model_index.json").read_text()
    assert {key.split(".")[0] for key in load_file(result.trained_path)} == {"transformer"}


def test_text_to_image_bases_refuse_pairs_and_edit_prompts(tiny_flux_base, pairs, make_config, tmp_path):
    with pytest.raises(DifftuneError, match=r"0000.png has control images .* bases edit no image"):
        train(make_config(**edit_settings(tiny_flux_base, pairs, tmp_path / "run")))
    (pairs / "control").rename(tmp_path / "elsewhere")
    prompt = {"prompt": "make it red", "controls": [str(tmp_path / "elsewhere" / "0000.png")]}
    with pytest.raises(
        DifftuneError, match="sample.prompts: 'make it red' has 1 control images; these bases read none"
    ):
        train(make_config(**edit_settings(tiny_flux_base, pairs, tmp_path / "run", sample__prompts=[prompt])))
    missing = {"prompt": "make it red", "controls": [str(tmp_path / "gone.png")]}
    with pytest.raises(DifftuneError, match="control image .*gone.png of 'make it red' does not exist"):
        train(make_config(**edit_settings(tiny_flux_base, pairs, tmp_path / "run", sample__prompts=[missing])))


def test_kontext_refuses_a_second_control(kontext_base, pairs, make_config, tmp_path, capsys):
    control = str(pairs / "control" / "0002.png")
    assert (
        main(
            [
                "sample",
                "--base",
                str(kontext_base),
                "--prompt",
                "make it red",
                "--control",
                control,
                "--control",
                control,
                "--steps",
                "1",
                "--resolution",
                "32",
                "--out",
                str(tmp_path / "cli"),
            ]
        )
        != 0
    )
    assert "'make it red' has 2 control images; these bases read at most 1" in capsys.readouterr().err
    shutil.copy(pairs / "control" / "0002.png", pairs / "control" / "0002_1.png")
    (pairs / "control" / "0002.png").rename(pairs / "control" / "0002_0.png")
    with pytest.raises(
        DifftuneError, match="0002.png has 2 control images; FLUX.1 Kontext edit transformers bases read at most 1"
    ):
        train(make_config(**edit_settings(kontext_base, pairs, tmp_path / "run")))
    assert not (tmp_path / "run" / BAD_FILES_REPORT).read_text()


def test_mixed_runs_batch_pairs_apart_from_plain_images(kontext_base, pairs, make_config, tmp_path):
    for name in ("0004", "0005"):
        (pairs / "control" / f"{name}.png").unlink()
    examples, _ = scan_examples(DataConfig(path=str(pairs)))
    assert [len(e.control_paths) for e in examples] == [1, 1, 1, 1, 0, 0]
    settings = edit_settings(kontext_base, pairs, tmp_path / "run", train__max_steps=4, train__batch_size=2)
    train(make_config(**settings))
    assert len(read_metrics(tmp_path / "run")) >= 4
    dataset = CaptionedImages(
        examples,
        DataConfig(path=str(pairs), resolution=32),
        lambda c: {},
        0,
        control_sizes=[((32, 32),)] * 4 + [()] * 2,
    )
    assert "control_pixels" in dataset[(0, 0)] and "control_pixels" not in dataset[(0, 5)]
