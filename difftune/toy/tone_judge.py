"""Does the tiny sound base play what it is asked, and did fine-tuning teach the held-out pitch without forgetting?

The sound bases' shapes judge (judge.py), by a plain spectral check of a sound's middle (its fades left out, both sides
mixed): the loudest frequency between `LOWEST` and `HIGHEST` Hz is its pitch, named by the nearest of the tones'
pitches (toy/tones.py) within `MAX_SEMITONES`; the pitch's third harmonic at least `MIN_BUZZ` of its loudness makes it
a buzz, else a hum. A sound whose power is mostly elsewhere (`MIN_TONAL` of it near the pitch and its odd harmonics)
is no tone: noise, silence or a chord, judged (None, None), as an untrained model's drawing is. `tone_score` draws
fixed seeds per prompt and reports accuracies as the shapes judge's `score` does: the heard pitches' prompts, the
held-out pitch's, and the latter per timbre.
"""

from __future__ import annotations

import numpy as np
import torch

from difftune.data.clips import Sound
from difftune.models.components import Components
from difftune.toy.judging import EvalSettings, PrintStatus, drawn_by_prompt, within
from difftune.toy.tones import FADE_SECONDS, PITCHES, TIMBRES

LOWEST, HIGHEST = 100.0, 1100.0  # Hz: where a pitch is looked for (the tones': 200 to 800)
MAX_SEMITONES = 2.0  # from the nearest tone's pitch (they are 5 to 12 apart)
BAND = 0.03  # a harmonic's band: within 3% of its frequency
MIN_TONAL = 0.5  # of the power near the pitch and its odd harmonics: a tone (the renders: >= 0.95)
MIN_BUZZ = 0.15  # the third harmonic's amplitude over the pitch's: a buzz's is 1/3, a hum's ~0


def judge_tone(sound: Sound) -> tuple[str | None, str | None]:
    """(pitch, timbre) of a tone; (None, None) where the sound is no tone; pitch None where it is none of the tones'
    pitches."""
    mono = np.asarray(sound.samples, dtype=np.float64).mean(axis=0)
    fade = round(2 * FADE_SECONDS * sound.rate)
    middle = mono[fade : len(mono) - fade] if len(mono) > 4 * fade else mono
    amplitude = np.abs(np.fft.rfft(middle * np.hanning(len(middle))))
    frequencies = np.fft.rfftfreq(len(middle), 1 / sound.rate)
    searched = (frequencies >= LOWEST) & (frequencies <= HIGHEST)
    if not searched.any() or not amplitude[searched].any():
        return None, None
    pitch = float(frequencies[searched][amplitude[searched].argmax()])
    bands = [np.abs(frequencies - n * pitch) <= BAND * n * pitch for n in (1, 3, 5)]
    power = amplitude**2
    if power[np.logical_or.reduce(bands)].sum() < MIN_TONAL * power.sum():
        return None, None
    timbre = "buzz" if amplitude[bands[1]].max(initial=0) >= MIN_BUZZ * amplitude[bands[0]].max() else "hum"
    semitones = {name: abs(12 * np.log2(pitch / hz)) for name, hz in PITCHES.items()}
    nearest = min(semitones, key=semitones.get)
    return (nearest if semitones[nearest] <= MAX_SEMITONES else None), timbre


def prompts_for(pitches) -> list[str]:
    return [f"a {pitch} {timbre}" for pitch in pitches for timbre in TIMBRES]


@torch.no_grad()
def judged_sounds(
    components: Components, prompts: list[str], settings: EvalSettings, print_status: PrintStatus = None
) -> list[dict]:
    """Each prompt's sounds (fixed seeds, `drawn_by_prompt`) as long as `settings.seconds`, judged: one row each."""
    drawing = components.family.drawing
    options = components.family_options.model_copy(update={"seconds": settings.seconds})
    rows = []
    for prompt, seed, sound in drawn_by_prompt(
        components,
        prompts,
        settings,
        print_status,
        lambda pipeline, batch, **arguments: drawing.draw_sounds(pipeline, options, batch, **arguments),
    ):
        pitch, timbre = judge_tone(sound)
        rows.append({"prompt": prompt, "seed": seed, "pitch": pitch, "timbre": timbre, "sound": sound})
    return rows


def tone_accuracy(rows: list[dict]) -> dict:
    """Fractions of sounds whose pitch, timbre, and both match their prompt (`a <pitch> <timbre>`)."""
    asked = [row["prompt"].split()[-2:] for row in rows]
    pitch = np.mean([row["pitch"] == wanted[0] for row, wanted in zip(rows, asked, strict=True)])
    timbre = np.mean([row["timbre"] == wanted[1] for row, wanted in zip(rows, asked, strict=True)])
    both = np.mean([[row["pitch"], row["timbre"]] == wanted for row, wanted in zip(rows, asked, strict=True)])
    return {"pitch": float(pitch), "timbre": float(timbre), "both": float(both), "sounds": len(rows)}


def tone_score(
    components: Components,
    heard_pitches,
    concept_pitch: str,
    settings: EvalSettings,
    concept_word: str = "",
    print_status: PrintStatus = None,
) -> dict:
    """Accuracies on the heard pitches' prompts and on the concept's (overall and per timbre); `concept_word` is what
    the concept's prompts say instead of its pitch (they are judged by the pitch)."""
    seen = judged_sounds(components, prompts_for(heard_pitches), settings, within(print_status, "seen"))
    word = concept_word or concept_pitch
    concept = judged_sounds(components, prompts_for([word]), settings, within(print_status, "concept"))
    for row in concept:
        row["prompt"] = row["prompt"].replace(word, concept_pitch)
    return {
        "seen": tone_accuracy(seen),
        "concept": tone_accuracy(concept),
        "concept_by_timbre": {
            timbre: tone_accuracy([row for row in concept if row["prompt"].endswith(timbre)]) for timbre in TIMBRES
        },
    }


class TonesJudge:
    """`validation.eval_concept`'s judge on the tone bases (`training.validation.Judge`), registered in
    pyproject.toml: a pitch is scored on its timbres' prompts, the other pitches' prompts measure forgetting."""

    concepts = tuple(PITCHES)

    def scores(self, components: Components, concept: str, samples_per_prompt: int) -> tuple[float, float]:
        heard = [pitch for pitch in PITCHES if pitch != concept]
        report = tone_score(components, heard, concept, EvalSettings(samples_per_prompt=samples_per_prompt))
        return report["concept"]["both"], report["seen"]["both"]


TONES_JUDGE = TonesJudge()
