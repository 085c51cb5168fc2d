"""Clips (difftune/clips.py): which frame windows a clip gives, as musubi-tuner's dataset config names them, and the
frames decoded for each, exactly (lossless clips written here); bad clips named with their reason."""

from __future__ import annotations

import pytest
from PIL import Image

from difftune.clips import BadClip, FrameWindows, probe, read_frames
from difftune.toy.tiny import write_clip


def numbered_frames(count: int, size: tuple[int, int] = (24, 16)) -> list[Image.Image]:
    """Frame i filled with the color (8 i, 255 - 8 i, 100): each decodes back to its own number."""
    return [Image.new("RGB", size, (8 * i, 255 - 8 * i, 100)) for i in range(count)]


def number_of(frame: Image.Image) -> int:
    return frame.getpixel((0, 0))[0] // 8


@pytest.mark.parametrize(("windows", "frame_count", "expected"), [
    (FrameWindows((9, 17), "head"), 30, [(0, 9), (0, 17)]),
    (FrameWindows((9,), "chunk"), 30, [(0, 9), (9, 9), (18, 9)]),
    (FrameWindows((17,), "slide", stride=5), 30, [(0, 17), (5, 17), (10, 17)]),
    (FrameWindows((17,), "uniform", samples=3), 30, [(0, 17), (6, 17), (13, 17)]),
    (FrameWindows(extraction="full"), 30, [(0, 29)]),  # 4k + 1
    (FrameWindows(extraction="full", max_frames=21), 30, [(0, 21)]),
    (FrameWindows((10, 16), "head"), 30, [(0, 9), (0, 13)]),  # lengths rounded down to 4k + 1
    (FrameWindows((33,), "head"), 30, []),  # shorter than every window
    (FrameWindows((1,), "chunk", frame_multiple=1), 3, [(0, 1), (1, 1), (2, 1)]),
])
def test_windows_are_musubi_tuners(windows, frame_count, expected):
    assert windows.windows(frame_count) == expected


def test_a_window_decodes_its_own_frames(tmp_path):
    clip = write_clip(tmp_path / "clip.mkv", numbered_frames(30), fps=12)
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
    clip = write_clip(tmp_path / "short.mkv", numbered_frames(5))
    with pytest.raises(BadClip, match=r"has 5 frames; the window 0\.\.9 needs 9"):
        read_frames(clip, 0, 9)
    image = tmp_path / "still.png"
    numbered_frames(1)[0].save(image)
    assert probe(image).frames == 1  # a still reads as a one-frame clip
