"""Krea 2 beyond the conformance suite: its prompt layout against the pipeline's, the cache that keeps real tokens
alone, the noise levels of its own shift rule, and its original module names against diffusers' reader of
original-layout LoRAs (the Krea 2 reference trainer's and ComfyUI's files, which `difftune sample` / `merge` read)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import Krea2Pipeline
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_krea2_lora_to_diffusers
from safetensors.torch import load_file, save_file

from difftune.adapters import export
from difftune.adapters.files import module_names_of
from difftune.config import ModelConfig
from difftune.families import FAMILIES, load_components
from difftune.families.krea2 import PROMPT_PREFIX, PROMPT_SUFFIX, SUFFIX_TOKENS, TEMPLATE_TOKENS, original_name
from difftune.training.train import train

FAMILY = FAMILIES["krea2"]
PROMPTS = ["a red circle", "a blue square with a longer caption"]


@pytest.fixture(scope="module")
def base(micro_base):
    return micro_base("krea2", seed=2)


def test_the_prompt_layout_is_the_pipelines(base):
    pipeline = Krea2Pipeline.from_pretrained(base, dtype=torch.float32)
    assert (pipeline.prompt_template_encode_prefix, pipeline.prompt_template_encode_suffix) == (
        PROMPT_PREFIX,
        PROMPT_SUFFIX,
    )
    assert pipeline.prompt_template_encode_start_idx == TEMPLATE_TOKENS
    assert pipeline.prompt_template_encode_num_suffix_tokens == SUFFIX_TOKENS
    assert len(pipeline.tokenizer(PROMPT_PREFIX).input_ids) == TEMPLATE_TOKENS
    assert len(pipeline.tokenizer(PROMPT_SUFFIX).input_ids) == SUFFIX_TOKENS


def test_the_cache_keeps_real_tokens_and_trains_as_the_whole_layout(base):
    """A cached entry is the caption's and the suffix's tokens alone; restored, the padding sits between them again,
    zeroed: the transformer masks it, so it predicts exactly what it predicts from the pipeline's states."""
    components = load_components(ModelConfig(base=str(base)))
    with torch.no_grad():
        conditioning = FAMILY.conditioning.encode_prompts(
            components, FAMILY.conditioning.tokenize(components.tokenizers, PROMPTS)
        )
        restored = [
            FAMILY.conditioning.uncached_conditioning(
                FAMILY.conditioning.cached_conditioning({k: v[i] for k, v in conditioning.items()})
            )
            for i in range(len(PROMPTS))
        ]
        stored = FAMILY.conditioning.cached_conditioning({k: v[0] for k, v in conditioning.items()})
        assert len(stored["text_mask"]) == int(conditioning["text_mask"][0].sum()) < 40
        again = {key: torch.stack([entry[key] for entry in restored]) for key in conditioning}
        assert torch.equal(again["text_mask"], conditioning["text_mask"])
        valid = conditioning["text_mask"].bool()
        assert torch.equal(again["encoder_hidden_states"][valid], conditioning["encoder_hidden_states"][valid])
        assert not again["encoder_hidden_states"][~valid].any()
        noisy, timesteps = (
            torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(0)),
            torch.tensor([300.0, 800.0]),
        )
        assert torch.equal(
            FAMILY.denoise(components, noisy, timesteps, again, None),
            FAMILY.denoise(components, noisy, timesteps, conditioning, None),
        )


def test_noise_levels_follow_the_pipelines_shift(base):
    """The pipeline's mu from the token count (up to 6400 tokens); the few-step distilled checkpoint's fixed 1.15. What
    the pipeline asks its scheduler for is read back from the sigmas it samples with."""
    components = load_components(ModelConfig(base=str(base)))
    pipeline = components.pipeline()
    pipeline.set_progress_bar_config(disable=True)
    pipeline("a red circle", height=64, width=64, num_inference_steps=4, guidance_scale=0.0, output_type="latent")
    plain = torch.linspace(1.0, 0.25, 4)
    shift = FAMILY.objective.resolution_shift(components, (64 // pipeline.vae_scale_factor // 2) ** 2)
    torch.testing.assert_close(pipeline.scheduler.sigmas[:4], shift * plain / (1 + (shift - 1) * plain))
    components.pipeline_options["is_distilled"] = True
    assert FAMILY.objective.resolution_shift(components, 16) == pytest.approx(math.exp(1.15))


def test_original_names_are_diffusers_readers(base):
    """Every module the default targets adapt has an original name, and diffusers' reader of original-layout files
    places it back on the same module."""
    components = load_components(ModelConfig(base=str(base)))
    adapted = [
        name
        for name in module_names_of(components).names["transformer"]
        if any(name == t or name.endswith("." + t) for t in FAMILY.targets.default_targets["transformer"])
    ]
    assert len(adapted) > 20 and all(original_name(name) for name in adapted)
    theirs = _convert_non_diffusers_krea2_lora_to_diffusers(
        {f"diffusion_model.{original_name(name)}.lora_A.weight": torch.zeros(1) for name in adapted}
    )
    assert set(theirs) == {f"transformer.{name}.lora_A.weight" for name in adapted}


def test_an_original_layout_file_is_read_as_the_same_adapter(base, make_config, tmp_path):
    """The kohya layout names the original modules (`lora_unet_blocks_0_attn_wq`, what ComfyUI maps); a file in the
    reference trainer's layout (`diffusion_model.blocks.0.attn.wq.lora_A.weight`) draws what difftune's own does."""
    settings = {
        "model__base": str(base),
        "train__output_dir": str(tmp_path / "run"),
        "train__max_steps": 3,
        "optim__learning_rate": 2e-2,
        "sample__prompts": [],
        "adapter__text_encoder": False,
    }
    trained_path = train(make_config(**settings)).trained_path
    trained = load_file(trained_path)
    kohya = load_file(export.convert_adapter(trained_path, tmp_path / "kohya.safetensors", "kohya"))
    assert torch.equal(
        kohya["lora_unet_blocks_0_attn_wq.lora_down.weight"],
        trained["transformer.transformer_blocks.0.attn.to_q.lora_A.weight"],
    )
    assert "lora_unet_txtfusion_refiner_blocks_0_attn_gate.lora_up.weight" in kohya and "lora_unet_first.alpha" in kohya
    original = {}
    for key, value in trained.items():
        module, kind = key.removeprefix("transformer.").rsplit(".lora_", 1)
        original[f"diffusion_model.{original_name(module)}.lora_{kind}"] = value
    save_file(original, tmp_path / "original.safetensors")
    drawn = []
    for path in (trained_path, tmp_path / "original.safetensors", None):  # None: the base alone
        components = load_components(ModelConfig(base=str(base)))
        export.apply_adapters(components, [(path, 1.0)] if path else [])
        pipeline = components.pipeline()
        pipeline.set_progress_bar_config(disable=True)
        drawn.append(
            pipeline(
                "a purple circle",
                height=32,
                width=32,
                num_inference_steps=2,
                guidance_scale=0.0,
                output_type="latent",
                generator=torch.Generator().manual_seed(0),
            ).images.numpy()
        )
    assert np.abs(drawn[0] - drawn[1]).max() < 1e-5 < 1e-2 < np.abs(drawn[0] - drawn[2]).max()
