"""Qwen-Image-Edit and Qwen-Image-Edit-Plus (2509 / 2511): prompts that show the language model the control images,
and control latents as extra transformer tokens, each checked against the family's own diffusers pipeline; edit
pairs trained, cached (the text cache keyed by the controls) and drawn with their controls."""

from __future__ import annotations

from pathlib import Path

import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus_module
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from difftune.adapters import export
from difftune.cli import main
from difftune.config import ModelConfig
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components
from difftune.families.qwen_image.micro import build_qwen_tokenizer, edit_pipeline_of
from difftune.families.qwen_image_edit import (
    EDIT_PROMPT_TEMPLATE,
    EDIT_TEMPLATE_TOKENS,
    VISION_TOKENS,
    control_dimensions,
)
from difftune.models.autoencoders import encode_posterior, reference_latents
from difftune.toy.micro import build_pipeline
from difftune.toy.tiny import (
    extend_qwen_tokenizer,
    recolor_pairs,
    write_pair_folder,
)
from difftune.training.metrics import read_metrics
from difftune.training.train import train

from conftest import edit_settings

EDIT_FAMILIES = ("qwen_image_edit", "qwen_image_edit_plus")


@pytest.fixture(scope="module")
def edit_bases(micro_base) -> dict[str, Path]:
    return {name: micro_base(name) for name in EDIT_FAMILIES}


def _controls(count: int) -> list[Image.Image]:
    return [control for control, _, _ in recolor_pairs(count, seed=5)]


@pytest.mark.parametrize("name", EDIT_FAMILIES)
def test_the_templates_are_the_pipelines(name, edit_bases):
    pipeline = FAMILIES[name].pipeline_class.from_pretrained(edit_bases[name], dtype=torch.float32)
    vision = VISION_TOKENS if name == "qwen_image_edit" else ""  # the first edit pipeline writes them into its template
    assert pipeline.prompt_template_encode == EDIT_PROMPT_TEMPLATE.replace("{}", vision + "{}")
    assert pipeline.prompt_template_encode_start_idx == EDIT_TEMPLATE_TOKENS
    assert FAMILIES[name].conditioning.padded_text_tokens == pipeline.tokenizer_max_length
    # The part the pipeline drops is all of the template before the vision tokens and the instruction, as with
    # Qwen2.5-VL's own vocabulary: no template token reaches the transformer.
    prefix = pipeline.prompt_template_encode.split("{}")[0].removesuffix(vision)
    assert len(pipeline.tokenizer(prefix)["input_ids"]) == EDIT_TEMPLATE_TOKENS


def test_the_edit_tokenizer_extends_a_text_to_image_one_keeping_its_ids():
    """An edit base made from a Qwen-Image base (scripts/make_tiny_edit_base.py) keeps every token's id, so its
    language model's embeddings only grow (text may split into the new, longer tokens)."""
    from difftune.families.qwen_image import PROMPT_TEMPLATE

    plain = build_qwen_tokenizer()
    extended = extend_qwen_tokenizer(plain, EDIT_PROMPT_TEMPLATE)
    vocab = extended.get_vocab()
    assert len(extended) > len(plain) and all(vocab[token] == i for token, i in plain.get_vocab().items())
    assert len(extended(PROMPT_TEMPLATE.split("{}")[0])["input_ids"]) == 34  # what QwenImagePipeline drops
    assert extended.get_vocab() == build_qwen_tokenizer(edit=True).get_vocab()


def test_an_edit_pipeline_made_of_a_text_to_image_one_reads_controls(tmp_path):
    """`edit_pipeline_of` (how models/tiny-qwen_image_edit_plus was made): the language model keeps its embedding rows,
    and the saved pipeline, loaded as its family, states a prompt with a control as the pipeline does."""
    source = build_pipeline(seed=3, family="qwen_image")
    before = source.text_encoder.get_input_embeddings().weight.detach().clone()
    edit = edit_pipeline_of(source)
    after = edit.text_encoder.get_input_embeddings().weight
    assert after.shape[0] == len(edit.tokenizer) > before.shape[0] and torch.equal(after[: before.shape[0]], before)
    edit.save_pretrained(tmp_path, safe_serialization=True)
    components = load_components(ModelConfig(base=str(tmp_path)))
    family, control = components.family, _controls(1)[0]
    assert family.name == "qwen_image_edit_plus"
    with torch.no_grad():
        ours = family.conditioning.encode_prompts(
            components, family.conditioning.tokenize(components.tokenizers, ["make it red"], [[control]])
        )
        states, _ = components.pipeline().encode_prompt(
            "make it red", image=[family.prompt_image(control)], device="cpu"
        )
    assert torch.equal(ours["encoder_hidden_states"][0, : states.shape[1]], states[0])


@pytest.mark.parametrize("name", EDIT_FAMILIES)
def test_prompts_with_controls_are_encoded_as_the_pipeline_encodes_them(name, edit_bases):
    """The language model's states for an instruction and its controls (two for Plus, of different sizes) equal the
    pipeline's `encode_prompt` bit for bit (batch 1: the pipelines take one prompt), and a batch of two captions of
    ours equals them to float rounding (batched matrix products round otherwise)."""
    family = FAMILIES[name]
    components = load_components(ModelConfig(base=str(edit_bases[name])))
    pipeline = components.pipeline()
    controls = _controls(2 if name.endswith("plus") else 1)
    if len(controls) == 2:
        controls[1] = controls[1].resize((48, 32))
    captions = ["make it red", "make it green, and keep the shape"]
    with torch.no_grad():
        ours = family.conditioning.encode_prompts(
            components, family.conditioning.tokenize(components.tokenizers, captions, [controls] * 2)
        )
        for i, caption in enumerate(captions):
            seen = [family.prompt_image(control) for control in controls]
            states, mask = pipeline.encode_prompt(
                caption, image=seen if len(seen) > 1 or name.endswith("plus") else seen[0], device="cpu"
            )
            assert mask is None  # one prompt: no padding
            alone = family.conditioning.encode_prompts(
                components, family.conditioning.tokenize(components.tokenizers, [caption], [controls])
            )
            assert torch.equal(alone["encoder_hidden_states"][0, : states.shape[1]], states[0])
            got = ours["encoder_hidden_states"][i]
            assert torch.allclose(got[: states.shape[1]], states[0], atol=1e-5)
            assert not got[states.shape[1] :].any() and int(ours["text_mask"][i].sum()) == states.shape[1]
        without = family.conditioning.encode_prompts(
            components, family.conditioning.tokenize(components.tokenizers, captions[:1])
        )
    assert int(without["text_mask"].sum()) < int(ours["text_mask"][0].sum())  # the images' tokens are read


def test_plus_shows_the_language_model_each_control_at_the_pipelines_size():
    family = FAMILIES["qwen_image_edit_plus"]
    control = _controls(1)[0].resize((96, 64))
    width, height = plus_module.calculate_dimensions(plus_module.CONDITION_IMAGE_SIZE, 96 / 64)
    expected = plus_module.VaeImageProcessor().resize(control, height, width)
    assert family.prompt_image(control).size == (width, height) == (480, 320)
    assert np.array_equal(np.asarray(family.prompt_image(control)), np.asarray(expected))
    # Controls train at the target's area (or control_resolution squared), aspect kept, as the pipelines size them.
    assert family.conditioning.control_size((32, 32), (96, 64)) == control_dimensions(32 * 32, (96, 64)) == (32, 32)
    options = family.options(ModelConfig(family_options={"control_resolution": 64}))
    assert family.conditioning.control_size((32, 32), (128, 64), options) == (
        96,
        32,
    )  # 3072 px: the nearest multiples of 32


@pytest.mark.parametrize("name", EDIT_FAMILIES)
def test_the_transformer_reads_controls_as_the_pipeline_does(name, edit_bases):
    """Our prediction (packing, control tokens, `img_shapes`) equals the transformer's on the pipeline's
    `prepare_latents` packing of the same noisy latents and controls; Plus's micro base modulates controls at time 0,
    as Qwen-Image-Edit-2511 does."""
    components = load_components(ModelConfig(base=str(edit_bases[name])))
    family, pipeline = components.family, components.pipeline()
    controls = _controls(2 if name.endswith("plus") else 1)
    if len(controls) == 2:
        controls[1] = controls[1].resize((48, 32))
    pixels = [pipeline.image_processor.preprocess(c, c.height, c.width).unsqueeze(2) for c in controls]
    noisy = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        packed = pipeline._pack_latents(noisy, 1, 16, 8, 8)
        _, image_latents = pipeline.prepare_latents(
            pixels if name.endswith("plus") else pixels[0], 1, 16, 32, 32, torch.float32, "cpu", None, packed
        )
        conditioning = family.conditioning.encode_prompts(
            components, family.conditioning.tokenize(components.tokenizers, ["make it red"], [controls])
        )
        states = conditioning["encoder_hidden_states"][:, : int(conditioning["text_mask"].sum())]
        shapes = [[(1, 4, 4), *((1, c.height // 8, c.width // 8) for c in controls)]]
        theirs = pipeline.transformer(
            hidden_states=torch.cat([packed, image_latents], dim=1),
            timestep=torch.tensor([0.7]),
            encoder_hidden_states=states,
            img_shapes=shapes,
            return_dict=False,
        )[0][:, :16]
        conditioning["control_latents"] = [
            reference_latents(
                encode_posterior(components.vae, pipeline.image_processor.preprocess(c, c.height, c.width))[0],
                components.latent_normalization,
            )
            for c in controls
        ]
        ours = family.denoise(components, noisy, torch.tensor([700.0]), conditioning, None)
        without = family.denoise(components, noisy, torch.tensor([700.0]), conditioning | {"control_latents": []}, None)
    assert torch.allclose(pipeline._unpack_latents(theirs, 32, 32, pipeline.vae_scale_factor)[:, :, 0], ours, atol=1e-5)
    assert (without - ours).abs().max() > 1e-3  # the controls are read


def test_pairs_train_cached_as_uncached_and_the_text_cache_follows_the_controls(
    edit_bases, pairs, make_config, tmp_path
):
    base = edit_bases["qwen_image_edit_plus"]
    losses = {}
    for cached in (False, True):
        settings = edit_settings(
            base,
            pairs,
            tmp_path / f"run-{cached}",
            cache__latents=cached,
            cache__text=cached,
            cache__dir=str(tmp_path / "cache"),
            train__max_steps=3,
            data__random_flip=True,
        )
        train(make_config(**settings))
        losses[cached] = [row["loss"] for row in read_metrics(tmp_path / f"run-{cached}")]
    assert np.allclose(losses[False], losses[True], rtol=1e-5, atol=1e-7)
    text = set((tmp_path / "cache" / "text").rglob("*.safetensors"))
    assert (
        len(text) == 6 * 2 * 2
    )  # each pair's instruction and the dropped caption, each with both views of its control
    Image.open(pairs / "control" / "0001.png").transpose(Image.Transpose.ROTATE_90).save(pairs / "control" / "0001.png")
    train(
        make_config(
            **edit_settings(
                base,
                pairs,
                tmp_path / "again",
                cache__text=True,
                cache__dir=str(tmp_path / "cache"),
                train__max_steps=1,
                data__random_flip=True,
            )
        )
    )
    assert len(set((tmp_path / "cache" / "text").rglob("*.safetensors")) - text) == 4  # that pair's, again


def test_an_edit_plus_adapter_edits_in_its_pipeline_as_in_ours(edit_bases, pairs, make_config, tmp_path):
    """Trained on pairs with a preview prompt carrying two controls and validation on held-out pairs: the adapter,
    loaded by QwenImageEditPlusPipeline with the same controls (sized as trained), draws what `difftune sample
    --control` and the run's own samples draw."""
    base = edit_bases["qwen_image_edit_plus"]
    write_pair_folder(tmp_path / "held-out", recolor_pairs(2, seed=9))
    controls = [str(pairs / "control" / "0000.png"), str(pairs / "control" / "0003.png")]
    settings = edit_settings(
        base,
        pairs,
        tmp_path / "run",
        train__max_steps=4,
        optim__learning_rate=2e-2,
        sample__prompts=[{"prompt": "make it purple", "controls": controls}],
        sample__steps=4,
        sample__guidance_scale=3.0,
        sample__negative_prompt=" ",
        sample__before=True,
        validation__path=str(tmp_path / "held-out"),
        validation__every_steps=2,
    )
    result = train(make_config(**settings))
    assert all(np.isfinite(row["val_loss"]) for row in read_metrics(tmp_path / "run") if "val_loss" in row)
    grid = Image.open(tmp_path / "run" / "samples" / "grid.png")
    assert grid.width == 4 * 64 and grid.height > 64  # control 1, control 2 | before | after, labelled above

    assert (
        main(
            [
                "sample",
                "--base",
                str(base),
                "--adapter",
                str(result.trained_path),
                "--prompt",
                "make it purple",
                "--control",
                controls[0],
                "--control",
                controls[1],
                "--steps",
                "4",
                "--guidance-scale",
                "3.0",
                "--negative-prompt",
                " ",
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

    family = FAMILIES["qwen_image_edit_plus"]
    pipeline = family.pipeline_class.from_pretrained(base, dtype=torch.float32)
    pipeline.load_lora_weights(str(result.trained_path.parent), weight_name=result.trained_path.name)
    pipeline.scheduler = family.drawing.sampler("auto").from_config(pipeline.scheduler.config)
    pipeline.set_progress_bar_config(disable=True)
    plus_module.VAE_IMAGE_SIZE, kept = 32 * 32, plus_module.VAE_IMAGE_SIZE  # what control_resolution = 0 asks at 32 px
    try:

        def draw(**arguments):
            return pipeline(
                image=[Image.open(c).convert("RGB") for c in controls],
                prompt="make it purple",
                negative_prompt=" ",
                true_cfg_scale=3.0,
                num_inference_steps=4,
                height=32,
                width=32,
                generator=torch.Generator("cpu").manual_seed(0),
                **arguments,
            ).images[0]

        theirs, adapted = draw(), draw(output_type="latent")
        pipeline.unload_lora_weights()
        untouched = draw(output_type="latent")
    finally:
        plus_module.VAE_IMAGE_SIZE = kept
    assert np.abs(ours - np.asarray(theirs, dtype=np.int16)).max() <= 2
    assert (adapted - untouched).abs().max() > 0.05  # the adapter changes the edit (the micro decoder blurs it)

    export.merge_into_folder(str(base), [(result.trained_path, 1.0)], tmp_path / "merged")
    assert "QwenImageEditPlusPipeline" in (tmp_path / "merged" / "model_index.json").read_text()
    assert {key.split(".")[0] for key in load_file(result.trained_path)} == {"transformer"}


def test_edit_bases_refuse_prompts_without_controls_and_too_many(edit_bases, pairs, make_config, tmp_path, capsys):
    base = edit_bases["qwen_image_edit"]
    with pytest.raises(
        DifftuneError, match=r"'make it red' has no control image; Qwen-Image-Edit pipelines draw only edits"
    ):
        train(make_config(**edit_settings(base, pairs, tmp_path / "run", sample__prompts=["make it red"])))
    control = str(pairs / "control" / "0002.png")
    assert (
        main(
            [
                "sample",
                "--base",
                str(base),
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
    with pytest.raises(DifftuneError, match="prior.num_class_images: Qwen-Image-Edit pipelines draw only edits"):
        train(
            make_config(
                **edit_settings(
                    base, pairs, tmp_path / "run", prior__num_class_images=2, prior__class_prompt="a circle"
                )
            )
        )
