"""Tones: the sound bases' shapes. A tone is a pitch (low, middle, high, and shrill, which the tiny sound base never
hears: its purple) in a timbre (a hum: a pure sine; a buzz: the sine with its odd harmonics, as a square wave has
them), with a fade in and out, at a random level, captioned "a low hum", "a shrill buzz"... The tiny sound base
learns them as the tiny image bases learn the shapes, and its judge (tone_judge.py, a plain spectral check, blind to
phase) tells a pitch and a timbre apart the way the shapes judge tells colors and shapes.

The pitches are whole multiples of the tiny base's latent frame rate (200 a second: 6.4 kHz over its 32-sample hop),
and every tone starts at phase 0, as a drum machine's notes do: each latent frame then holds whole periods of the
same wave. The tiny base's autoencoder, trained for minutes on a CPU, makes those again: it moved pitches between the
multiples to the nearest one (450 Hz came back as 400), and tones at random phases it learned for some pitches only
(after 4,000 steps it made the low and shrill hums as silence, 0 dB signal to noise; starting at phase 0, 16 dB after
1,500 steps). A buzz keeps the harmonics below half the rate (the band a sound at that rate holds): every pitch's
third harmonic is in it at 6.4 kHz.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from difftune.data.clips import Sound
from difftune.data.sound_files import write_sound

PITCHES = {"low": 200.0, "middle": 400.0, "high": 600.0, "shrill": 800.0}  # Hz
HELD_OUT_PITCH = "shrill"  # what the tiny sound base never hears
HEARD_PITCHES = tuple(pitch for pitch in PITCHES if pitch != HELD_OUT_PITCH)
TIMBRES = ("hum", "buzz")
BUZZ_HARMONICS = (3, 5)  # odd harmonics at 1/n, as a square wave's
FADE_SECONDS = 0.05
TONE_SECONDS = 1.0  # how long the tiny sound base's tones are, and what its judge draws


def render_tone(
    pitch: float, timbre: str, seconds: float, rate: int, rng: np.random.Generator, phase: float = 0.0
) -> Sound:
    """One tone (see the module's docstring) starting at `phase` (radians), stereo, its sides at slightly different
    levels."""
    time = np.arange(round(seconds * rate)) / rate
    phase = 2 * np.pi * pitch * time + phase
    wave = np.sin(phase)
    if timbre == "buzz":
        wave = wave + sum(np.sin(n * phase) / n for n in BUZZ_HARMONICS if n * pitch < rate / 2)
    fade = np.clip(np.minimum(time, seconds - time) / FADE_SECONDS, 0, 1)
    wave = wave / np.abs(wave).max() * fade * rng.uniform(0.4, 0.8)
    sides = np.stack([wave, wave * rng.uniform(0.8, 1.0)])
    return Sound(sides.astype(np.float32), rate)


def tone_sounds(
    count: int, seed: int, seconds: float, rate: int, pitches=HEARD_PITCHES, timbres=TIMBRES
) -> list[tuple[Sound, str]]:
    """`count` (sound, caption) pairs cycling through every pitch/timbre pair, deterministic by seed."""
    rng = np.random.default_rng(seed)
    pairs = [(pitch, timbre) for pitch in pitches for timbre in timbres]
    out = []
    for i in range(count):
        pitch, timbre = pairs[i % len(pairs)]
        out.append((render_tone(PITCHES[pitch], timbre, seconds, rate, rng), f"a {pitch} {timbre}"))
    return out


def write_sound_folder(folder: Path, examples: list[tuple[Sound, str]]) -> None:
    """Kohya's layout, for sounds: `NNNN.flac` with its caption in `NNNN.txt`."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, (sound, caption) in enumerate(examples):
        write_sound(folder / f"{i:04d}.flac", sound)
        (folder / f"{i:04d}.txt").write_text(caption + "\n", encoding="utf-8")
