"""Sound files, for a base that trains sound alone (ACE-Step): a folder of `.wav`, `.flac`, `.mp3`... files with
their captions, each cut into windows of time as a clip is cut into windows of frames (clips.py).

- Windows (`SoundWindows`): back to back, each `seconds` long (up to whole latent frames of the autoencoder); a file
  shorter than one window is one window, its end padded with silence (a sample of a few seconds still trains); what
  is left after the last whole window is not read. A window's samples are counted at the autoencoder's rate.
- Reading is PyAV's (sound.py's `stereo_samples`): resampled by FFmpeg to the autoencoder's rate, stereo.
- Writing (samples): FLAC, lossless and with the prompt and settings as its tags (Vorbis comments), as a PNG sample
  keeps them in its text chunks; and a spectrogram picture of it for grids and TensorBoard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from difftune.data.clips import BadClip, Sound, pyav
from difftune.data.sound import padded_window, stereo_samples
from difftune.data.sources import readable


@dataclass(frozen=True)
class SoundWindows:
    """Which windows (first sample, sample count) a sound file gives (see the module's docstring)."""

    rate: int  # the autoencoder's samples a second
    seconds: float  # each window's length
    samples_per_latent: int  # the autoencoder's hop: windows hold whole latent frames

    @property
    def length(self) -> int:
        """A window's samples: `seconds` rounded up to whole latent frames, as the pipeline draws that long a sound."""
        return math.ceil(self.seconds * self.rate / self.samples_per_latent) * self.samples_per_latent

    def windows(self, samples: int) -> list[tuple[int, int]]:
        """The windows of a file of `samples` samples: back to back, or one padded window for a shorter file."""
        if not samples:
            return []
        return [(start, self.length) for start in range(0, max(samples - self.length, 0) + 1, self.length)]


def sound_length(path: Path, rate: int) -> int:
    """A sound file's samples at `rate`, decoding all of it (a container's stated duration can be missing or wrong);
    raises BadClip for a file that cannot be trained on."""
    av = pyav()
    try:
        with av.open(readable(path)) as container:
            if not container.streams.audio:
                raise BadClip("has no audio stream")
            samples = stereo_samples(container, rate).shape[1]
    except BadClip:
        raise
    except (av.FFmpegError, OSError, ValueError) as err:
        raise BadClip(f"cannot be decoded as a sound: {err}") from None
    if not samples:
        raise BadClip("holds no sound")
    return samples


def read_window(path: Path, window: tuple[int, int], rate: int) -> torch.Tensor:
    """A window (first sample, count) of a sound file as the autoencoder reads it: (2, 1, count) at `rate`, a sound
    one row high (the rest of difftune sees a sound as an image of one row: its latents (C, 1, frames))."""
    av = pyav()
    first, count = window
    try:
        with av.open(readable(path)) as container:
            waveform = stereo_samples(container, rate, first + count)
    except (av.FFmpegError, OSError, ValueError, IndexError) as err:
        raise BadClip(f"cannot be decoded as a sound: {err}") from None
    return padded_window(waveform, first, count)[:, None]


def read_sound_file(path: Path) -> Sound:
    """A whole sound file at its own rate, stereo (a written sample, read back)."""
    av = pyav()
    with av.open(readable(path)) as container:
        rate = container.streams.audio[0].codec_context.sample_rate
        return Sound(stereo_samples(container, rate), rate)


def window_geometry(window: tuple[int, int]) -> torch.Tensor:
    """A sound window's `image_geometry` (6,), as of an image one row high cut from a longer one: (1, count) in size,
    its first sample as the crop's left."""
    first, count = window
    return torch.tensor([1, count, 0, first, 1, count])


def write_sound(path: Path, sound: Sound, tags: dict[str, str] | None = None) -> Path:
    """A sound as FLAC (16-bit, lossless: each sample decodes back as written, to 16 bits) with `tags` as its Vorbis
    comments."""
    av = pyav()
    layout = "stereo" if len(sound.samples) == 2 else "mono"
    samples = np.round(np.clip(sound.samples, -1, 1).T * 32767).astype(np.int16).reshape(1, -1)  # interleaved
    with av.open(str(path), "w", format="flac") as container:
        container.metadata.update(tags or {})
        stream = container.add_stream("flac", rate=sound.rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout=layout)
        frame.sample_rate, frame.pts = sound.rate, 0
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def read_tags(path: Path) -> dict[str, str]:
    """What `write_sound` wrote as a file's tags."""
    with pyav().open(str(path)) as container:
        return dict(container.metadata)


SPECTROGRAM_HEIGHT = 64  # frequency rows of a sound's picture
SPECTROGRAM_FLOOR_DB = -80.0  # quieter than this is black


def spectrogram_picture(sound: Sound, columns: int = 128) -> Image.Image:
    """A sound as a picture for grids and TensorBoard: its spectrogram (both sides mixed), time left to right,
    frequency bottom to top up to half the rate, loudness in dB from -80 (black) to the loudest (white)."""
    mono = torch.from_numpy(np.asarray(sound.samples, dtype=np.float32)).mean(dim=0)
    fft = 2 * (SPECTROGRAM_HEIGHT - 1)
    hop = max(1, len(mono) // columns)
    spectrum = torch.stft(
        torch.nn.functional.pad(mono, (0, max(0, fft - len(mono)))),
        fft,
        hop,
        window=torch.hann_window(fft),
        return_complex=True,
    ).abs()
    decibels = 20 * torch.log10(spectrum.clamp(min=1e-8))
    decibels = (decibels - decibels.max()).clamp(min=SPECTROGRAM_FLOOR_DB)
    levels = ((decibels - SPECTROGRAM_FLOOR_DB) / -SPECTROGRAM_FLOOR_DB * 255).round().to(torch.uint8)
    return Image.fromarray(levels.flip(0).numpy(), "L").convert("RGB")
