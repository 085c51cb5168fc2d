"""Clips (difftune/data/clips.py): which frame windows a clip gives, as musubi-tuner's dataset config names them, and
the
frames decoded for each, exactly (lossless clips written here); bad clips named with their reason. The data path
(dataset.py) over them: a window per example, its frames cut as one, frame-count buckets, clips through a video
autoencoder."""

from __future__ import annotations

import random

import pytest
import torch
from PIL import Image

from difftune.config import DataConfig, load_config
from difftune.data.cache import latent_entries
from difftune.data.clips import BadClip, FrameWindows, probe, read_frames, write_clip
from difftune.data.dataset import TrainingOrder, batch_groups, frame_counts, load_clip, scan_examples
from difftune.errors import DifftuneError
from difftune.models.autoencoders import decode_latents, encode_posterior, frames_per_latent
from difftune.toy.tiny import build_vae, build_wan_vae


def numbered_frames(count: int, size: tuple[int, int] = (24, 16)) -> list[Image.Image]:
    """Frame i filled with the color (8 i, 255 - 8 i, 100): each decodes back to its own number."""
    return [Image.new("RGB", size, (8 * i, 255 - 8 * i, 100)) for i in range(count)]


def number_of(frame: Image.Image) -> int:
    return frame.getpixel((0, 0))[0] // 8


@pytest.mark.parametrize(
    ("windows", "frame_count", "expected"),
    [
        (FrameWindows((9, 17), "head"), 30, [(0, 9), (0, 17)]),
        (FrameWindows((9,), "chunk"), 30, [(0, 9), (9, 9), (18, 9)]),
        (FrameWindows((17,), "slide", stride=5), 30, [(0, 17), (5, 17), (10, 17)]),
        (FrameWindows((17,), "uniform", samples=3), 30, [(0, 17), (6, 17), (13, 17)]),
        (FrameWindows(extraction="full"), 30, [(0, 29)]),  # 4k + 1
        (FrameWindows(extraction="full", max_frames=21), 30, [(0, 21)]),
        (FrameWindows((10, 16), "head"), 30, [(0, 9), (0, 13)]),  # lengths rounded down to 4k + 1
        (FrameWindows((33,), "head"), 30, []),  # shorter than every window
        (FrameWindows((1,), "chunk", frame_multiple=1), 3, [(0, 1), (1, 1), (2, 1)]),
    ],
)
def test_windows_are_musubi_tuners(windows, frame_count, expected):
    assert windows.windows(frame_count) == expected


def test_a_window_decodes_its_own_frames(tmp_path):
    clip = write_clip(tmp_path / "clip.mkv", numbered_frames(30), fps=12, lossless=True)
    info = probe(clip)
    assert (info.frames, info.width, info.height) == (30, 24, 16) and info.fps == pytest.approx(12)
    for start, length in FrameWindows((9,), "chunk").windows(info.frames):
        frames = read_frames(clip, start, length)
        assert [number_of(frame) for frame in frames] == list(range(start, start + length))
        assert all(frame.mode == "RGB" and frame.size == (24, 16) for frame in frames)


def test_bad_clips_are_named_with_their_reason(tmp_path):
    (tmp_path / "text.mp4").write_text("not a video")
    (tmp_path / "empty.mp4").write_bytes(b"")
    for name in ("text.mp4", "empty.mp4"):
        with pytest.raises(BadClip, match="cannot be decoded as a video"):
            probe(tmp_path / name)
    clip = write_clip(tmp_path / "short.mkv", numbered_frames(5), lossless=True)
    with pytest.raises(BadClip, match=r"has 5 frames; the window 0\.\.9 needs 9"):
        read_frames(clip, 0, 9)
    image = tmp_path / "still.png"
    numbered_frames(1)[0].save(image)
    assert probe(image).frames == 1  # a still reads as a one-frame clip


# The data path: a folder of clips and images, as a video base (`Family.reads_clips`) trains on it.

WINDOWS = FrameWindows((5,), "chunk", frame_multiple=2)  # the micro Wan autoencoder's temporal factor: 2k + 1 frames


def clip_folder(root, frame_counts=(12, 7, 3)):
    """Clips `clip_<n>.mkv` of n numbered frames (24x16) with captions, a still image, an undecodable clip."""
    root.mkdir(parents=True, exist_ok=True)
    for count in frame_counts:
        write_clip(root / f"clip_{count}.mkv", numbered_frames(count), lossless=True)
        (root / f"clip_{count}.txt").write_text(f"a clip of {count} frames")
    numbered_frames(1)[0].save(root / "still.png")
    (root / "still.txt").write_text("a still")
    (root / "broken.mp4").write_text("not a video")
    (root / "broken.txt").write_text("broken")
    return root


def test_each_window_of_a_clip_is_an_example_and_bad_clips_are_reported(tmp_path):
    folder = clip_folder(tmp_path / "data")
    examples, bad = scan_examples(DataConfig(path=str(folder)), windows=WINDOWS)
    assert [(e.path.name, e.frames, e.caption) for e in examples] == [
        ("clip_12.mkv", (0, 5), "a clip of 12 frames"),
        ("clip_12.mkv", (5, 5), "a clip of 12 frames"),
        ("clip_7.mkv", (0, 5), "a clip of 7 frames"),
        ("still.png", None, "a still"),
    ]
    reasons = {b.path.name: b.reason for b in bad}
    assert reasons.keys() == {"broken.mp4", "clip_3.mkv"}
    assert reasons["broken.mp4"].startswith("cannot be decoded as a video")
    assert reasons["clip_3.mkv"] == "3 frames: shorter than every window of data.target_frames (5 frames)"
    # An image base leaves every clip out, by name; its images train as before.
    examples, bad = scan_examples(DataConfig(path=str(folder)))
    assert [(e.path.name, e.frames) for e in examples] == [("still.png", None)]
    assert {b.path.name: b.reason for b in bad} == {
        name: "a clip: this base trains still images (a video base such as Wan reads clips)"
        for name in ("broken.mp4", "clip_12.mkv", "clip_3.mkv", "clip_7.mkv")
    }


def test_a_clips_window_is_cut_and_flipped_as_one(tmp_path):
    """Every frame of a window at the training size, its own frame's pixels (the clip is lossless and the size its own),
    all mirrored together; the geometry is the first frame's."""
    frames = [Image.new("RGB", (24, 16), (8 * i, 0, 0)) for i in range(7)]
    for frame in frames:
        frame.paste((0, 0, 255), (0, 0, 12, 16))  # the left half blue
    clip = write_clip(tmp_path / "clip.mkv", frames, lossless=True)
    config = DataConfig(path=str(tmp_path), random_flip=True)
    seen = set()
    for seed in range(8):
        view = load_clip(clip, (2, 5), config, random.Random(seed), (24, 16))
        assert view.pixels.shape == (3, 5, 16, 24) and view.mask is None and view.controls == []
        red = (view.pixels[0, :, 0, -1 if not view.flipped else 0] + 1) * 127.5
        torch.testing.assert_close(red, torch.tensor([8.0 * i for i in range(2, 7)]))
        left_is_blue = bool(view.pixels[2, :, :, 0].gt(0.9).all())
        assert left_is_blue != view.flipped
        assert view.geometry.tolist() == [16, 24, 0, 0, 16, 24]
        seen.add(view.flipped)
    assert seen == {True, False}


def test_batches_never_mix_frame_counts(tmp_path):
    """Windows of 5 frames, of 9, and images (0 frames) each batch alone: their tensors have other shapes."""
    folder = clip_folder(tmp_path / "data", frame_counts=(12, 9, 10))
    examples, _ = scan_examples(
        DataConfig(path=str(folder), target_frames=[5, 9]), windows=FrameWindows((5, 9), frame_multiple=2)
    )
    counts = frame_counts(examples)
    assert sorted(counts) == [0, 5, 5, 5, 9, 9, 9]
    sizes = [(16, 16)] * len(examples)
    groups = batch_groups(sizes, [()] * len(examples), False, counts)
    order = iter(TrainingOrder(len(examples), 2, seed=3, buckets=groups))
    for _ in range(20):
        batch = next(order)
        assert len({counts[index] for _, index in batch}) == 1
    assert batch_groups(sizes, [()] * len(examples), False, [5] * len(examples)) is None  # one length: any batch


def test_a_video_autoencoder_encodes_a_clip_causally():
    """A clip's latents (B, C, t, h, w), t = (T - 1) / 2 + 1 on the micro Wan autoencoder; being causal, its first
    latent frame is its first frame's, encoded alone as an image (diffusers' autoencoder, read through difftune's
    encode_posterior both ways); decoding gives a clip of T frames back."""
    vae = build_wan_vae().eval()
    clip = torch.rand(2, 3, 5, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        mean, std = encode_posterior(vae, clip)
        first, _ = encode_posterior(vae, clip[:, :, 0])
        assert mean.shape == std.shape == (2, 16, 3, 4, 4) and first.shape == (2, 16, 4, 4)
        torch.testing.assert_close(mean[:, :, 0], first, atol=1e-5, rtol=1e-5)
        assert decode_latents(vae, mean).shape == (2, 3, 5, 16, 16)
    assert frames_per_latent(vae) == 2
    with pytest.raises(DifftuneError, match="encodes images, not clips"):
        encode_posterior(build_vae(), clip)


def test_a_clips_cache_entries_are_keyed_by_its_window(tmp_path):
    """Another window of the same clip is another latent entry; an image's entries do not depend on the frame
    settings."""
    folder = clip_folder(tmp_path / "data", frame_counts=(12,))
    config = load_config(None, [f"data.path={folder}", f"cache.dir={tmp_path / 'cache'}"])
    entries = {}
    for length in (5, 9):
        examples, _ = scan_examples(config.data, windows=FrameWindows((length,), "chunk", frame_multiple=2))
        files = latent_entries(examples, [(16, 16)] * len(examples), "vae", config)
        entries[length] = {(e.path.name, e.frames): views["plain"] for e, views in zip(examples, files, strict=True)}
    assert entries[5].keys() == {("clip_12.mkv", (0, 5)), ("clip_12.mkv", (5, 5)), ("still.png", None)}
    assert entries[9].keys() == {("clip_12.mkv", (0, 9)), ("still.png", None)}
    assert entries[5][("still.png", None)] == entries[9][("still.png", None)]
    clip_files = [path for found in entries.values() for key, path in found.items() if key[1]]
    assert len(set(clip_files)) == 3
