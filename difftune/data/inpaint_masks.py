"""Random inpainting masks: what an inpainting base learns to fill, drawn per training view.

The kinds the other trainers draw (diffusers' inpainting DreamBooth scripts: a rectangle or an ellipse; LaMa's and
OneTrainer's: brush strokes; SD-inpainting's recipe: now and then the whole image, so the base keeps drawing from text
alone). A view's mask is drawn from its own pixels' digest: the same view gets the same mask whether its latents are
cached or encoded each step, and a flipped view gets another. White (1) is what the base fills, as the inpainting
pipelines read `mask_image`.
"""

from __future__ import annotations

import hashlib
import math
import random

import numpy as np
import torch
from PIL import Image, ImageDraw

# Each kind's share of the masks drawn.
MASK_KINDS = {"rectangle": 0.35, "ellipse": 0.25, "strokes": 0.3, "whole": 0.1}
RECIPE = "inpaint-masks-1:" + ",".join(f"{kind}={share}" for kind, share in MASK_KINDS.items())  # cache keys hold it


def random_mask(width: int, height: int, rng: random.Random) -> Image.Image:
    """One mask ("L", 0 or 255) of a kind drawn by `MASK_KINDS`: a rectangle or ellipse of a tenth to nine tenths of
    each side anywhere on the image, one to four brush strokes (random walks as wide as 4-12% of the shorter side), or
    the whole image."""
    mask = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(mask)
    kind = rng.choices(list(MASK_KINDS), weights=list(MASK_KINDS.values()))[0]
    if kind == "whole":
        draw.rectangle((0, 0, width, height), fill=255)
    elif kind == "strokes":
        short = min(width, height)
        for _ in range(rng.randint(1, 4)):
            x, y = rng.uniform(0, width), rng.uniform(0, height)
            thickness = max(1, round(short * rng.uniform(0.04, 0.12)))
            points = [(x, y)]
            for _ in range(rng.randint(2, 6)):
                angle, length = rng.uniform(0, 2 * math.pi), rng.uniform(0.1, 0.4) * short
                x = min(max(x + length * math.cos(angle), 0), width)
                y = min(max(y + length * math.sin(angle), 0), height)
                points.append((x, y))
            draw.line(points, fill=255, width=thickness, joint="curve")
            for px, py in points:  # round ends and joints, as a brush leaves them
                draw.ellipse((px - thickness / 2, py - thickness / 2, px + thickness / 2, py + thickness / 2), fill=255)
    else:
        w, h = rng.uniform(0.1, 0.9) * width, rng.uniform(0.1, 0.9) * height
        left, top = rng.uniform(0, width - w), rng.uniform(0, height - h)
        (draw.rectangle if kind == "rectangle" else draw.ellipse)((left, top, left + w, top + h), fill=255)
    return mask


def view_seed(pixels: torch.Tensor) -> int:
    """A seed from a view's pixels (3, [T,] H, W in [-1, 1]), as 8-bit values: the same image, resized and cut the
    same way, gives the same seed wherever it is read."""
    levels = ((pixels.detach().float().cpu() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return int.from_bytes(hashlib.sha256(levels.numpy().tobytes()).digest()[:8], "little")


def view_masks(pixels: torch.Tensor) -> torch.Tensor:
    """Each view's mask (B, 1, H, W) in {0, 1} for a batch of views (B, 3, H, W), from its own pixels."""
    height, width = pixels.shape[-2:]
    if pixels.is_meta:  # a plan's: only the shape counts
        return pixels.new_zeros(pixels.shape[0], 1, height, width)
    masks = [
        torch.from_numpy(np.asarray(random_mask(width, height, random.Random(view_seed(view))), dtype=np.float32) / 255)
        for view in pixels
    ]
    return torch.stack(masks)[:, None].to(pixels.device)
