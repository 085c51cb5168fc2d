"""ACE-Step, the first family that is not pictures: sound files as data, a training step as its pipeline denoises,
its own trainer's files read, samples written as FLAC. The conformance suite (test_families.py) runs it as every
family; this file checks what only a sound base has."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from difftune.adapters import export
from difftune.config import DataConfig, ModelConfig
from difftune.data.clips import Sound
from difftune.data.dataset import scan_examples
from difftune.data.sound_files import (
    SoundWindows,
    read_sound_file,
    read_tags,
    read_window,
    sound_length,
    spectrogram_picture,
    write_sound,
)
from difftune.families import FAMILIES, load_components
from difftune.families.ace_step import split_lyrics
from difftune.families.ace_step.micro import DOWNSAMPLING, SAMPLE_RATE
from difftune.toy.tiny import shape_images, write_caption_folder
from difftune.toy.tiny_sound_base import reconstruction_loss, tone_batch
from difftune.toy.tone_judge import judge_tone
from difftune.toy.tones import HEARD_PITCHES, PITCHES, TIMBRES, render_tone, tone_sounds, write_sound_folder
from difftune.training.train import train

from test_families import MICRO_SECONDS, _ace_step_prompts, _settings

FAMILY = FAMILIES["ace_step"]
HOP = math.prod(DOWNSAMPLING)  # samples a latent frame


def _tone(seconds: float, rate: int = SAMPLE_RATE, pitch: float = PITCHES["middle"]) -> Sound:
    return render_tone(pitch, "hum", seconds, rate, np.random.default_rng(0))


def test_a_sound_file_gives_whole_windows_back_to_back_and_a_short_one_one_padded_window(tmp_path):
    windows = SoundWindows(SAMPLE_RATE, seconds=1.0, samples_per_latent=128)
    assert windows.length == 6400  # 50 latent frames
    assert windows.windows(6400 * 2 + 1000) == [(0, 6400), (6400, 6400)]  # the rest after the last is not read
    assert windows.windows(1000) == [(0, 6400)]
    assert SoundWindows(SAMPLE_RATE, seconds=0.99, samples_per_latent=128).length == 6400  # whole frames, as drawn
    assert SoundWindows(SAMPLE_RATE, seconds=0.985, samples_per_latent=128).length == 6400

    # A file at another rate is read resampled to the autoencoder's; past its end, silence.
    path = write_sound(tmp_path / "short.flac", _tone(0.5, rate=16000))
    assert sound_length(path, SAMPLE_RATE) == 3200
    window = read_window(path, (0, 6400), SAMPLE_RATE)
    assert window.shape == (2, 1, 6400)
    assert window[:, :, :3000].abs().max() > 0.1 and not window[:, :, 3400:].any()


def test_a_sound_base_trains_sounds_and_reports_the_rest(tmp_path):
    folder = tmp_path / "mixed"
    write_sound_folder(folder, tone_sounds(3, seed=0, seconds=2.5, rate=SAMPLE_RATE))
    write_caption_folder(folder / "images", shape_images(2, seed=0))
    for image in (folder / "images").iterdir():
        image.rename(folder / f"image_{image.name}")
    (folder / "broken.wav").write_bytes(b"RIFF not a sound")
    (folder / "broken.txt").write_text("a broken sound")
    data = DataConfig(path=str(folder))
    windows = SoundWindows(SAMPLE_RATE, seconds=1.0, samples_per_latent=128)
    examples, bad = scan_examples(data, windows=windows)
    assert len(examples) == 3 * 2  # each 2.5 s tone: two whole 1 s windows
    assert {example.frames for example in examples} == {(0, 6400), (6400, 6400)}
    assert all(example.sound_rate == SAMPLE_RATE for example in examples)
    reasons = {path.name: reason for path, reason in ((b.path, b.reason) for b in bad)}
    assert reasons["image_0000.png"].startswith("not a sound")
    assert "cannot be decoded as a sound" in reasons["broken.wav"]
    # A picture base reports the sounds, naming the kind of base that reads them.
    _, bad = scan_examples(data)
    assert any("a sound base such as ACE-Step" in b.reason for b in bad if b.path.suffix == ".flac")


def test_training_denoises_as_the_pipeline_does(micro_base):
    """One step of `AceStepPipeline`, guided: its transformer's inputs and output at that step are what difftune's
    conditioning and `denoise` give for the same noisy latents and time (the prompt, the context, the layout)."""
    components = load_components(
        ModelConfig(base=str(micro_base("ace_step")), family_options={"seconds": MICRO_SECONDS})
    )
    pipeline = components.pipeline()
    pipeline.set_progress_bar_config(disable=True)
    called = {}
    forward = pipeline.transformer.forward

    def kept(**inputs):
        called.update(inputs, output=forward(**inputs)[0])
        return (called["output"],)

    pipeline.transformer.forward = kept
    pipeline(prompt="a high buzz", audio_duration=MICRO_SECONDS, num_inference_steps=1, guidance_scale=1.0, shift=3.0)
    with torch.no_grad():
        conditioning = FAMILY.conditioning.encoded_texts(components, ["a high buzz"], torch.device("cpu"))
        latents = called["hidden_states"].transpose(1, 2)[:, :, None]  # (B, C, 1, frames)
        ours = FAMILY.denoise(components, latents, called["timestep"] * 1000, conditioning, None)
    length = int(conditioning["text_mask"].sum())
    assert torch.equal(conditioning["encoder_hidden_states"][:, :length], called["encoder_hidden_states"])
    frames = latents.shape[-1]
    assert torch.equal(conditioning["silence"][:, :frames], called["context_latents"][..., : latents.shape[1]])
    torch.testing.assert_close(ours[:, :, 0].transpose(1, 2), called["output"], rtol=0, atol=1e-6)


def test_a_captions_lyrics_are_read_and_drawn_as_the_pipeline_reads_lyrics(micro_base):
    """Lyrics follow a `[lyrics]` line of a caption or sample prompt: encoded as `AceStepPipeline` encodes its
    `lyrics`, and drawn by passing them so."""
    text = "a low hum\n[Lyrics]\n[verse]\nla la la"
    assert split_lyrics(text) == ("a low hum", "[verse]\nla la la") and split_lyrics("a hum") == ("a hum", "")
    components = load_components(
        ModelConfig(base=str(micro_base("ace_step")), family_options={"seconds": MICRO_SECONDS})
    )
    pipeline = components.pipeline()
    pipeline.set_progress_bar_config(disable=True)
    with torch.no_grad():
        ours = FAMILY.conditioning.encoded_texts(components, [text], torch.device("cpu"))
        theirs = _ace_step_prompts(pipeline, ["a low hum"], ["[verse]\nla la la"], seconds=MICRO_SECONDS)
        without = FAMILY.conditioning.encoded_texts(components, ["a low hum"], torch.device("cpu"))
    length = theirs["encoder_hidden_states"].shape[1]
    assert torch.equal(ours["encoder_hidden_states"][:, :length], theirs["encoder_hidden_states"])
    assert int(ours["text_mask"].sum()) > int(without["text_mask"].sum())  # the lyric encoder's tokens are there
    drawing = {"num_inference_steps": 2, "guidance_scale": 1.0}
    [drawn] = FAMILY.drawing.draw_sounds(
        pipeline, components.family_options, text, generator=torch.Generator().manual_seed(0), **drawing
    )
    asked = pipeline(
        prompt="a low hum",
        lyrics="[verse]\nla la la",
        audio_duration=MICRO_SECONDS,
        generator=torch.Generator().manual_seed(0),
        **drawing,
    ).audios[0]
    assert np.array_equal(drawn.samples, asked.numpy())


def test_the_runs_tokenizer_says_its_seconds_and_pickles_for_loader_workers(micro_base):
    """The prompt's metadata says the run's window (`model.family_options.seconds`), as the pipeline's says the sound's
    duration it is asked for; the tokenizer a run hands its data-loader workers survives pickling (spawned workers)."""
    components = load_components(ModelConfig(base=str(micro_base("ace_step")), family_options={"seconds": 12.0}))
    tokenize = FAMILY.conditioning.tokenizer(components)
    again = pickle.loads(pickle.dumps(tokenize))
    assert all(torch.equal(again(["a low hum"])[key], value) for key, value in tokenize(["a low hum"]).items())
    ids = tokenize(["a low hum"])["text_encoder"][0]
    text = components.tokenizers["tokenizer"].decode(ids[ids != -1])
    assert "- duration: 12 seconds" in text and "# Caption\na low hum" in text


def test_a_dropped_caption_trains_as_the_learned_null_condition(micro_base):
    """ACE-Step's trainer replaces a dropped sample's conditioning by `null_condition_emb` (what its pipeline guides
    against): an empty caption's sequence is that embedding at each of its tokens; a caption beside it is encoded
    as alone."""
    components = load_components(
        ModelConfig(base=str(micro_base("ace_step")), family_options={"seconds": MICRO_SECONDS})
    )
    with torch.no_grad():
        both = FAMILY.conditioning.encoded_texts(components, ["", "a low hum"], torch.device("cpu"))
        alone = FAMILY.conditioning.encoded_texts(components, ["a low hum"], torch.device("cpu"))
    null = components.text_encoders["condition_encoder"].null_condition_emb[0, 0]
    length = int(both["text_mask"][0].sum())
    assert length > 0 and torch.equal(both["encoder_hidden_states"][0, :length], null.expand(length, -1))
    assert not both["encoder_hidden_states"][0, length:].any()
    torch.testing.assert_close(both["encoder_hidden_states"][1], alone["encoder_hidden_states"][0], rtol=0, atol=1e-6)


def test_ace_steps_own_trainer_files_are_read_as_ours(micro_base, make_config, tmp_path):
    """ACE-Step's trainer writes peft's names on the original modules (`base_model.model.layers.0.self_attn.q_proj`):
    such a file converts to difftune's diffusers layout as the same tensors, as diffusers' own reader reads it."""
    result = train(make_config(**_settings("ace_step", micro_base("ace_step"), tmp_path / "run", sample__prompts=[])))
    ours = load_file(result.trained_path)
    original = {
        key.replace("transformer.", "base_model.model.", 1)
        .replace(".to_q.", ".q_proj.")
        .replace(".to_k.", ".k_proj.")
        .replace(".to_v.", ".v_proj.")
        .replace(".to_out.0.", ".o_proj."): value
        for key, value in ours.items()
    }
    save_file(original, tmp_path / "adapter_model.safetensors")
    back = load_file(
        export.convert_adapter(tmp_path / "adapter_model.safetensors", tmp_path / "back.safetensors", "diffusers")
    )
    assert back.keys() == ours.keys() and all(torch.equal(back[key], ours[key]) for key in ours)


def test_samples_are_flac_with_their_prompt_and_the_grid_shows_their_spectrograms(micro_base, make_config, tmp_path):
    """A run's samples are FLAC files as long as its windows, tagged with their prompt and settings, in its card and
    parity check; `difftune sample` draws as long as the adapter trained, or `--seconds` long."""
    settings = _settings(
        "ace_step", micro_base("ace_step"), tmp_path / "run", sample__prompts=["a low hum"], sample__steps=2
    )
    result = train(make_config(**settings))
    samples = result.trained_path.parent / "samples"
    sound = read_sound_file(samples / "000.flac")
    assert sound.rate == SAMPLE_RATE and sound.samples.shape == (2, round(MICRO_SECONDS * SAMPLE_RATE))
    tags = read_tags(samples / "000.flac")
    assert (
        tags["prompt"] == "a low hum"
        and "steps=2" in tags["parameters"]
        and f"{MICRO_SECONDS:g}s@6400Hz" in tags["parameters"]
    )
    card = (result.trained_path.parent / "README.md").read_text()
    assert "pipeline_tag: text-to-audio" in card and "samples/000.flac" in card
    parity = json.loads((result.trained_path.parent / "parity.json").read_text())
    assert all(layout["max_pixel_difference"] <= 2 for layout in parity["layouts"].values())
    # `difftune sample` draws as long as the adapter's run trained, or `--seconds` long
    from difftune.cli import main

    drawn = ["sample", "--base", str(micro_base("ace_step")), "--adapter", str(result.trained_path)]
    drawn += ["--prompt", "a low hum", "--steps", "2"]
    for seconds, out in ((MICRO_SECONDS, []), (0.5, ["--seconds", "0.5"])):
        assert main([*drawn, *out, "--out", str(tmp_path / f"cli_{seconds}")]) == 0
        sound = read_sound_file(tmp_path / f"cli_{seconds}" / "000.flac")
        assert sound.samples.shape == (2, round(seconds * SAMPLE_RATE))


def test_the_ui_lists_a_jobs_sounds_and_plays_each_as_its_spectrogram_with_its_sound(micro_base, make_config, tmp_path):
    """The Train tab's draws: a sound job's FLAC samples with their prompts; a gallery shows each as an MP4 whose
    picture is its spectrogram and whose track is the sound (decoded back: as long, the same tone)."""
    from difftune.data.clips import read_frames
    from difftune.data.sound import stereo_samples
    from difftune.webui import draws
    from difftune.webui.jobs import Job

    settings = _settings("ace_step", micro_base("ace_step"), tmp_path / "job", sample__prompts=["a high buzz"])
    train(make_config(**settings))
    [drawn] = draws.draws(Job(tmp_path / "job"))
    [path] = drawn.files(Job(tmp_path / "job"))
    assert drawn.label == "trained" and path.name == "000.flac" and draws.drawn_prompt(path) == "a high buzz"
    played = draws.playable(path)
    assert played.suffix == ".mp4" and draws.playable(path) == played  # made once
    frame, picture = read_frames(played, 0, 1)[0], spectrogram_picture(read_sound_file(path))
    assert frame.size == (picture.width - picture.width % 2, picture.height)  # H.264's even sides
    # What it plays is the sound: a tone's pitch is still the loudest frequency (the 6.4 kHz sound played at 48 kHz).
    tone = write_sound(tmp_path / "tone.flac", _tone(1.0, pitch=PITCHES["high"]))
    import av

    with av.open(str(draws.playable(tone))) as container:
        heard = stereo_samples(container, SAMPLE_RATE)  # resampled back to the sound's rate
    assert abs(heard.shape[1] - SAMPLE_RATE) < 0.05 * SAMPLE_RATE  # AAC pads its frames
    spectrum = np.abs(np.fft.rfft(heard.mean(axis=0)[:SAMPLE_RATE]))
    assert abs(int(spectrum.argmax()) - PITCHES["high"]) <= 2  # in Hz (a 1 s window: 1 Hz bins)


def test_the_tone_judge_names_pitch_and_timbre_of_tones_and_no_tone_in_noise():
    """The sound bases' shapes judge, on renders: every pitch and timbre named right, at any phase and level, also under
    a little noise; noise and silence are no tone, and a pitch between the tones' is named none."""
    rng = np.random.default_rng(0)
    for pitch, hz in PITCHES.items():
        for timbre in TIMBRES:
            for _ in range(5):
                tone = render_tone(hz, timbre, 1.0, SAMPLE_RATE, rng, phase=rng.uniform(0, 2 * np.pi))
                assert judge_tone(tone) == (pitch, timbre)
                noisy = tone.samples + rng.normal(0, 0.02, tone.samples.shape).astype(np.float32)
                assert judge_tone(Sound(noisy, SAMPLE_RATE)) == (pitch, timbre)
    noise = Sound(rng.normal(0, 0.3, (2, SAMPLE_RATE)).astype(np.float32), SAMPLE_RATE)
    assert judge_tone(noise) == (None, None) and judge_tone(Sound(np.zeros((2, SAMPLE_RATE)), SAMPLE_RATE)) == (
        None,
        None,
    )
    between = render_tone(PITCHES["low"] * 1.2, "hum", 1.0, SAMPLE_RATE, rng)  # 3 semitones above low
    assert judge_tone(between) == (None, "hum")


def test_difftune_eval_judges_a_sound_base_by_its_tones(micro_base, tmp_path):
    """`difftune eval` on a sound base draws every tone prompt (the heard pitches' and the held-out one's, each timbre)
    and judges each sound: an untrained micro base plays none of them right."""
    from difftune.cli import main

    arguments = ["--base", str(micro_base("ace_step")), "--samples-per-prompt", "1", "--steps", "2", "--quiet"]
    assert main(["eval", *arguments, "--out", str(tmp_path / "eval.json")]) == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    before = report["before"]
    assert report["scored"] == "sounds" and report["settings"]["concept_color"] == "shrill"
    assert before["seen"]["sounds"] == len(HEARD_PITCHES) * len(TIMBRES)
    assert set(before["concept_by_timbre"]) == set(TIMBRES) and before["concept"]["sounds"] == len(TIMBRES)
    assert before["seen"]["both"] == 0 and before["concept"]["both"] == 0


def test_the_sound_autoencoders_loss_tells_a_tone_from_another():
    """The tiny sound base's reconstruction loss: none for the tone itself, more for another pitch than for the same
    pitch at another level (what its spectral terms are for)."""
    rng = np.random.default_rng(1)
    tone = torch.from_numpy(render_tone(PITCHES["middle"], "buzz", 0.25, SAMPLE_RATE, rng).samples)[None]
    other = torch.from_numpy(render_tone(PITCHES["high"], "buzz", 0.25, SAMPLE_RATE, rng).samples)[None]
    assert float(reconstruction_loss(tone, tone)) == 0
    assert float(reconstruction_loss(other, tone)) > float(reconstruction_loss(0.8 * tone, tone))
    batch = tone_batch(40, SAMPLE_RATE, 0.25, np.random.default_rng(2))
    assert batch.shape == (40, 2, SAMPLE_RATE // 4) and 0 < int((batch.abs().amax(dim=(1, 2)) == 0).sum()) < 10


def test_a_spectrogram_puts_a_higher_pitch_higher():
    low, high = (spectrogram_picture(_tone(1.0, pitch=PITCHES[pitch])) for pitch in ("low", "high"))
    rows = [int(np.asarray(picture.convert("L")).mean(axis=1).argmax()) for picture in (low, high)]
    assert rows[1] < rows[0]  # frequency grows upwards: the loudest row of the higher pitch sits higher


@pytest.mark.parametrize("seconds", [0.5, 2.0])
def test_the_plan_counts_a_window_of_the_runs_seconds(micro_base, make_config, tmp_path, seconds):
    from difftune.training.plan import _planned_media

    components = load_components(ModelConfig(base=str(micro_base("ace_step")), family_options={"seconds": seconds}))
    config = make_config(**_settings("ace_step", micro_base("ace_step"), tmp_path / "run"))
    pixels, latents = _planned_media(components, config, torch.float32, 2)
    frames = round(seconds * SAMPLE_RATE / HOP)
    assert tuple(pixels.shape) == (2, 2, 1, frames * HOP) and tuple(latents.shape) == (2, 8, 1, frames)
