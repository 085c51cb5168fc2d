"""Qwen-Image beyond the conformance suite (tests/test_families.py): its template, its autoencoder's per-channel
latents, its refusals, and the LoRA layouts other trainers share."""

import pytest
import torch
from diffusers import QwenImagePipeline
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_qwen_lora_to_diffusers
from safetensors.torch import load_file, save_file

from difftune.adapters import export
from difftune.config import ModelConfig
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components
from difftune.families.qwen_image import PROMPT_TEMPLATE, TEMPLATE_TOKENS
from difftune.families.qwen_image.micro import build_qwen_tokenizer
from difftune.models.autoencoders import decode_latents, encode_latents, latent_normalization
from difftune.toy.tiny import COLORS
from difftune.training.train import train

QWEN = FAMILIES["qwen_image"]


@pytest.fixture(scope="module")
def qwen_base(micro_base):
    return micro_base("qwen_image")


def test_the_template_is_the_pipelines_and_its_system_prompt_is_dropped(qwen_base):
    pipeline = QwenImagePipeline.from_pretrained(qwen_base)
    assert (pipeline.prompt_template_encode, pipeline.prompt_template_encode_start_idx) == (
        PROMPT_TEMPLATE,
        TEMPLATE_TOKENS,
    )
    tokenizer = build_qwen_tokenizer()
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(PROMPT_TEMPLATE.format("a red circle")).input_ids)
    # The micro tokenizer spells the system prompt in 34 tokens as Qwen2.5-VL's does: what is kept starts at the
    # caption.
    assert tokens[TEMPLATE_TOKENS - 3 : TEMPLATE_TOKENS] == ["<|im_start|>", "user", "Ċ"]
    assert tokens[TEMPLATE_TOKENS] == "a"


def test_the_tiny_bases_tokenizer_spells_each_caption_word_in_one_token_keeping_every_id():
    """models/tiny-qwen_image's tokenizer (`caption_words`): a token per caption word, the held-out color's too, as a
    real vocabulary has; the byte-level one spells "purple" ending in the "e" that "blue" ends in. Appended: the
    template's words and the bytes keep their ids, and the system prompt is still the 34 tokens the pipeline drops."""
    plain, words = build_qwen_tokenizer(), build_qwen_tokenizer(caption_words=True)
    vocab = words.get_vocab()
    assert all(vocab[token] == i for token, i in plain.get_vocab().items())
    assert len(words(PROMPT_TEMPLATE.split("{}")[0]).input_ids) == TEMPLATE_TOKENS
    assert words.tokenize("a purple square") == ["a", "Ġpurple", "Ġsquare"]
    assert plain.tokenize("a purple square")[-6:] == ["Ġs", "q", "u", "a", "r", "e"]
    assert {words.tokenize(f"a {color} circle")[1] for color in COLORS} == {f"Ġ{color}" for color in COLORS}


def test_latents_are_normalised_per_channel_as_the_pipeline_inverts_them(qwen_base):
    vae = load_components(ModelConfig(base=str(qwen_base))).vae
    pixels = torch.rand(2, 3, 32, 32) * 2 - 1
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    latents = encode_latents(vae, pixels, generators)
    mean, std = (
        torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1),
        torch.tensor(vae.config.latents_std).view(1, -1, 1, 1),
    )
    posterior = vae.encode(pixels[:, :, None]).latent_dist
    eps = torch.stack(
        [torch.randn(posterior.mean.shape[1:], generator=torch.Generator().manual_seed(i)) for i in range(2)]
    )
    sample = (posterior.mean + posterior.std * eps)[:, :, 0]
    torch.testing.assert_close(latents, (sample - mean) / std, rtol=1e-5, atol=1e-5)
    assert latent_normalization(vae).scale != latent_normalization(vae).scale[:1] * 16  # per channel
    # QwenImagePipeline's own decoding of the same latents (`latents / latents_std + latents_mean`, one frame).
    theirs = vae.decode((latents * std + mean)[:, :, None]).sample[:, :, 0]
    torch.testing.assert_close(decode_latents(vae, latents), theirs, rtol=1e-5, atol=1e-5)


def test_settings_qwen_image_cannot_train_with_are_refused(make_config, qwen_base, tmp_path):
    with pytest.raises(DifftuneError, match=r"adapter.text_encoder: QwenImagePipeline's LoRA loader reads transformer"):
        train(make_config(model__base=str(qwen_base), adapter__text_encoder=True))
    with pytest.raises(DifftuneError, match=r"loss.weighting = \"min_snr\""):
        train(make_config(model__base=str(qwen_base), adapter__text_encoder=False, loss__weighting="min_snr"))
    single = tmp_path / "qwen_image_transformer.safetensors"
    save_file({"model.diffusion_model.transformer_blocks.0.img_mod.1.weight": torch.zeros(1)}, single)
    with pytest.raises(DifftuneError, match=r"holds the transformer alone; set model.single_file_config"):
        load_components(ModelConfig(base=str(single)))


def test_the_layouts_other_trainers_share_are_read_as_ours(make_config, qwen_base, tmp_path):
    """Our kohya file is musubi-tuner's layout (`lora_unet_<module>`, what ComfyUI maps), and diffusers' own reader of
    it names exactly our diffusers keys; ai-toolkit's and ComfyUI's `diffusion_model.` files and SimpleTuner's
    `lycoris_` ones read as the same adapter."""
    result = train(
        make_config(
            model__base=str(qwen_base),
            adapter__text_encoder=False,
            train__max_steps=2,
            adapter__rank=4,
            adapter__alpha=8,
            sample__prompts=[],
        )
    )
    ours = load_file(result.trained_path)
    kohya = load_file(export.convert_adapter(result.trained_path, tmp_path / "kohya.safetensors", "kohya"))
    assert "lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight" in kohya
    assert "lora_unet_transformer_blocks_0_img_mlp_net_0_proj.lora_up.weight" in kohya
    # The diffusers-layout file holds alpha / rank (2) in its lora_B and says alpha = rank: so does its conversion.
    assert float(kohya["lora_unet_transformer_blocks_0_attn_to_q.alpha"]) == 4.0
    assert torch.equal(
        kohya["lora_unet_transformer_blocks_0_attn_to_q.lora_up.weight"],
        ours["transformer.transformer_blocks.0.attn.to_q.lora_B.weight"],
    )
    theirs = _convert_non_diffusers_qwen_lora_to_diffusers(dict(kohya))
    # diffusers folds alpha / rank into the factors; the keys are ours.
    assert set(theirs) == set(ours)

    ai_toolkit = {key.replace("transformer.", "diffusion_model.", 1): value for key, value in ours.items()}
    save_file(ai_toolkit, tmp_path / "ai_toolkit.safetensors")
    tensors, configs, _ = export.read_any_adapter(tmp_path / "ai_toolkit.safetensors", str(qwen_base))
    assert tensors.keys() == ours.keys() and all(torch.equal(tensors[key], ours[key]) for key in ours)
    assert configs["transformer.r"] == 4

    # SimpleTuner's LyCORIS files name the same modules `lycoris_<module>` (ComfyUI maps them beside lora_unet_).
    simpletuner = {key.replace("lora_unet_", "lycoris_", 1): value for key, value in kohya.items()}
    save_file(simpletuner, tmp_path / "simpletuner.safetensors")
    tensors, configs, _ = export.read_any_adapter(tmp_path / "simpletuner.safetensors", str(qwen_base))
    assert tensors.keys() == ours.keys() and all(torch.equal(tensors[key], ours[key]) for key in ours)
    assert (configs["transformer.r"], configs["transformer.lora_alpha"]) == (4, 4)


def test_text_cache_entries_keep_the_caption_and_read_back_as_encoded(make_config, qwen_base, tmp_path):
    """An entry holds the caption's valid states alone (not 512 padded rows: 7 MB each on the real model); read
    back, it is what `encode_prompts` made, padding and mask included. In a cache of its own: the user's may hold the
    entries already (a run of this test before), and then there is nothing to fill."""
    from difftune.data.cache import fill_text, text_entries, text_identity
    from difftune.data.dataset import Prompt

    config = make_config(
        model__base=str(qwen_base), adapter__text_encoder=False, cache__text=True, cache__dir=str(tmp_path / "cache")
    )
    components = load_components(config.model)
    prompts = {Prompt("a red circle"), Prompt("a blue square with a long caption that runs on")}
    tokenize = lambda captions: QWEN.conditioning.tokenize(components.tokenizers, captions)  # noqa: E731
    entries = text_entries(prompts, text_identity(components), config, tokenize)
    assert fill_text(entries, components, torch.device("cpu"), config) == 2
    for (caption, *_), path in entries.items():
        stored = load_file(path)
        with torch.no_grad():
            encoded = QWEN.conditioning.encode_prompts(components, tokenize([caption]))
        valid = int(encoded["text_mask"].sum())
        assert stored["encoder_hidden_states"].shape[0] == stored["text_mask"].shape[0] == valid < 100  # of 512
        restored = QWEN.conditioning.uncached_conditioning(stored)
        assert restored.keys() == encoded.keys()
        for name in encoded:
            torch.testing.assert_close(restored[name], encoded[name][0].to(restored[name].dtype), rtol=1e-6, atol=1e-6)


def test_a_full_fine_tune_trains_the_text_encoder_it_saves(make_config, qwen_base):
    """`adapter.text_encoder` is refused for adapters (their loader drops it) but trains the language model in a full
    fine-tune, whose pipeline folder keeps it (how the tiny base was trained)."""
    result = train(
        make_config(
            model__base=str(qwen_base),
            adapter__kind="none",
            adapter__text_encoder=True,
            train__max_steps=2,
            sample__prompts=[],
        )
    )
    before = QwenImagePipeline.from_pretrained(qwen_base).text_encoder.state_dict()
    after = QwenImagePipeline.from_pretrained(result.trained_path).text_encoder.state_dict()
    changed = [key for key in before if not torch.equal(before[key], after[key])]
    assert any("language_model.layers.0" in key for key in changed)
    assert not any("visual" in key for key in changed)  # the vision tower never runs for text
