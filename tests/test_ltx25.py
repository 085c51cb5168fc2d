"""LTX-2.5 (`LTX25ModularPipeline`): what the modular pipeline's loop passes its transformer is difftune's prediction
of the same latents (the streams apart, as a video run trains them, and joined, as a run with sound does); the
prompt enhancer and the duration head are left out of what a base loads; samples are drawn by the diffusion decoder,
an image the first frame of the shortest clip it draws, a clip an mp4 carrying the sound drawn beside it; a run with
sound trains the audio stream too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import LTX2Pipeline
from safetensors.torch import load_file

from difftune.config import ModelConfig, SampleConfig
from difftune.families import FAMILIES, load_components
from difftune.families.common.drawing import generate_images, save_images
from difftune.families.ltx25 import shortest_clip
from difftune.training.metrics import read_metrics
from difftune.training.train import train

from test_ltx2_sound import assert_the_mp4_carries, sound_clips, sound_run

FAMILY = FAMILIES["ltx25"]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("ltx25"))


def last_transformer_call(components) -> dict:
    """What the pipeline's loop passes its transformer at the last of 2 steps when it draws "a purple circle"
    unguided, a 9-frame 32 px clip (its latents and sound partly denoised)."""
    pipeline = FAMILY.drawing.assemble_pipeline(components)
    calls = []
    hook = pipeline.transformer.register_forward_pre_hook(
        lambda _, args, kwargs: calls.append(kwargs), with_kwargs=True
    )
    arguments = FAMILY.drawing.sampling_arguments(components, 1.0, "")
    pipeline.update_components(guider=arguments.pop("guider"), audio_guider=arguments.pop("audio_guider"))
    pipeline(
        prompt="a purple circle",
        height=32,
        width=32,
        num_frames=9,
        num_inference_steps=2,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        output="videos",
        **arguments,
    )
    hook.remove()
    assert len(calls) == 2  # unguided: one pass a step
    return calls[-1]


def test_the_transformer_runs_as_the_pipelines_loop_calls_it(base):
    """The loop's last call (packed latents, positions it computed at 24 fps, the connectors' states, the time)
    is difftune's `denoise_with_sound` of the same latents and sound to 1e-5, both predictions; called with the
    streams isolated, its video prediction is difftune's `denoise`, which a video run trains."""
    components = load_components(ModelConfig(base=base, family_options={"sound": True}))
    call = last_transformer_call(components)
    assert 0 < call["timestep"].item() < 1000
    tokens = FAMILY.conditioning.tokenize(components.tokenizers, ["a purple circle"])
    with torch.no_grad():
        encoded = FAMILY.conditioning.encode_prompts(components, tokens)
        torch.testing.assert_close(encoded["encoder_hidden_states"], call["encoder_hidden_states"])
        torch.testing.assert_close(encoded["audio_hidden_states"], call["audio_encoder_hidden_states"])
        latents = LTX2Pipeline._unpack_latents(call["hidden_states"], call["num_frames"], call["height"], call["width"])
        video, heard = components.denoiser(**call)
        rate = {"frame_rate": torch.tensor([24.0])}
        ours = FAMILY.denoise_with_sound(
            components, latents, call["audio_hidden_states"], call["timestep"], encoded | rate
        )
        torch.testing.assert_close(LTX2Pipeline._pack_latents(ours[0]), video, rtol=0, atol=1e-5)
        torch.testing.assert_close(ours[1], heard, rtol=0, atol=1e-5)

        apart = components.denoiser(**call | {"isolate_modalities": True})[0]
        alone = FAMILY.denoise(components, latents, call["timestep"], encoded, None)
        torch.testing.assert_close(LTX2Pipeline._pack_latents(alone), apart, rtol=0, atol=1e-5)
        assert not torch.allclose(apart, video, atol=1e-4)  # isolation keeps the sound out


def test_a_base_leaves_out_the_steps_training_never_runs(base):
    """Neither the prompt enhancer nor the duration head is loaded; the diffusion decoder and the vocoder are, for
    the samples."""
    components = load_components(ModelConfig(base=base))
    pipeline = FAMILY.drawing.assemble_pipeline(components)
    assert {"prompt_enhancer", "duration_head"}.isdisjoint(pipeline._component_specs)
    assert {"diffusion_decoder", "vocoder", "audio_vae"} <= set(components.drawing_parts)


def test_an_image_sample_is_the_first_frame_of_the_shortest_clip_its_decoder_draws(base):
    """The diffusion decoder's last stage spans 3 frames in the micro model (11 in LTX-2.5's): 5 frames at its 4x in
    time; an image sample is that clip's first frame, the same seed drawing the same clip."""
    components = load_components(ModelConfig(base=base))
    pipeline = FAMILY.drawing.assemble_pipeline(components)
    assert shortest_clip(pipeline) == 5
    config = SampleConfig(prompts=["a red square"], steps=2, resolution=32)
    [image] = generate_images(components, config, torch.device("cpu"))
    [clip] = generate_images(components, config.model_copy(update={"frames": 5}), torch.device("cpu"))
    assert len(clip.clip) == 5
    assert np.array_equal(np.asarray(image.image), np.asarray(clip.clip[0]))


def test_a_sample_clip_carries_the_sound_drawn_beside_its_frames(base, tmp_path):
    """An mp4 of the frames at 24 a second with an AAC track at the vocoder's rate holding the drawn waveform."""
    components = load_components(ModelConfig(base=base))
    config = SampleConfig(prompts=["a red square"], frames=9, steps=2, resolution=32)
    [sample] = generate_images(components, config, torch.device("cpu"))
    drawn = sample.clip.sound
    assert drawn.rate == components.drawing_parts["vocoder"].config.output_sampling_rate
    assert np.sqrt((drawn.samples**2).mean()) > 1e-3
    assert_the_mp4_carries(save_images([sample], config, tmp_path)[0], drawn, frames=9)


def test_a_run_with_sound_trains_the_audio_stream_too(make_config, base, tmp_path):
    """Clips with sound, cached with it: the adapters sit on the audio stream and the attention between the streams
    as well as the video stream, and each moved from its start (B at zero)."""
    config = sound_run(make_config, base, sound_clips(tmp_path / "clips"), tmp_path / "run", train__max_steps=3)
    result = train(config)
    adapter = load_file(result.trained_path)
    for layer in ("attn1", "audio_attn1", "audio_to_video_attn", "video_to_audio_attn", "audio_ff.net.0.proj"):
        moved = [key for key in adapter if f".{layer}." in key and "lora_B" in key]
        assert moved and all(adapter[key].abs().max() > 0 for key in moved), layer
    losses = [row["loss"] for row in read_metrics(tmp_path / "run") if "loss" in row]
    assert len(losses) == 3 and all(np.isfinite(losses))
