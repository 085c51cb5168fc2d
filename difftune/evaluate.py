"""Does the tiny base draw what it is asked, and did fine-tuning teach the held-out concept without forgetting?

A pixel-statistics judge names a 32 px shapes image's color and shape: the background is the median of the
border pixels; the foreground is every pixel far from it; the color is the palette entry nearest the
foreground's median; the shape comes from how much of its bounding box the foreground fills (square ~1,
circle ~pi/4, triangle ~1/2). `evaluate` samples fixed seeds per prompt and reports accuracies as JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from difftune.config import ModelConfig
from difftune.models import Components, assemble_pipeline, load_components
from difftune.sample import sampling_scheduler
from difftune.tiny import COLORS, SHAPES

FOREGROUND_DISTANCE = 60.0  # RGB distance from the background; backgrounds vary by < 35 per channel
MIN_FOREGROUND_FRACTION = 0.03
SQUARE_FILL, TRIANGLE_FILL = 0.89, 0.64  # fill-ratio cut points between triangle < circle < square


def judge(image: Image.Image) -> tuple[str | None, str | None]:
    """(color, shape) of a shapes image, or None where no shape is visible."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    background = np.median(border, axis=0)
    mask = np.linalg.norm(pixels - background, axis=-1) > FOREGROUND_DISTANCE
    if mask.mean() < MIN_FOREGROUND_FRACTION:
        return None, None
    foreground = np.median(pixels[mask], axis=0)
    color = min(COLORS, key=lambda name: np.linalg.norm(foreground - np.array(COLORS[name], dtype=np.float32)))
    rows, columns = np.nonzero(mask)
    box = (rows.max() - rows.min() + 1) * (columns.max() - columns.min() + 1)
    fill = mask.sum() / box
    shape = "square" if fill >= SQUARE_FILL else "circle" if fill >= TRIANGLE_FILL else "triangle"
    return color, shape


@dataclass
class EvalSettings:
    samples_per_prompt: int = 8
    seed: int = 1000  # sample k of a prompt uses seed + k, for every prompt and every model
    steps: int = 20
    guidance_scale: float = 3.0
    scheduler: str = "ddim"


@torch.no_grad()
def judged_samples(components: Components, prompts: list[str], settings: EvalSettings) -> list[dict]:
    """Each prompt's samples (fixed seeds), judged: one row per image."""
    pipeline = assemble_pipeline(components, sampling_scheduler(settings.scheduler, components))
    pipeline.set_progress_bar_config(disable=True)
    for module in (components.unet, components.text_encoder, components.vae):
        module.eval()
    rows = []
    for prompt in prompts:
        seeds = [settings.seed + k for k in range(settings.samples_per_prompt)]
        images = pipeline(
            [prompt] * len(seeds),
            num_inference_steps=settings.steps,
            guidance_scale=settings.guidance_scale,
            generator=[torch.Generator("cpu").manual_seed(seed) for seed in seeds],
        ).images
        for seed, image in zip(seeds, images):
            color, shape = judge(image)
            rows.append({"prompt": prompt, "seed": seed, "color": color, "shape": shape, "image": image})
    return rows


def accuracy(rows: list[dict]) -> dict:
    """Fractions of images whose color, shape, and both match their prompt (`a <color> <shape>`)."""
    def asked(row):
        *_, color, shape = row["prompt"].split()
        return color, shape

    color = np.mean([row["color"] == asked(row)[0] for row in rows])
    shape = np.mean([row["shape"] == asked(row)[1] for row in rows])
    both = np.mean([(row["color"], row["shape"]) == asked(row) for row in rows])
    return {"color": float(color), "shape": float(shape), "both": float(both), "images": len(rows)}


def prompts_for(colors) -> list[str]:
    return [f"a {color} {shape}" for color in colors for shape in SHAPES]


def score(components: Components, seen_colors, concept_color: str, settings: EvalSettings) -> dict:
    """Accuracies on the seen prompts and on the concept's prompts (overall and per shape)."""
    seen = judged_samples(components, prompts_for(seen_colors), settings)
    concept = judged_samples(components, prompts_for([concept_color]), settings)
    return {
        "seen": accuracy(seen),
        "concept": accuracy(concept),
        "concept_by_shape": {shape: accuracy([r for r in concept if r["prompt"].endswith(shape)]) for shape in SHAPES},
    }


def evaluate(base: str, adapter: Path | None, seen_colors, concept_color: str, settings: EvalSettings) -> dict:
    """The base's scores, and with `adapter`, the adapted model's and the forgetting between them."""
    from difftune.export import apply_adapters  # export imports sampling; keep this module light to import

    report = {"settings": vars(settings) | {"base": base, "concept_color": concept_color}}
    components = load_components(ModelConfig(base=base))
    report["before"] = score(components, seen_colors, concept_color, settings)
    if adapter:
        apply_adapters(components, [(adapter, 1.0)], base=base)  # onto the same base, in place
        report["adapter"] = str(adapter)
        report["after"] = score(components, seen_colors, concept_color, settings)
        report["forgetting"] = report["before"]["seen"]["both"] - report["after"]["seen"]["both"]
    return report
