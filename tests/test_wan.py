"""Wan 2.1 beyond the conformance suite: its prediction read as the pipeline's sampler reads it, images trained as
one-frame clips, its schedule's shift, and its original module names against diffusers' readers of the original
layout (musubi-tuner's `lora_unet_` files, ComfyUI's and other trainers' `diffusion_model.` ones)."""

from __future__ import annotations

import pytest
import torch
from diffusers import UniPCMultistepScheduler
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers
from safetensors.torch import load_file, save_file

from difftune import export
from difftune.adapter_files import module_names_of, placed_on_base, read_adapter
from difftune.config import ModelConfig
from difftune.families import FAMILIES, load_components
from difftune.toy.tiny import build_pipeline
from difftune.train import train

FAMILY = FAMILIES["wan"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("micro-wan")
    build_pipeline(seed=2, family="wan").save_pretrained(path, safe_serialization=True)
    return str(path)


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
    states = torch.randn(2, 512, components.text_encoders["text_encoder"].config.d_model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        v = FAMILY.denoise(components, noisy, torch.full((2,), sigma * 1000), {"encoder_hidden_states": states}, None)
        clip = FAMILY.denoise(components, noisy[:, :, None], torch.full((2,), sigma * 1000), {"encoder_hidden_states": states}, None)
    torch.testing.assert_close(clip[:, :, 0], v)
    x0 = scheduler.convert_model_output(v[:, :, None], sample=noisy[:, :, None])[:, :, 0]
    torch.testing.assert_close(x0, noisy - sigma * v)


def test_original_names_are_diffusers_readers(make_config, base, tmp_path):
    """The kohya file is musubi-tuner's (`lora_unet_blocks_0_self_attn_q`, which diffusers reads: the conformance
    suite renders it); the same tensors under the original model's dotted names after `diffusion_model.` are what
    diffusers' reader of those files maps back to difftune's modules, and difftune reads that file as its own."""
    trained = train(make_config(model__base=base, train__output_dir=str(tmp_path / "run"), train__max_steps=2,
                                optim__learning_rate=2e-2, sample__prompts=[])).trained_path
    ours = load_file(trained)
    components = load_components(ModelConfig(base=base))
    adapted = {key.removeprefix("transformer.").rsplit(".lora_", 1)[0] for key in ours}
    assert len(adapted) == 2 * len(FAMILY.default_targets["transformer"])  # two blocks
    original = {f"diffusion_model.{FAMILY.original_name(module)}.lora_{kind}.weight": ours[f"transformer.{module}.lora_{kind}.weight"]
                for module in adapted for kind in "AB"}
    theirs = _convert_non_diffusers_wan_lora_to_diffusers(dict(original))
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[key], ours[key]) for key in ours)
    kohya = load_file(export.convert_adapter(trained, tmp_path / "kohya.safetensors", "kohya"))
    assert {key.rsplit(".", 2)[0] if key.endswith("weight") else key.rsplit(".", 1)[0] for key in kohya} == {
        "lora_unet_" + FAMILY.original_name(module).replace(".", "_") for module in adapted}
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
    keys = set(FAMILY.to_single_file(load_components(ModelConfig(base=base))))
    block = {f"blocks.0.{attn}.{layer}.{kind}" for attn in ("self_attn", "cross_attn") for layer in "qkvo"
             for kind in ("weight", "bias")}
    block |= {f"blocks.0.{attn}.{norm}.weight" for attn in ("self_attn", "cross_attn") for norm in ("norm_q", "norm_k")}
    block |= {f"blocks.0.{layer}.{kind}" for layer in ("norm3", "ffn.0", "ffn.2") for kind in ("weight", "bias")}
    block |= {"blocks.0.modulation"}
    outside = {f"{layer}.{kind}" for layer in ("patch_embedding", "text_embedding.0", "text_embedding.2", "time_embedding.0",
                                               "time_embedding.2", "time_projection.1", "head.head") for kind in ("weight", "bias")}
    assert {key for key in keys if not key.startswith("blocks.1.")} == block | outside | {"head.modulation"}
