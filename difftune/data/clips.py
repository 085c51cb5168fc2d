"""Clips: video files read as training items, each a window of frames (issue 34's media type; a still image is a
one-frame clip).

Decoding is PyAV's (a core dependency): FFmpeg's own libraries in a wheel for every platform, so nothing
else to install, and frame by frame, so a window at the start of a long clip costs its own frames, not the file (what
musubi-tuner's and diffusion-pipe's OpenCV / decord readers also do; decord has no wheels for recent Pythons or macOS
arm64, and OpenCV's video reader depends on how its wheel was built).

Which windows a clip gives, as musubi-tuner's dataset config names them (`FrameWindows`): `target_frames` are window
lengths, each rounded down to what the model's autoencoder takes (Wan's: 4k + 1 frames); `extraction` says where the
windows sit: `head` (one at the start per length), `chunk` (back to back), `slide` (every `stride` frames), `uniform`
(`samples` of them spread evenly over the clip) or `full` (the whole clip, at most `max_frames`, as one window).
Windows count decoded frames whatever the clip's frame rate (as musubi-tuner's and diffusion-pipe's readers do).

An animated GIF is not read as a clip: `.gif` files are images, and an animated one is reported (dataset.py).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image

from difftune.config import DataConfig
from difftune.data.sources import readable
from difftune.errors import DifftuneError

Extraction = Literal["head", "chunk", "slide", "uniform", "full"]


class BadClip(Exception):
    """A clip that cannot be trained on; the message is the reason."""


@dataclass(frozen=True)
class ClipInfo:
    frames: int
    fps: float
    width: int
    height: int


@dataclass(frozen=True)
class FrameWindows:
    """Which frame windows (start, length) a clip of some frame count gives (see the module's docstring)."""

    target_frames: tuple[int, ...] = (1,)
    extraction: Extraction = "head"
    stride: int = 1  # `slide`: frames between window starts
    samples: int = 1  # `uniform`: windows per length
    max_frames: int = 129  # `full`: the longest window
    frame_multiple: int = 4  # lengths are k * frame_multiple + shortest (Wan's autoencoder: its temporal factor, 1)
    shortest: int = 1

    @classmethod
    def of(cls, data: DataConfig, lengths: tuple[int, int]) -> FrameWindows:
        """The windows `data`'s frame settings ask for, for an autoencoder that takes clips of `lengths` (step,
        shortest: `autoencoders.clip_lengths`)."""
        return cls(
            tuple(data.target_frames),
            data.frame_extraction,
            data.frame_stride,
            data.frame_samples,
            data.max_frames,
            *lengths,
        )

    def rounded(self, frames: int) -> int:
        """`frames` rounded down to a length the autoencoder takes (at least 1: one frame, an image's)."""
        if frames < self.shortest:
            return 1
        return (frames - self.shortest) // self.frame_multiple * self.frame_multiple + self.shortest

    def windows(self, frame_count: int) -> list[tuple[int, int]]:
        """The (start, length) windows of a clip of `frame_count` frames; none where it is shorter than every length."""
        if self.extraction == "full":
            return [(0, self.rounded(min(frame_count, self.max_frames)))] if frame_count else []
        out = []
        for length in sorted({self.rounded(frames) for frames in self.target_frames}):
            if frame_count < length:
                continue
            last = frame_count - length
            if self.extraction == "head":
                starts = [0]
            elif self.extraction == "chunk":
                starts = range(0, last + 1, length)
            elif self.extraction == "slide":
                starts = range(0, last + 1, self.stride)
            else:  # uniform
                starts = sorted(set(np.linspace(0, last, self.samples, dtype=int).tolist()))  # floored, as musubi-tuner
            out += [(int(start), length) for start in starts]
        return out


def pyav():
    if importlib.util.find_spec("av") is None:
        raise DifftuneError("reading clips needs PyAV, which difftune installs: pip install av")
    import av

    return av


def stated_rate(stream) -> float:
    """A video stream's frame rate as its container states it; 0 where it states none. `probe`, `frame_rate` and the
    sound reader (sound.py) all read it so: a window's sound is placed, and batches are cut, by the same rate."""
    return float(stream.average_rate or stream.guessed_rate or 0)


def probe(path: Path) -> ClipInfo:
    """A clip's frame count, frame rate and size, decoding every frame (a container's stated count can be missing or
    wrong); raises BadClip for anything that cannot be trained on."""
    av = pyav()
    try:
        with av.open(readable(path)) as container:
            if not container.streams.video:
                raise BadClip("has no video stream")
            stream = container.streams.video[0]
            frames, size = 0, None
            for frame in container.decode(stream):
                frames += 1
                size = size or (frame.width, frame.height)
            fps = stated_rate(stream)
    except BadClip:
        raise
    except (av.FFmpegError, OSError, ValueError) as err:
        raise BadClip(f"cannot be decoded as a video: {err}") from None
    if not frames:
        raise BadClip("has no frames")
    return ClipInfo(frames, fps, *size)


def frame_rate(path: Path) -> float:
    """A clip's frame rate as its container states it (no frame decoded: `probe` decodes them all); 0 where it states
    none or cannot be read (`probe` reports such a clip)."""
    av = pyav()
    try:
        with av.open(readable(path)) as container:
            return stated_rate(container.streams.video[0]) if container.streams.video else 0.0
    except (av.FFmpegError, OSError, ValueError):
        return 0.0


def frame_size(path: Path) -> tuple[int, int]:
    """A clip's (width, height), from its header alone."""
    av = pyav()
    try:
        with av.open(readable(path)) as container:
            stream = container.streams.video[0]
            return stream.codec_context.width, stream.codec_context.height
    except (av.FFmpegError, OSError, ValueError, IndexError) as err:
        raise BadClip(f"cannot be decoded as a video: {err}") from None


@dataclass(frozen=True)
class Sound:
    """A sound track: `samples` (channels, n) as floats in [-1, 1], `rate` of them a second."""

    samples: np.ndarray
    rate: int


class SoundingClip(list):
    """A drawn clip with its sound (an audio-video base's sample): its frames, as any clip's, the `sound` drawn beside
    them and the frame rate `fps` both were drawn for (the sound lasts as long as the frames at that rate)."""

    def __init__(self, frames: list[Image.Image], sound: Sound, fps: float):
        super().__init__(frames)
        self.sound, self.fps = sound, fps


def write_clip(
    path: Path,
    frames: list[Image.Image],
    fps: float = 16,
    lossless: bool = False,
    tags: dict[str, str] | None = None,
    sound: Sound | None = None,
) -> Path:
    """Frames as a video file, with PyAV: H.264 (yuv420p, which every player and browser reads; sides cut down to even
    numbers, as it needs) or, `lossless`, FFV1 (every pixel decodes back as written; Matroska). `tags`: the container's
    metadata, kept under their own names (MP4's `use_metadata_tags`). `sound`: a track beside the frames from their
    start, AAC (16-bit PCM where `lossless`: every sample decodes back as written, to 16 bits)."""
    av = pyav()
    width, height = frames[0].size
    if not lossless:
        width, height = width - width % 2, height - height % 2
    with av.open(str(path), "w", options={} if lossless else {"movflags": "use_metadata_tags"}) as container:
        container.metadata.update(tags or {})
        stream = container.add_stream("ffv1" if lossless else "libx264", rate=round(fps))
        stream.width, stream.height = width, height
        stream.pix_fmt = "bgr0" if lossless else "yuv420p"
        if not lossless:
            stream.options = {"crf": "16"}  # visually lossless for samples
        if sound is not None:  # every stream is added before the first is written
            layout = "stereo" if len(sound.samples) == 2 else "mono"
            track = container.add_stream("pcm_s16le" if lossless else "aac", rate=sound.rate, layout=layout)
        for image in frames:
            container.mux(stream.encode(av.VideoFrame.from_image(image.convert("RGB").crop((0, 0, width, height)))))
        container.mux(stream.encode())
        if sound is not None:
            samples = np.clip(sound.samples, -1, 1)
            if lossless:  # interleaved 16-bit
                frame = av.AudioFrame.from_ndarray(
                    np.round(samples.T * 32767).astype(np.int16).reshape(1, -1), format="s16", layout=layout
                )
            else:
                frame = av.AudioFrame.from_ndarray(samples.astype(np.float32), format="fltp", layout=layout)
            frame.sample_rate, frame.pts = sound.rate, 0
            container.mux(track.encode(frame))  # PyAV cuts it into the codec's frame size
            container.mux(track.encode())
    return path


def read_frames(path: Path, start: int, length: int) -> list[Image.Image]:
    """Frames `start` to `start + length` (exclusive) as RGB images, decoding no further than the window's end."""
    av = pyav()
    frames = []
    try:
        with av.open(readable(path)) as container:
            for index, frame in enumerate(container.decode(container.streams.video[0])):
                if index >= start + length:
                    break
                if index >= start:
                    frames.append(frame.to_image().convert("RGB"))
    except (av.FFmpegError, OSError, ValueError) as err:
        raise BadClip(f"cannot be decoded as a video: {err}") from None
    if len(frames) < length:
        raise BadClip(f"has {start + len(frames)} frames; the window {start}..{start + length} needs {start + length}")
    return frames
