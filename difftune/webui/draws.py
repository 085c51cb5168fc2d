"""The samples a job drew, draw by draw (the Train tab's gallery across steps): the base's before training
(`samples/before/`), each `sample.every_steps` or "sample now" draw (`samples/step-N/`), the trained result's
(`samples/`) and its EMA weights' (`samples_ema/`); each file with the prompt it was drawn from, as the file itself
records it (a PNG's text chunk, a clip's metadata, a FLAC's tags). A sound base's samples are shown as what a gallery
plays: their spectrogram as a still clip with the sound as its track (`playable`)."""

from __future__ import annotations

import hashlib
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from difftune.data.clips import Sound, write_clip
from difftune.data.sound_files import read_sound_file, read_tags, spectrogram_picture
from difftune.webui.jobs import SAMPLE_CLIPS, SAMPLE_SOUNDS, Job, own_file

_STEP = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class Draw:
    label: str  # "before training", "step 20", "trained", "trained (EMA)"
    folder: Path
    order: tuple[int, int]  # before, steps in order, then the results

    def files(self, job: Job) -> list[Path]:
        """The drawn images, clips and sounds (not the grid), in prompt order; only the job's own files."""
        patterns = ("[0-9][0-9][0-9].png", *SAMPLE_CLIPS, *SAMPLE_SOUNDS)
        found = [path for pattern in patterns for path in self.folder.glob(pattern)]
        return sorted(path for path in found if own_file(job, path))


def draws(job: Job) -> list[Draw]:
    """Every draw the job made that left files, in the order it made them."""
    found = []
    for folder in (job.dir / "samples", *sorted((job.dir / "samples").glob("*")), job.dir / "samples_ema"):
        if not folder.is_dir() or folder.is_symlink():
            continue
        step = _STEP.fullmatch(folder.name)
        if folder.name == "before":
            draw = Draw("before training", folder, (0, 0))
        elif step:
            draw = Draw(f"step {int(step.group(1))}", folder, (1, int(step.group(1))))
        elif folder.name == "samples":
            draw = Draw("trained", folder, (2, 0))
        elif folder.name == "samples_ema":
            draw = Draw("trained (EMA)", folder, (2, 1))
        else:
            continue
        if draw.files(job):
            found.append(draw)
    return sorted(found, key=lambda draw: draw.order)


def drawn_prompt(path: Path) -> str:
    """The prompt a sample file says it was drawn from (`drawing.sample_tags`), or "" where it says none."""
    if path.suffix == ".flac":
        return read_tags(path).get("prompt", "")
    if path.suffix == ".mp4":
        try:
            import av

            with av.open(str(path)) as container:
                return container.metadata.get("prompt", "")
        except (ImportError, OSError):
            return ""
    with Image.open(path) as image:
        if path.suffix == ".png":
            return image.text.get("prompt", "")
        said = image.getexif().get(0x010E, "")  # an animated WebP's "name: text" lines
    return next((line.removeprefix("prompt: ") for line in said.splitlines() if line.startswith("prompt: ")), "")


PLAYED_FPS = 2  # the still spectrogram's frames a second: few, as it does not move
AAC_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000, 88200, 96000)  # what AAC encodes
PLAYED_RATE = 48000  # a sound at another rate (the tiny base's 6.4 kHz) is played at this one


def playable(sample: Path | Sound) -> Path:
    """A sound (a sample's FLAC, or one just drawn) as a gallery plays it: an MP4 of its spectrogram, still, with the
    sound as its AAC track; made once per sound, in the temporary folder. Other files as they are."""
    if isinstance(sample, Path) and sample.suffix != ".flac":
        return sample
    sound = read_sound_file(sample) if isinstance(sample, Path) else sample
    digest = hashlib.sha256(sound.samples.tobytes() + str(sound.rate).encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / "difftune-sounds" / f"{digest}.mp4"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        frames = max(1, round(sound.samples.shape[1] / sound.rate * PLAYED_FPS))
        write_clip(path, [spectrogram_picture(sound)] * frames, PLAYED_FPS, sound=_at_an_aac_rate(sound))
    return path


def _at_an_aac_rate(sound: Sound) -> Sound:
    """`sound` at a rate AAC encodes: as it is, or linearly interpolated to `PLAYED_RATE` (enough to hear it by)."""
    if sound.rate in AAC_RATES:
        return sound
    length = sound.samples.shape[1]
    played = np.arange(round(length * PLAYED_RATE / sound.rate)) * sound.rate / PLAYED_RATE
    return Sound(np.stack([np.interp(played, np.arange(length), side) for side in sound.samples]), PLAYED_RATE)
