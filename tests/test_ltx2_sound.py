"""LTX-2 trained on clips with sound (`model.family_options.sound`): the sound read under a window, its log-mel
spectrogram against transformers' reference `spectrogram`, its latents as `LTX2Pipeline` packs and normalises the
`audio_latents` it is given, both streams run joined as the pipeline's loop calls its transformer, a run's loss the
two streams' mean errors summed (Lightricks' trainer's), its adapters on the audio stream, and the refusals."""

from __future__ import annotations

import math

import av
import numpy as np
import pytest
import torch
from diffusers import LTX2Pipeline
from PIL import Image
from safetensors.torch import load_file
from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

from difftune.config import DataConfig, ModelConfig, SampleConfig
from difftune.data.cache_folders import read_tensors
from difftune.data.clips import FrameWindows, Sound, write_clip
from difftune.data.dataset import TrainingOrder, batch_groups, frame_counts, frame_rates, scan_examples
from difftune.data.sound import log_mel_spectrogram, read_sound
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components
from difftune.families.common.drawing import generate_images, save_images
from difftune.training.metrics import read_metrics
from difftune.training.train import train
from difftune.training.validation import Validator

from test_ltx2 import first_transformer_call

FAMILY = FAMILIES["ltx2"]
RATE = 16000  # the audio autoencoder's, and the clips'


def write_clip_with_sound(path, frames: list[Image.Image], fps: int, sound: np.ndarray | None, sample_rate: int = RATE):
    """Frames (lossless FFV1) and `sound` (channels, samples) in [-1, 1] as 16-bit PCM, in one Matroska file; no
    audio stream where `sound` is None."""
    return write_clip(path, frames, fps, lossless=True, sound=None if sound is None else Sound(sound, sample_rate))


def tones(seconds: float, left_hz: float, right_hz: float) -> np.ndarray:
    """Two sines of rising loudness, (2, samples) at `RATE`."""
    t = np.arange(round(seconds * RATE)) / RATE
    return np.stack([0.5 * np.sin(2 * np.pi * left_hz * t) * t, 0.3 * np.sin(2 * np.pi * right_hz * t)]).astype(
        np.float32
    )


def frames_of(count: int, shade: int) -> list[Image.Image]:
    return [Image.new("RGB", (32, 32), (shade, 8 * i, 255 - shade)) for i in range(count)]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("ltx2"))


def test_the_log_mel_spectrogram_is_transformers_reference_of_lightricks_front_end():
    """16 kHz stereo at LTX-2's settings (64 Slaney mel bins to 8 kHz, hop 160, 1024-sample Hann window, magnitudes,
    log floored at 1e-5) equals transformers' numpy `spectrogram` with `mel_filter_bank` to 1e-4, per channel."""
    waveforms = torch.randn(2, 2, RATE + 37, generator=torch.Generator().manual_seed(0)) * 0.3
    ours = log_mel_spectrogram(waveforms, RATE, 160, 64)
    assert ours.shape == (2, 2, (RATE + 37) // 160 + 1, 64)
    filters = mel_filter_bank(513, 64, 0.0, 8000.0, RATE, norm="slaney", mel_scale="slaney")
    for item, channels in zip(ours, waveforms, strict=True):
        for spectrum, waveform in zip(item, channels, strict=True):
            reference = spectrogram(
                waveform.double().numpy(),
                window_function(1024, "hann"),
                frame_length=1024,
                hop_length=160,
                power=1.0,
                mel_filters=filters,
                mel_floor=1e-5,
                log_mel="log",
                dtype=np.float64,
            )
            np.testing.assert_allclose(spectrum.double().numpy(), reference.T, rtol=0, atol=1e-4)


def test_a_windows_sound_is_the_sound_under_its_frames(tmp_path):
    """Frames 6 to 18 of a 24 fps clip hold its sound from 0.25 s to 0.75 s (to 16-bit rounding); a mono clip's
    channel is on both sides as it was; a window past the sound's end is padded with silence; a silent clip has none."""
    sound = tones(1.0, 440, 220)
    clip = write_clip_with_sound(tmp_path / "clip.mkv", frames_of(24, 0), 24, sound)
    waveform, fps = read_sound(clip, 6, 12, RATE)
    assert fps == 24 and waveform.shape == (2, 8000)
    np.testing.assert_allclose(waveform.numpy(), sound[:, 4000:12000], rtol=0, atol=1e-4)

    mono = write_clip_with_sound(tmp_path / "mono.mkv", frames_of(30, 0), 24, sound[:1])
    waveform, _ = read_sound(mono, 20, 10, RATE)  # 0.83 s to 1.25 s: 1 s of sound
    np.testing.assert_allclose(waveform[0, :2667].numpy(), sound[0, 13333:], rtol=0, atol=1e-4)
    assert torch.equal(waveform[0], waveform[1]) and not waveform[:, 2667:].any()

    assert read_sound(write_clip_with_sound(tmp_path / "silent.mkv", frames_of(9, 0), 24, None), 0, 9, RATE) is None


def test_a_clips_sound_is_resampled_to_the_autoencoders_rate(tmp_path):
    """A 48 kHz clip's sound is read at 16 kHz: one second's samples, each side's tone at its pitch and loudness."""
    t = np.arange(48000) / 48000
    sound = np.stack([0.5 * np.sin(2 * np.pi * 440 * t), 0.25 * np.sin(2 * np.pi * 1000 * t)]).astype(np.float32)
    clip = write_clip_with_sound(tmp_path / "clip.mkv", frames_of(24, 0), 24, sound, sample_rate=48000)
    waveform, _ = read_sound(clip, 0, 24, RATE)
    assert waveform.shape == (2, RATE)
    spectrum = np.abs(np.fft.rfft(waveform[:, 1000:-1000].numpy(), axis=1))
    peaks = spectrum.argmax(axis=1) * RATE / (RATE - 2000)
    np.testing.assert_allclose(peaks, [440, 1000], atol=2)
    np.testing.assert_allclose(waveform[:, 1000:-1000].abs().amax(dim=1).numpy(), [0.5, 0.25], atol=0.01)


def test_the_streams_joined_run_as_the_pipeline_calls_them(base, tmp_path):
    """A clip's sound latents are what `LTX2Pipeline` makes of the audio autoencoder's latents handed to it as
    `audio_latents` (packed, normalised); what its loop passes its transformer, streams joined, is difftune's
    `denoise_with_sound` of the same latents, both predictions to 1e-5, with the audio stream's caption states
    difftune's `encode_prompts` makes."""
    components = load_components(ModelConfig(base=base, family_options={"sound": True}))
    audio_vae = components.pixel_encoders["audio_vae"]
    clip = write_clip_with_sound(tmp_path / "clip.mkv", frames_of(9, 40), 24, tones(9 / 24, 440, 660))
    sound = FAMILY.conditioning.sound_conditioning(components, [(clip, (0, 9))])
    assert sound["frame_rate"].tolist() == [24.0]
    spectrogram_ = log_mel_spectrogram(read_sound(clip, 0, 9, RATE)[0][None], RATE, 160, audio_vae.config.mel_bins)
    # noise_scale 0: the first call's audio latents are those given, packed and normalised
    call = first_transformer_call(components, audio_latents=audio_vae.encode(spectrogram_).latent_dist.mode())
    torch.testing.assert_close(call["audio_hidden_states"], sound["sound_latents"], rtol=0, atol=1e-6)

    tokens = FAMILY.conditioning.tokenize(components.tokenizers, ["a purple circle"])
    with torch.no_grad():
        encoded = FAMILY.conditioning.encode_prompts(components, tokens)
        torch.testing.assert_close(encoded["audio_hidden_states"], call["audio_encoder_hidden_states"])
        video, heard = components.denoiser(**call)
        latents = LTX2Pipeline._unpack_latents(call["hidden_states"], call["num_frames"], call["height"], call["width"])
        ours = FAMILY.denoise_with_sound(
            components, latents, call["audio_hidden_states"], call["timestep"], encoded | sound
        )
    torch.testing.assert_close(LTX2Pipeline._pack_latents(ours[0]), video, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours[1], heard, rtol=0, atol=1e-5)


def sound_clips(folder, count: int = 4, frames: int = 9):
    """`count` captioned clips with two tones each."""
    folder.mkdir()
    for i in range(count):
        write_clip_with_sound(
            folder / f"{i}.mkv", frames_of(frames, 60 * i), 24, tones(frames / 24, 200 + 100 * i, 500)
        )
        (folder / f"{i}.txt").write_text(f"a clip with tone {i}")
    return folder


def sound_run(make_config, base, data, out, **overrides):
    settings = {
        "model__base": base,
        "model__family_options": {"sound": True},
        "data__path": str(data),
        "data__target_frames": [9],
        "cache__latents": True,
        "cache__text": True,
        "cache__dir": str(out / "cache"),
        "train__output_dir": str(out),
        "sample__prompts": [],
    }
    return make_config(**settings | overrides)


def test_a_run_with_sound_trains_both_streams(make_config, base, tmp_path):
    """A run with sound caches each window's sound latents beside its posterior (what `sound_conditioning` makes of
    the clip); its adapters sit on the audio stream and the attention between the streams too, and train there; its
    loss is the video's mean squared error plus the sound's, from the transformer called with both streams joined."""
    config = sound_run(make_config, base, sound_clips(tmp_path / "clips"), tmp_path / "run", train__max_steps=2)
    result = train(config)
    components = load_components(ModelConfig(base=base, family_options={"sound": True}))
    entries = sorted((tmp_path / "run" / "cache").rglob("*.safetensors"))
    cached = [read_tensors(entry) for entry in entries]
    with_sound = [entry for entry in cached if "sound_latents" in entry]
    assert len(with_sound) >= 4
    expected = FAMILY.conditioning.sound_conditioning(
        components, [(tmp_path / "clips" / f"{i}.mkv", (0, 9)) for i in range(4)]
    )
    found = {tuple(entry["sound_latents"].flatten()[:4].tolist()) for entry in with_sound}
    assert {tuple(latents.flatten()[:4].tolist()) for latents in expected["sound_latents"]} <= found

    tensors = load_file(result.trained_path)
    for layer in ("audio_attn1.to_q", "audio_ff.net.2", "audio_to_video_attn.to_k", "video_to_audio_attn.to_v"):
        assert f"transformer.transformer_blocks.0.{layer}.lora_B.weight" in tensors
    assert tensors["transformer.transformer_blocks.0.audio_attn1.to_q.lora_B.weight"].abs().max() > 0

    # The loss of one batch, against the transformer called by hand as the pipeline calls it.
    latents = torch.randn(2, 8, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    sound = expected["sound_latents"][:2]
    tokens = FAMILY.conditioning.tokenize(components.tokenizers, ["a clip with tone 0", "a clip with tone 1"])
    with torch.no_grad():
        conditioning = FAMILY.conditioning.encode_prompts(components, tokens) | {
            "frame_rate": expected["frame_rate"][:2]
        }
        generators = [torch.Generator().manual_seed(seed) for seed in (5, 6)]
        timesteps = torch.tensor([300.0, 800.0])
        noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(2))
        conditioning |= FAMILY.objective.stream_noise(
            components, generators, latents, conditioning | {"sound_latents": sound}
        )
        conditioning["sound_latents"] = sound
        loss = FAMILY.objective.loss(components, latents, timesteps, noise, conditioning, None, config.loss)
        sigma = (timesteps / 1000).view(-1, 1, 1)
        sound_noise = conditioning["sound_noise"]
        video, heard = components.denoiser(
            hidden_states=LTX2Pipeline._pack_latents(
                (1 - sigma[..., None, None]) * latents + sigma[..., None, None] * noise
            ),
            audio_hidden_states=(1 - sigma) * sound + sigma * sound_noise,
            encoder_hidden_states=conditioning["encoder_hidden_states"],
            audio_encoder_hidden_states=conditioning["audio_hidden_states"],
            timestep=timesteps,
            sigma=timesteps,
            encoder_attention_mask=conditioning["text_mask"],
            audio_encoder_attention_mask=conditioning["text_mask"],
            num_frames=3,
            height=8,
            width=8,
            fps=24.0,
            audio_num_frames=sound.shape[1],
            use_cross_timestep=True,
            return_dict=False,
        )
    video_error = (video - LTX2Pipeline._pack_latents(noise - latents)).square().mean(dim=(1, 2))
    sound_error = (heard - (sound_noise - sound)).square().mean(dim=(1, 2))
    torch.testing.assert_close(loss, video_error + sound_error, rtol=1e-5, atol=1e-6)


def test_clips_at_several_frame_rates_train_with_their_sound_in_batches_of_one_rate(make_config, base, tmp_path):
    """A window of 9 frames lasts 0.375 s at 24 fps and 0.3 s at 30: its sound has another length, and the transformer
    places a batch's video at one rate. Batches and cache chunks are cut by rate (`frame_rates`, the containers'
    headers), so a folder that mixes rates trains; images and one-rate folders batch as before."""
    clips = sound_clips(tmp_path / "clips", count=4)
    for i in (4, 5):  # two more at 30 fps
        write_clip_with_sound(clips / f"{i}.mkv", frames_of(9, 30 * i), 30, tones(9 / 30, 300 + 50 * i, 700))
        (clips / f"{i}.txt").write_text(f"a fast clip {i}")
    examples, _ = scan_examples(DataConfig(path=str(clips), target_frames=[9]), windows=FrameWindows((9,)))
    rates = frame_rates(examples)
    assert sorted(rates) == [24.0] * 4 + [30.0] * 2
    sizes = [(32, 32)] * len(examples)
    groups = batch_groups(sizes, [()] * len(examples), False, frame_counts(examples), rates)
    order = iter(TrainingOrder(len(examples), 2, seed=0, buckets=groups))
    for _ in range(12):
        assert len({rates[index] for _, index in next(order)}) == 1
    assert batch_groups(sizes, [()] * len(examples), False, frame_counts(examples), [24.0] * len(examples)) is None

    train(sound_run(make_config, base, clips, tmp_path / "run", train__max_steps=6, train__batch_size=2))
    lengths = {
        read_tensors(entry)["sound_latents"].shape[0]
        for entry in (tmp_path / "run" / "cache").rglob("*.safetensors")
        if "sound_latents" in read_tensors(entry)
    }
    assert len(lengths) == 2  # each rate's windows hold their own length of sound


def test_a_run_with_sound_refuses_what_it_cannot_train(make_config, base, tmp_path):
    """Sound needs the latent cache (refused before any work), and a clip in every example: an image is named."""
    clips = sound_clips(tmp_path / "clips", count=2)
    with pytest.raises(DifftuneError, match=r"model.family_options.sound: cache.latents must be on"):
        train(sound_run(make_config, base, clips, tmp_path / "uncached", cache__latents=False))
    frames_of(1, 100)[0].save(clips / "still.png")
    (clips / "still.txt").write_text("a still image")
    with pytest.raises(DifftuneError, match=r"still.png: is an image; model.family_options.sound"):
        train(sound_run(make_config, base, clips, tmp_path / "run"))


def test_a_silent_clip_trains_its_frames_its_sounds_error_masked(make_config, base, tmp_path):
    """A clip without an audio stream trains beside sounding ones: cached with digital silence as long as its window
    (a sounding window's tokens), marked unheard; its sound's error is left out of its loss, its video's kept."""
    clips = sound_clips(tmp_path / "clips", count=2)
    write_clip_with_sound(clips / "silent.mkv", frames_of(9, 200), 24, None)
    (clips / "silent.txt").write_text("a silent clip")
    config = sound_run(make_config, base, clips, tmp_path / "run", train__max_steps=2)
    train(config)
    cached = [read_tensors(entry) for entry in (tmp_path / "run" / "cache").rglob("*.safetensors")]
    cached = [entry for entry in cached if "sound_latents" in entry]
    assert sorted(float(entry["sound_heard"]) for entry in cached).count(0.0) >= 1
    assert len({entry["sound_latents"].shape for entry in cached}) == 1

    components = load_components(ModelConfig(base=base, family_options={"sound": True}))
    sounds = FAMILY.conditioning.sound_conditioning(
        components, [(clips / "0.mkv", (0, 9)), (clips / "silent.mkv", (0, 9))]
    )
    assert sounds["sound_heard"].tolist() == [1.0, 0.0]
    latents = torch.randn(2, 8, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    tokens = FAMILY.conditioning.tokenize(components.tokenizers, ["a clip with tone 0", "a silent clip"])
    timesteps = torch.tensor([300.0, 800.0])
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        conditioning = FAMILY.conditioning.encode_prompts(components, tokens) | sounds
        generators = [torch.Generator().manual_seed(seed) for seed in (5, 6)]
        conditioning |= FAMILY.objective.stream_noise(components, generators, latents, conditioning)
        masked = FAMILY.objective.loss(components, latents, timesteps, noise, conditioning, None, config.loss)
        heard = conditioning | {"sound_heard": torch.ones(2)}
        both = FAMILY.objective.loss(components, latents, timesteps, noise, heard, None, config.loss)
        noisy = FAMILY.objective.noised(components, latents, timesteps, noise)
        sound_noise = conditioning["sound_noise"]
        noisy_sound = FAMILY.objective.noised(components, sounds["sound_latents"], timesteps, sound_noise)
        video, _ = FAMILY.denoise_with_sound(components, noisy, noisy_sound, timesteps, conditioning)
    assert masked[0] == both[0] and masked[1] < both[1]
    video_error = (video - (noise - latents)).square().mean(dim=(1, 2, 3, 4))
    torch.testing.assert_close(masked[1], video_error[1], rtol=1e-5, atol=1e-6)


def test_the_validation_loss_counts_a_clips_sound(make_config, base, tmp_path):
    """A run with sound scores its held-out clips' sound beside their frames: each clip's sound as the cache holds it
    (a silent one's marked unheard), logged as the run goes, and the loss moves with the sound."""
    held_out = sound_clips(tmp_path / "held_out", count=2)
    write_clip_with_sound(held_out / "silent.mkv", frames_of(9, 200), 24, None)
    (held_out / "silent.txt").write_text("a silent clip")
    config = sound_run(
        make_config,
        base,
        sound_clips(tmp_path / "clips", count=2),
        tmp_path / "run",
        validation__path=str(held_out),
        validation__every_steps=1,
        train__max_steps=1,
    )
    train(config)
    assert [math.isfinite(row["val_loss"]) for row in read_metrics(tmp_path / "run") if "val_loss" in row] == [True]

    components = load_components(ModelConfig(base=base, family_options={"sound": True}))
    validator = Validator(components, config, torch.device("cpu"))
    [group] = validator.groups  # three clips of one length and rate, each at every validation timestep
    expected = FAMILY.conditioning.sound_conditioning(components, [(held_out / "0.mkv", (0, 9))])
    assert any(torch.equal(row, expected["sound_latents"][0]) for row in group["from_pixels"]["sound_latents"])
    assert sorted(set(group["from_pixels"]["sound_heard"].tolist())) == [0.0, 1.0]
    loss = validator.loss(components)
    group["from_pixels"]["sound_latents"] = torch.zeros_like(group["from_pixels"]["sound_latents"])
    assert abs(validator.loss(components) - loss) > 1e-4


def test_a_sample_carries_the_sound_drawn_beside_its_frames(base, tmp_path):
    """A sample clip is an mp4 with the pipeline's sound: its frames at the rate they were drawn for (24, whatever
    `sample.fps` says of silent clips), its track at the vocoder's rate holding the waveform the pipeline drew (AAC,
    so compared by energy, not sample by sample)."""
    components = load_components(ModelConfig(base=base))
    config = SampleConfig(prompts=["a red square"], frames=9, steps=2, resolution=32, fps=4)
    [sample] = generate_images(components, config, torch.device("cpu"))
    drawn = sample.clip.sound
    assert drawn.rate == components.drawing_parts["vocoder"].config.output_sampling_rate
    assert np.sqrt((drawn.samples**2).mean()) > 1e-3
    assert_the_mp4_carries(save_images([sample], config, tmp_path)[0], drawn, frames=9)


def assert_the_mp4_carries(path, drawn: Sound, frames: int) -> None:
    """`path` is an mp4 of `frames` frames at 24 a second with an AAC track of the `drawn` sound: at its rate and
    channels, its energy the waveform's (AAC does not keep samples)."""
    assert path.suffix == ".mp4"
    with av.open(str(path)) as container:
        video = container.streams.video[0]
        assert video.average_rate == 24 and sum(1 for _ in container.decode(video)) == frames
    with av.open(str(path)) as container:
        track = container.streams.audio[0]
        assert (track.rate, track.channels) == (drawn.rate, len(drawn.samples))
        decoded = np.concatenate([frame.to_ndarray() for frame in container.decode(track)], axis=1)
    # AAC adds its silent priming and pads its last frame (at most three frames of 1024 samples more): the track's
    # energy is the waveform's
    assert 0 <= decoded.shape[1] - drawn.samples.shape[1] <= 3 * 1024
    assert (decoded**2).sum() == pytest.approx((drawn.samples**2).sum(), rel=0.15)


def test_the_plan_counts_the_sound_stream(make_config, base, tmp_path):
    """A run with sound plans both streams joined, as it trains them: more activations than the same run on the video
    alone; the sound planned is as many tokens as the pipeline gives a clip of the same frames at its 24 per second,
    within one of what training encodes of such a window."""
    from difftune.training import plan

    clips = sound_clips(tmp_path / "clips", count=2)
    with_sound = sound_run(make_config, base, clips, tmp_path / "run")
    video_alone = sound_run(make_config, base, clips, tmp_path / "run", model__family_options={})

    def step_activations(config) -> int:  # the training phase's (a CPU plan's phases hold the step's split)
        return plan.plan_memory(config, "cpu").host_phases["training"]["activations and gradients"]

    assert step_activations(with_sound) > step_activations(video_alone)

    planned_tokens = []
    joined = FAMILY.denoise_with_sound

    def counted(components, noisy, noisy_sound, timesteps, conditioning):
        planned_tokens.append(noisy_sound.shape[1])
        return joined(components, noisy, noisy_sound, timesteps, conditioning)

    FAMILY.denoise_with_sound = counted
    try:
        plan.plan_memory(with_sound, "cpu")
    finally:
        del FAMILY.denoise_with_sound
    components = load_components(ModelConfig(base=base, family_options={"sound": True}))
    window = FAMILY.conditioning.sound_conditioning(components, [(clips / "0.mkv", (0, 9))])  # 24 fps clips
    # The pipeline's count (duration x 25 tokens a second, rounded: 9); the encoder's causal frames give one more.
    [tokens] = planned_tokens
    assert tokens == round(9 / 24 * 25) and abs(tokens - window["sound_latents"].shape[1]) <= 1
