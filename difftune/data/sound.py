"""A clip's sound, for an audio-video base (LTX-2): the waveform under a window of frames, and its log-mel spectrogram
as the base's audio autoencoder reads it.

Decoding is PyAV's, as the frames' (clips.py): the first audio stream, resampled by FFmpeg to the autoencoder's rate
and to stereo (a mono clip's channel copied to both sides). A window of frames `start, start + length` of a clip at
`fps` frames per second holds the sound from `start / fps` to `(start + length) / fps` seconds (both streams taken to
start at 0: a container whose sound starts late is read as if it did not).

The spectrogram is Lightricks' `AudioProcessor`'s (what LTX-2's audio autoencoder was trained on; diffusers ships no
front end, its pipelines only decode sound): torchaudio's `MelSpectrogram` with a 1024-sample periodic Hann window
and FFT, the autoencoder's hop, 0-8 kHz in the autoencoder's count of Slaney-scaled, Slaney-normalised mel bins, of
magnitudes (power 1), then the log of each value floored at 1e-5. Here it is `torch.stft` over transformers' mel
filter bank (`mel_filter_bank`, torchaudio's filters; torchaudio is not a dependency), checked against transformers'
own `spectrogram` (tests/test_ltx2_sound.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers.audio_utils import mel_filter_bank

from difftune.data.clips import BadClip, pyav, stated_rate
from difftune.data.sources import readable

FFT_SIZE = 1024  # the window and FFT length of Lightricks' `AudioProcessor`
HIGHEST_FREQUENCY = 8000.0  # its mel bins' top, in Hz
LOG_FLOOR = 1e-5  # the smallest magnitude its log reads


def read_sound(path: Path, start: int, length: int, sample_rate: int) -> tuple[torch.Tensor, float] | None:
    """The sound under frames `start` to `start + length` of a clip, (2, samples) at `sample_rate` (zero-padded
    where the sound ends before the window), and the clip's frame rate; None where the clip has no audio stream."""
    av = pyav()
    try:
        with av.open(readable(path)) as container:
            if not container.streams.audio:
                return None
            video = container.streams.video[0] if container.streams.video else None
            fps = stated_rate(video) if video else 0.0
            if not fps:
                raise BadClip("has no frame rate to place its sound by")
            first, count = window_samples(start, length, fps, sample_rate)
            waveform = stereo_samples(container, sample_rate, first + count)
    except BadClip:
        raise
    except (av.FFmpegError, OSError, ValueError, IndexError) as err:
        raise BadClip(f"its sound cannot be decoded: {err}") from None
    return padded_window(waveform, first, count), fps


def stereo_samples(container, sample_rate: int, until: int | None = None) -> np.ndarray:
    """The container's first audio stream as (2, samples) floats at `sample_rate`, decoding no further than `until`
    samples (None: all of it). Resampled by FFmpeg; a mono stream's channel is copied to both sides (FFmpeg's own
    upmix would lower it by 3 dB)."""
    av = pyav()
    mono = container.streams.audio[0].codec_context.channels == 1
    resampler = av.AudioResampler(format="fltp", layout="mono" if mono else "stereo", rate=sample_rate)
    chunks, samples = [], 0
    for frame in container.decode(container.streams.audio[0]):
        for resampled in resampler.resample(frame):
            chunks.append(resampled.to_ndarray())
            samples += chunks[-1].shape[1]
        if until is not None and samples >= until:
            break
    else:
        chunks += [resampled.to_ndarray() for resampled in resampler.resample(None)]
    waveform = np.concatenate(chunks, axis=1) if chunks else np.zeros((1 if mono else 2, 0), np.float32)
    return np.repeat(waveform, 2, axis=0) if mono else waveform


def padded_window(waveform: np.ndarray, first: int, count: int) -> torch.Tensor:
    """Samples `first` to `first + count` of a (channels, n) waveform, zero-padded where it ends before them."""
    window = torch.from_numpy(np.ascontiguousarray(waveform[:, first : first + count], dtype=np.float32))
    return torch.nn.functional.pad(window, (0, count - window.shape[1]))


def window_samples(start: int, length: int, fps: float, sample_rate: int) -> tuple[int, int]:
    """The first sample and the count of samples at `sample_rate` under frames `start` to `start + length` of a clip
    at `fps`."""
    return round(start / fps * sample_rate), round(length / fps * sample_rate)


def log_mel_spectrogram(waveforms: torch.Tensor, sample_rate: int, hop_length: int, mel_bins: int) -> torch.Tensor:
    """Waveforms (B, channels, samples) -> log-mel spectrograms (B, channels, frames, mel_bins), as LTX-2's audio
    autoencoder reads them (see the module's docstring): frames = samples // hop_length + 1 (centered windows)."""
    filters = mel_filter_bank(
        num_frequency_bins=FFT_SIZE // 2 + 1,
        num_mel_filters=mel_bins,
        min_frequency=0.0,
        max_frequency=HIGHEST_FREQUENCY,
        sampling_rate=sample_rate,
        norm="slaney",
        mel_scale="slaney",
    )
    flat = waveforms.float().flatten(0, 1)
    window = torch.hann_window(FFT_SIZE, device=flat.device)
    spectrum = torch.stft(
        flat, FFT_SIZE, hop_length, window=window, center=True, pad_mode="reflect", return_complex=True
    ).abs()  # (B * channels, bins, frames)
    mel = torch.from_numpy(filters).to(spectrum).T @ spectrum  # (B * channels, mel_bins, frames)
    log_mel = mel.clamp(min=LOG_FLOOR).log()
    return log_mel.unflatten(0, waveforms.shape[:2]).transpose(2, 3)
