"""Textual inversion (`adapter.kind = "embedding"`): new tokens learned alone, written as A1111/ComfyUI embeddings
that diffusers' `load_textual_inversion` reads."""

import json

import pytest
import torch
from diffusers import StableDiffusionPipeline
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from difftune.adapters.embeddings import TOKEN_METADATA_KEY, caption_with_token
from difftune.config import AdapterConfig, ModelConfig
from difftune.errors import DifftuneError
from difftune.families import load_components
from difftune.training.metrics import read_metrics
from difftune.training.train import train

TOKEN = "<shade>"


def _job(make_config, **overrides):
    settings = {
        "adapter__kind": "embedding",
        "adapter__embedding_token": TOKEN,
        "adapter__embedding_caption_word": "red",
        "adapter__embedding_vectors": 2,
        "adapter__embedding_init_word": "blue",
        "optim__learning_rate": 5e-2,
        "sample__prompts": [f"a {TOKEN} circle"],
        "sample__steps": 4,
    }
    return make_config(**(settings | overrides))


def test_captions_say_the_token_in_all_its_vectors():
    config = AdapterConfig(
        kind="embedding", embedding_token="<p>", embedding_vectors=3, embedding_caption_word="purple"
    )
    assert caption_with_token("a purple circle, purpleish", config) == "a <p> <p>_1 <p>_2 circle, purpleish"
    assert (
        caption_with_token("<p> on white", config.model_copy(update={"embedding_caption_word": ""}))
        == "<p> <p>_1 <p>_2 on white"
    )


def test_only_the_new_tokens_train_and_diffusers_loads_them(make_config, tiny_base, tmp_path):
    result = train(_job(make_config))
    path = tmp_path / "run" / "shade.safetensors"
    assert result.trained_path == path
    with safe_open(path, framework="pt") as handle:
        assert handle.metadata()[TOKEN_METADATA_KEY] == TOKEN
    vectors = load_file(path)["emb_params"]
    base = load_components(ModelConfig(base=str(tiny_base)))
    tokenizer, table = base.tokenizers["tokenizer"], base.text_encoders["text_encoder"].get_input_embeddings().weight
    blue = table[tokenizer("blue", add_special_tokens=False).input_ids].mean(dim=0)
    assert vectors.shape == (2, table.shape[1])
    assert not torch.allclose(vectors, blue.expand_as(vectors), atol=1e-4)  # trained away from the init word
    # The rest of the vocabulary is untouched, and nothing else was trained.
    trained_table = result.components.text_encoders["text_encoder"].get_input_embeddings()
    old_ids = torch.arange(table.shape[0])
    torch.testing.assert_close(trained_table(old_ids), table, rtol=0, atol=0)
    assert sum(p.numel() for p in result.optimizer.param_groups[0]["params"]) == 2 * table.shape[1]
    # diffusers reads the file as users load it, to the same vectors.
    pipeline = StableDiffusionPipeline.from_pretrained(tiny_base, safety_checker=None, dtype=torch.float32)
    pipeline.load_textual_inversion(str(path), token=TOKEN)
    ids = pipeline.tokenizer.convert_tokens_to_ids([TOKEN, f"{TOKEN}_1"])
    torch.testing.assert_close(pipeline.text_encoder.get_input_embeddings().weight[ids], vectors)
    parity = json.loads((tmp_path / "run" / "parity.json").read_text())
    assert parity["layouts"]["embedding"]["max_pixel_difference"] == 0


def test_sdxl_embeddings_have_both_encoders_vectors(make_config, tiny_sdxl_base, tmp_path):
    train(_job(make_config, model__base=str(tiny_sdxl_base), adapter__embedding_vectors=1, sample__prompts=[]))
    tensors = load_file(tmp_path / "run" / "shade.safetensors")
    components = load_components(ModelConfig(base=str(tiny_sdxl_base)))
    widths = [
        components.text_encoders[name].get_input_embeddings().weight.shape[1]
        for name in ("text_encoder", "text_encoder_2")
    ]
    assert {key: tuple(value.shape) for key, value in tensors.items()} == {
        "clip_l": (1, widths[0]),
        "clip_g": (1, widths[1]),
    }


def test_an_embedding_run_resumes_exactly(make_config, tmp_path):
    settings = {"checkpoint__every_steps": 2, "sample__prompts": [], "adapter__embedding_init_word": ""}
    train(_job(make_config, train__max_steps=4, train__output_dir=str(tmp_path / "whole"), **settings))
    train(_job(make_config, train__max_steps=2, train__output_dir=str(tmp_path / "parts"), **settings))
    train(_job(make_config, train__max_steps=4, train__output_dir=str(tmp_path / "parts"), **settings), resume="auto")
    assert [r["loss"] for r in read_metrics(tmp_path / "parts")] == [
        r["loss"] for r in read_metrics(tmp_path / "whole")
    ]
    assert torch.equal(
        load_file(tmp_path / "parts" / "shade.safetensors")["emb_params"],
        load_file(tmp_path / "whole" / "shade.safetensors")["emb_params"],
    )


def test_embedding_mistakes_are_named(make_config):
    # The tiny tokenizer spells words by characters: a letter is a token it knows.
    with pytest.raises(DifftuneError, match="'a' is already a token of tokenizer"):
        train(_job(make_config, adapter__embedding_token="a"))
    with pytest.raises(DifftuneError, match="embedding_caption_word 'mauve' is in none of them"):
        train(_job(make_config, adapter__embedding_caption_word="mauve"))
    with pytest.raises(DifftuneError, match="cache.text needs"):
        _job(make_config, cache__text=True)


def test_merging_an_embedding_teaches_the_saved_model_its_token(make_config, tiny_base, tmp_path, capsys):
    from difftune.cli import main

    train(_job(make_config, sample__prompts=[]))
    embedding = tmp_path / "run" / "shade.safetensors"
    assert (
        main(["merge", "--base", str(tiny_base), "--adapter", str(embedding), "--out", str(tmp_path / "merged")]) == 0
    )
    merged = load_components(ModelConfig(base=str(tmp_path / "merged")))
    ids = merged.tokenizers["tokenizer"].convert_tokens_to_ids([TOKEN, f"{TOKEN}_1"])
    torch.testing.assert_close(
        merged.text_encoders["text_encoder"].get_input_embeddings().weight[ids], load_file(embedding)["emb_params"]
    )
    # There is no other layout to convert it to; the error says what the file is.
    assert main(["convert", str(embedding), str(tmp_path / "x.safetensors"), "--to", "kohya"]) == 2
    assert "a textual-inversion embedding (emb_params), not a LoRA" in capsys.readouterr().err


def test_diffusers_layout_embeddings_merge_sample_and_eval(tiny_base, tiny_sdxl_base, tmp_path, capsys):
    """`{token: vectors}`, what diffusers' textual-inversion script saves: the token is the key. Checked against
    diffusers' own `load_textual_inversion` of the same file; it went down the LoRA path before ("cannot place key")."""
    from difftune.cli import main

    path = tmp_path / "learned_embeds.safetensors"
    vectors = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    save_file({"<cat-toy>": vectors}, path, metadata={"format": "pt"})
    pipeline = StableDiffusionPipeline.from_pretrained(tiny_base, safety_checker=None, dtype=torch.float32)
    pipeline.load_textual_inversion(str(path))
    tokens = ["<cat-toy>", "<cat-toy>_1"]
    theirs = pipeline.text_encoder.get_input_embeddings().weight[pipeline.tokenizer.convert_tokens_to_ids(tokens)]

    assert main(["merge", "--base", str(tiny_base), "--adapter", str(path), "--out", str(tmp_path / "merged")]) == 0
    merged = load_components(ModelConfig(base=str(tmp_path / "merged")))
    ours = (
        merged.text_encoders["text_encoder"]
        .get_input_embeddings()
        .weight[merged.tokenizers["tokenizer"].convert_tokens_to_ids(tokens)]
    )
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    torch.testing.assert_close(ours, vectors, rtol=0, atol=0)
    assert (
        main(
            [
                "sample",
                "--base",
                str(tiny_base),
                "--adapter",
                str(path),
                "--prompt",
                "a <cat-toy> circle",
                "--steps",
                "2",
                "--resolution",
                "32",
                "--out",
                str(tmp_path / "samples"),
            ]
        )
        == 0
    )
    assert (tmp_path / "samples" / "000.png").is_file()
    report = tmp_path / "eval.json"
    assert (
        main(
            [
                "eval",
                "--base",
                str(tiny_base),
                "--adapter",
                str(path),
                "--concept-word",
                "<cat-toy>",
                "--samples-per-prompt",
                "1",
                "--steps",
                "2",
                "--out",
                str(report),
            ]
        )
        == 0
    )
    assert "after" in json.loads(report.read_text())

    capsys.readouterr()
    assert main(["merge", "--base", str(tiny_sdxl_base), "--adapter", str(path), "--out", str(tmp_path / "xl")]) == 2
    assert (
        "holds one text encoder's vectors, and this Stable Diffusion XL base has 2 text encoders"
        in capsys.readouterr().err
    )
    wide = tmp_path / "wide.safetensors"
    save_file({"<wide>": torch.zeros(1, 768)}, wide)
    assert main(["merge", "--base", str(tiny_base), "--adapter", str(wide), "--out", str(tmp_path / "w")]) == 2
    assert (
        "'emb_params' vectors are 768 wide, but this base's text_encoder embeds tokens in 64" in capsys.readouterr().err
    )
