"""MiniMax-H3 (`MiniMaxH3ModularPipeline`'s text-to-video workflow): difftune's packed sequence denoises as the
pipeline's own loop does, step for step, video and sound each at its own schedule's level; a clip's sound is encoded
as the pipeline encodes a sound (each side mono, the posterior's mean, normalised, channel-major rows); a run with sound
trains both streams, a silent clip's sound masked; clips at another rate than 24 fps are refused by name; samples
carry their sound."""

from __future__ import annotations

import av
import numpy as np
import pytest
import torch

from difftune.config import ModelConfig
from difftune.data.clips import FrameWindows
from difftune.data.sound import read_sound
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components
from difftune.families.minimax_h3 import sound_levels
from difftune.models.autoencoders import encode_posterior
from difftune.models.autoencoders import latent_frames as counted
from difftune.training.metrics import read_metrics
from difftune.training.train import train

from test_families import their_pipeline
from test_ltx2_sound import frames_of, write_clip_with_sound

FAMILY = FAMILIES["minimax_h3"]
RATE = 32000  # the audio autoencoder's


def tone(seconds: float, hz: float) -> np.ndarray:
    t = np.arange(round(seconds * RATE)) / RATE
    return np.stack([0.5 * np.sin(2 * np.pi * hz * t), 0.3 * np.sin(2 * np.pi * 2 * hz * t)]).astype(np.float32)


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("minimax_h3"))


def test_clips_are_cut_to_the_lengths_its_autoencoder_takes(base):
    """17n + 5 frames (5n + 2 latent frames), as the pipeline aligns a frame count; shorter: one frame."""
    windows = FrameWindows((4, 5, 21, 22, 40), "head", frame_multiple=17, shortest=5)
    assert windows.windows(40) == [(0, 1), (0, 5), (0, 22), (0, 39)]
    components = load_components(ModelConfig(base=base))
    with torch.no_grad():
        for frames, latent_frames in ((1, 1), (5, 2), (22, 7), (39, 12)):
            pixels = torch.zeros(1, 3, frames, 32, 32) if frames > 1 else torch.zeros(1, 3, 32, 32)
            mean, _ = encode_posterior(components.vae, pixels)
            assert (mean.shape[2] if frames > 1 else 1) == counted(components.vae, frames) == latent_frames


def test_the_pipelines_loop_is_difftunes_prediction_step_for_step(base):
    """Three steps of the pipeline (two model evaluations, video at shift 12 and sound at shift 3) from the same noise
    are Euler steps of difftune's `predict` at the levels `sound_levels` pairs: the same latents and sound rows."""
    components = load_components(ModelConfig(base=base))
    pipeline = their_pipeline(FAMILY, base)
    pipeline.set_progress_bar_config(disable=True)
    latents = torch.randn(1, 8, 37, 8, 8, generator=torch.Generator().manual_seed(1))  # 124 frames at 32 px
    sound = torch.randn(2, 8, 207, generator=torch.Generator().manual_seed(2))  # 124 / 24 s at 40 a second
    theirs = pipeline(
        prompt="a purple circle",
        height=32,
        width=32,
        num_frames=124,
        num_inference_steps=3,
        latents=latents,
        audio_latents=sound,
        output=["latents", "audio_latents"],
    )
    tokens = FAMILY.conditioning.tokenize(components.tokenizers, ["a purple circle"])
    with torch.no_grad():
        conditioning = FAMILY.conditioning.encode_prompts(components, tokens)
        video, rows = latents.clone(), sound.transpose(1, 2).reshape(1, -1, 8)  # channel-major rows
        video_sigmas = pipeline.scheduler.sigmas
        for step in range(2):
            timesteps = video_sigmas[step : step + 1] * 1000
            levels = sound_levels(components, timesteps)
            assert torch.allclose(levels / 1000, pipeline.audio_scheduler.sigmas[step : step + 1], atol=1e-6)
            predicted, heard = FAMILY.predict(components, video, rows, timesteps, levels, conditioning)
            video = video + (video_sigmas[step + 1] - video_sigmas[step]) * predicted
            audio_sigmas = pipeline.audio_scheduler.sigmas
            rows = rows + (audio_sigmas[step + 1] - audio_sigmas[step]) * heard
    torch.testing.assert_close(video, theirs["latents"], rtol=0, atol=2e-5)
    torch.testing.assert_close(rows[0].reshape(2, 207, 8).transpose(1, 2), theirs["audio_latents"], rtol=0, atol=2e-5)


def test_a_clips_sound_is_encoded_as_the_pipeline_encodes_a_sound(base, tmp_path):
    """Each side through the mono audio autoencoder (the posterior's mean), normalised, as channel-major rows, as
    the pipeline's reference step encodes a soundtrack; as many latents a side as the pipeline makes for the window's
    frames; a clip without sound is silence, marked unheard."""
    components = load_components(ModelConfig(base=base, family_options={"sound": True}))
    audio_vae = components.pixel_encoders["audio_vae"]
    write_clip_with_sound(tmp_path / "a.mkv", frames_of(22, 40), 24, tone(22 / 24, 440), RATE)
    write_clip_with_sound(tmp_path / "b.mkv", frames_of(22, 90), 24, None)
    with torch.no_grad():
        got = FAMILY.conditioning.sound_conditioning(
            components, [(tmp_path / "a.mkv", (0, 22)), (tmp_path / "b.mkv", (0, 22))]
        )
        assert got["sound_latents"].shape == (2, 2 * 37, 8)  # round(22 / 24 x 40) = 37 a side
        assert got["sound_heard"].tolist() == [1.0, 0.0]
        waveform, _ = read_sound(tmp_path / "a.mkv", 0, 22, RATE)
        latents = audio_vae.encode(waveform[:, None]).latent_dist.mode().float().transpose(1, 2)[:, :37]
        mean = torch.tensor(audio_vae.config.latents_mean).view(1, 1, -1)
        std = torch.tensor(audio_vae.config.latents_std).view(1, 1, -1)
        expected = ((latents - mean) / std).reshape(-1, 8)  # the pipeline's recipe (its reference encoder step)
    torch.testing.assert_close(got["sound_latents"][0], expected, rtol=0, atol=1e-6)


def _clips(folder, rate=24):
    folder.mkdir()
    for i, (shade, hz) in enumerate(((40, 330), (90, 440), (140, None), (190, 660))):
        sound = None if hz is None else tone(22 / rate, hz)
        write_clip_with_sound(folder / f"{i}.mkv", frames_of(22, shade), rate, sound, RATE)
        (folder / f"{i}.txt").write_text(f"a clip {i}")
    return folder


def test_a_run_with_sound_trains_both_streams_and_masks_silence(base, make_config, tmp_path):
    """Sound on: clips of 22 frames with their sound (one silent) train; the loss moves, and is the video's error plus
    the heard sound's. The same run without sound trains the video alone."""
    data = _clips(tmp_path / "clips")
    settings = {
        "model__base": base,
        "data__path": str(data),
        "data__target_frames": [22],
        "train__max_steps": 2,
        "train__batch_size": 2,
        "sample__prompts": [],
        "cache__latents": True,
    }
    with_sound = train(
        make_config(**settings, model__family_options={"sound": True}, train__output_dir=str(tmp_path / "sound"))
    )
    alone = train(make_config(**settings, train__output_dir=str(tmp_path / "video")))
    assert all(np.isfinite(with_sound.losses)) and all(np.isfinite(alone.losses))
    assert with_sound.losses != alone.losses
    assert [row["step"] for row in read_metrics(tmp_path / "sound") if "loss" in row] == [1, 2]


def test_clips_at_another_rate_are_refused_by_name(base, make_config, tmp_path):
    data = _clips(tmp_path / "clips", rate=25)
    config = make_config(
        model__base=base,
        model__family_options={"sound": True},
        data__path=str(data),
        data__target_frames=[22],
        train__max_steps=1,
        sample__prompts=[],
        cache__latents=True,
        train__output_dir=str(tmp_path / "run"),
    )
    with pytest.raises(DifftuneError, match=r"0\.mkv: runs at 25 fps; MiniMax-H3 places sound and video by 24"):
        train(config)


def test_samples_are_clips_with_their_sound_and_lengths_out_of_range_are_refused(base, make_config, tmp_path):
    """A 5 s sample clip's mp4 carries the pipeline's sound (decoded: a stereo track as long as the frames); a clip of
    other than 5-15 s is refused before training."""
    settings = {
        "model__base": base,
        "train__max_steps": 1,
        "sample__prompts": ["a purple circle"],
        "sample__steps": 2,
        "sample__frames": 120,
        "sample__resolution": 32,
    }
    result = train(make_config(**settings, train__output_dir=str(tmp_path / "run")))
    (clip,) = (result.trained_path.parent / "samples").glob("000*.mp4")
    with av.open(str(clip)) as container:
        (audio,) = container.streams.audio
        samples = sum(frame.samples for frame in container.decode(audio))
        assert audio.channels == 2 and abs(samples / audio.rate - 124 / 24) < 0.1
    with pytest.raises(DifftuneError, match=r"sample\.frames = 60: MiniMax-H3 draws clips of 5 to 15 seconds"):
        train(make_config(**settings | {"sample__frames": 60}, train__output_dir=str(tmp_path / "short")))
