"""LTX-2 against its own pipeline beyond the conformance suite: the transformer fed as `LTX2Pipeline`'s loop feeds it
(with the streams apart, as a video run trains it), a video run leaving the audio stream's weights as they were, the
resolution shift over a clip's tokens as the pipeline's `calculate_shift`, and Lightricks' trainer's
`diffusion_model.` files read as diffusers' LTX-2 reader reads them."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ltx2_lora_to_diffusers
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift
from safetensors.torch import save_file
from transformer_lora import kohya_modules_read_back, trained_and_merged

from difftune.adapters.files import read_adapter
from difftune.config import LossConfig, ModelConfig
from difftune.families import FAMILIES, load_components
from difftune.families.common.flow import shifted
from difftune.families.common.objective import draw_fractions
from difftune.families.ltx2 import original_name

FAMILY = FAMILIES["ltx2"]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("ltx2"))


def first_transformer_call(components, **arguments) -> dict:
    """What `LTX2Pipeline`'s loop passes its transformer first when it draws "a purple circle" unguided (one call of
    one sample), a 9-frame 32 px clip in 2 steps (one step of a terminal-shifted schedule is 0 / 0 in diffusers);
    `arguments` join the pipeline's call."""
    pipeline = components.pipeline()
    pipeline.set_progress_bar_config(disable=True)
    calls = []
    hook = pipeline.transformer.register_forward_pre_hook(
        lambda _, args, kwargs: calls.append(kwargs), with_kwargs=True
    )
    pipeline(
        prompt="a purple circle",
        height=32,
        width=32,
        num_frames=9,
        num_inference_steps=2,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        **FAMILY.drawing.sampling_arguments(components, 1.0, "") | arguments,
    )
    hook.remove()
    return calls[0]


def test_the_transformer_runs_as_the_pipeline_calls_it_with_the_streams_apart(base):
    """What `LTX2Pipeline`'s loop passes its transformer (packed latents of a 9-frame clip, positions at its frame
    rate, the connectors' states and mask, the time), called with the streams isolated, is difftune's `denoise` of the
    same latents unpacked, to 1e-5; isolated, the video prediction does not depend on the audio stream's input, and
    joined it does (what isolation keeps out)."""
    components = load_components(ModelConfig(base=base))
    transformer = components.denoiser
    call = first_transformer_call(components)
    frames, height, width = call["num_frames"], call["height"], call["width"]
    assert (frames, height, width) == (3, 8, 8)  # 4x in time and space
    with torch.no_grad():
        apart = dict(call, isolate_modalities=True)
        expected = transformer(**apart)[0]
        latents = LTX2Pipeline._unpack_latents(call["hidden_states"], frames, height, width)
        conditioning = {
            "encoder_hidden_states": call["encoder_hidden_states"],
            "text_mask": call["encoder_attention_mask"],
        }
        ours = FAMILY.denoise(components, latents, call["timestep"], conditioning, None)
        torch.testing.assert_close(LTX2Pipeline._pack_latents(ours), expected, rtol=0, atol=1e-5)

        other_audio = torch.randn_like(call["audio_hidden_states"])
        assert torch.equal(transformer(**apart | {"audio_hidden_states": other_audio})[0], expected)
        joined = transformer(**call)[0]
        assert not torch.allclose(transformer(**call | {"audio_hidden_states": other_audio})[0], joined)


def test_a_video_run_adapts_the_video_stream_and_leaves_the_audio_stream_as_it_was(make_config, base, tmp_path):
    """The adapters sit on each block's video self-attention, cross-attention and feed-forward alone: after a run, the
    merged transformer's audio stream and the layers between the streams are the base's to the bit, its video
    layers are not; the kohya file names them by the original model's names."""
    trained, merged = trained_and_merged(make_config, base, tmp_path)
    before = LTX2VideoTransformer3DModel.from_pretrained(base, subfolder="transformer").state_dict()
    after = LTX2VideoTransformer3DModel.from_pretrained(merged, subfolder="transformer").state_dict()
    changed = {key for key in before if not torch.equal(before[key], after[key])}
    assert changed and all(".attn1." in key or ".attn2." in key or ".ff." in key for key in changed)
    assert not any("audio" in key for key in changed)
    modules = kohya_modules_read_back(trained, tmp_path)
    assert {"lora_unet_transformer_blocks_0_attn1_to_q", "lora_unet_transformer_blocks_0_ff_net_2"} <= modules
    assert not any("audio" in module for module in modules)


def test_a_clips_noise_levels_shift_by_all_its_tokens_as_the_pipeline_samples_it(base):
    """`loss.flow_shift_by_resolution`: a clip of 7 latent frames of 16 x 24 (2688 tokens) draws its noise levels
    with the shift `LTX2Pipeline` samples it with (exp of `calculate_shift` over the packed sequence), not a frame's."""
    components = load_components(ModelConfig(base=base))
    config = LossConfig(flow_shift_by_resolution=True)
    clip = torch.zeros(1, 8, 7, 16, 24)
    sigmas = FAMILY.objective.draw_timesteps_and_noise(components, [torch.Generator().manual_seed(3)], clip, config)[0]
    scheduler = components.noise_scheduler.config
    mu = calculate_shift(
        7 * 16 * 24,
        scheduler["base_image_seq_len"],
        scheduler["max_image_seq_len"],
        scheduler["base_shift"],
        scheduler["max_shift"],
    )
    expected = shifted(draw_fractions([torch.Generator().manual_seed(3)], config), math.exp(mu)) * 1000
    torch.testing.assert_close(sigmas, expected)
    frame_mu = calculate_shift(16 * 24, 1024, 4096, 0.95, 2.05)
    assert not torch.allclose(sigmas, shifted(draw_fractions([torch.Generator().manual_seed(3)], config), frame_mu))


def test_lightricks_trainer_files_read_as_diffusers_reader_reads_them(base, tmp_path):
    """A peft-style file under the original names after `diffusion_model.` (Lightricks' trainer's, ComfyUI's) is read
    as `LTX2Pipeline`'s loader converts it: each tensor at the module `original_name` maps back from."""
    components = load_components(ModelConfig(base=base))
    modules = ["transformer_blocks.0.attn1.to_q", "transformer_blocks.0.attn2.to_out.0", "proj_in"]
    assert original_name("proj_in") == "patchify_proj"
    rank, tensors = 2, {}
    for module in modules:
        layer = components.denoiser.get_submodule(module)
        tensors[f"diffusion_model.{original_name(module)}.lora_A.weight"] = torch.randn(rank, layer.in_features)
        tensors[f"diffusion_model.{original_name(module)}.lora_B.weight"] = torch.randn(layer.out_features, rank)
    path = tmp_path / "lightricks.safetensors"
    save_file(tensors, path)
    read, configs, _ = read_adapter(path)
    expected = _convert_non_diffusers_ltx2_lora_to_diffusers(dict(tensors))
    assert set(expected) == {f"transformer.{module}.lora_{ab}.weight" for module in modules for ab in "AB"}
    assert set(read) == set(expected) and all(torch.equal(read[key], expected[key]) for key in expected)
    assert configs["transformer.r"] == rank
