"""Does the tiny base draw what it is asked, and did fine-tuning teach the held-out concept without forgetting?

A pixel-statistics judge names a 32 px shapes image's color and shape, or abstains: the background is the
median of the border pixels, and most of the border must be near it; the foreground is every pixel far
from it, and must be mostly one blob of one palette color (else there is no shape to name, as in an
untrained model's colored noise). The color is the
palette entry nearest the blob's median; the shape comes from where the blob fills its bounding box: an
apex-up triangle has little in its top half and empty top corners, a square fills all four corners, a
circle none. `evaluate` samples fixed seeds per prompt and reports accuracies as JSON.

A video base is scored on clips of "a <color> <shape> moving <direction>": each frame judged for color and shape,
and the clip for its motion: the shape's centre (the mean of its mask) from the first frame it is seen in to the
last must move at least `MIN_MOTION` pixels, and mostly the asked way.

A ControlNet or a control LoRA (`placement_score`) is scored on where it draws: held-out silhouettes
(`tiny.placed_shape_pairs`), each drawn from its caption, judged for color and shape and for the overlap of the drawn
shape with the silhouette.

An inpainting base is scored on fills (`inpaint_score`): fixed cases (`tiny.inpaint_cases`), a shape's bounding box
masked and another color and shape asked for, each output judged for the asked color and shape, the drawn shape
inside the mask (`MIN_INSIDE`) and the rest of the image kept (`MAX_KEPT_DIFFERENCE`).

An edit base is scored on edits instead: fixed recolor pairs (`tiny.recolor_pairs`) asked "make it <color>", each
output judged for the asked color, the control's shape kept, and the shape kept in place (the overlap of the
control's and the output's shape masks).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from difftune.config import ModelConfig
from difftune.errors import DifftuneError
from difftune.families import load_components
from difftune.families.common.inpainting import InpaintDrawing
from difftune.models.components import Components
from difftune.toy.judging import EvalSettings, PrintStatus, counted, drawn_by_prompt, eval_pipeline, within
from difftune.toy.tiny import (
    CLIP_FRAMES,
    COLORS,
    DIRECTIONS,
    SHAPES,
    inpaint_cases,
    placed_shape_pairs,
    recolor_pairs,
)
from difftune.toy.tone_judge import tone_score

MIN_PLACE_OVERLAP = 0.5  # intersection over union of the control's and the edit's shape masks: "in place"
MIN_MOTION = 3.0  # pixels the shape's centre moves over a clip to count as moving (the clips it learns from: 8)
MIN_INSIDE = 0.9  # of an inpainted shape's pixels within the mask: drawn where it was asked
MAX_KEPT_DIFFERENCE = 12.0  # mean absolute difference (0-255) outside an inpainting mask: the rest kept

FOREGROUND_DISTANCE = 60.0  # RGB distance from the background; backgrounds vary by < 35 per channel
MIN_FOREGROUND_FRACTION = 0.03
MIN_PLAIN_BORDER = 0.5  # of the border near the background color (renders: >= 0.61; colored noise: median 0.17)
MIN_BLOB_SHARE = 0.85  # of the foreground in its largest 4-connected blob
MAX_BLOB_SPREAD = 45.0  # median RGB distance of the blob's pixels from its median (the base: <= 31; noise: ~90)
MAX_COLOR_DISTANCE = 100.0  # RGB distance to the nearest palette color: faded colors pass, other hues do not
CORNER = 0.25  # corner patches: this fraction of the bounding box's shorter side
FULL_CORNER, EMPTY_CORNER = 0.6, 0.55  # a square's corners are filled; a circle's are mostly not
TRIANGLE_TOP_SHARE, TRIANGLE_TOP_CORNERS = 0.4, 0.3  # an apex-up triangle has 1/4 of its area in its top half


def judge(image: Image.Image) -> tuple[str | None, str | None]:
    """(color, shape) of a shapes image; (None, None) where no shape is visible; shape None where it is none
    of the three."""
    found = _shape_blob(image)
    return (None, None) if found is None else (found[1], _shape(found[0]))


def shape_mask(image: Image.Image) -> np.ndarray | None:
    """The pixels of the shape `judge` sees (H, W) bool, or None where it sees none."""
    found = _shape_blob(image)
    return None if found is None else found[0]


def _shape_blob(image: Image.Image) -> tuple[np.ndarray, str] | None:
    """The shape's blob and its palette color, or None where no shape is visible."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32)
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
    background = np.median(border, axis=0)
    plain_border = (np.linalg.norm(border - background, axis=-1) <= FOREGROUND_DISTANCE).mean()
    mask = np.linalg.norm(pixels - background, axis=-1) > FOREGROUND_DISTANCE
    if mask.mean() < MIN_FOREGROUND_FRACTION or plain_border < MIN_PLAIN_BORDER:
        return None
    blob = _largest_blob(mask)
    foreground = np.median(pixels[blob], axis=0)
    spread = np.median(np.linalg.norm(pixels[blob] - foreground, axis=-1))
    distances = {name: np.linalg.norm(foreground - np.array(rgb, dtype=np.float32)) for name, rgb in COLORS.items()}
    color = min(distances, key=distances.get)
    if blob.sum() < MIN_BLOB_SHARE * mask.sum() or spread > MAX_BLOB_SPREAD or distances[color] > MAX_COLOR_DISTANCE:
        return None
    return blob, color


def _shape(blob: np.ndarray) -> str | None:
    rows, columns = np.nonzero(blob)
    box = blob[rows.min() : rows.max() + 1, columns.min() : columns.max() + 1].astype(np.float32)
    height, width = box.shape
    top_share = box[: height // 2].sum() / box.sum()
    k = max(1, round(min(height, width) * CORNER))
    corners = np.array([box[:k, :k].mean(), box[:k, -k:].mean(), box[-k:, :k].mean(), box[-k:, -k:].mean()])
    if top_share < TRIANGLE_TOP_SHARE and corners[:2].mean() < TRIANGLE_TOP_CORNERS:
        return "triangle"
    if corners.min() >= FULL_CORNER:
        return "square"
    if corners.max() <= EMPTY_CORNER and TRIANGLE_TOP_SHARE <= top_share <= 1 - TRIANGLE_TOP_SHARE:
        return "circle"
    return None


def judge_clip(frames: list[Image.Image]) -> tuple[list[str | None], list[str | None], str | None]:
    """Each frame's (color, shape) by `judge`, and the clip's direction (a key of `DIRECTIONS`), None where the shape
    is seen in fewer than two frames or moves less than `MIN_MOTION` pixels."""
    judged = [_shape_blob(frame) for frame in frames]
    colors = [found[1] if found else None for found in judged]
    shapes = [_shape(found[0]) if found else None for found in judged]
    centres = [np.argwhere(found[0]).mean(axis=0)[::-1] for found in judged if found]  # (x, y)
    if len(centres) < 2 or np.linalg.norm(centres[-1] - centres[0]) < MIN_MOTION:
        return colors, shapes, None
    moved = centres[-1] - centres[0]
    return colors, shapes, max(DIRECTIONS, key=lambda name: float(np.dot(moved, DIRECTIONS[name])))


def _largest_blob(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected region of `mask` (a flood fill; 32 px images need nothing faster)."""
    labels = np.zeros(mask.shape, dtype=np.int32)
    label, best, best_size = 0, 0, 0
    for start in zip(*np.nonzero(mask), strict=True):
        if labels[start]:
            continue
        label += 1
        labels[start], stack, size = label, [start], 0
        while stack:
            row, column = stack.pop()
            size += 1
            for neighbour in ((row + 1, column), (row - 1, column), (row, column + 1), (row, column - 1)):
                if (
                    0 <= neighbour[0] < mask.shape[0]
                    and 0 <= neighbour[1] < mask.shape[1]
                    and mask[neighbour]
                    and not labels[neighbour]
                ):
                    labels[neighbour] = label
                    stack.append(neighbour)
        if size > best_size:
            best, best_size = label, size
    return labels == best


def shapes_reward(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """The judge as a reward (`reward.scorer = "difftune.toy.judge:shapes_reward"`): per image, half for the asked
    shape as `judge` names it, half for how near the drawn foreground is to the asked color (1 at the palette's color,
    falling linearly with the RGB distance). The color half is soft, with gradients through the pixels: a base that
    never draws the color still ranks its images by how near they come (GRPO's signal; DRaFT's gradient).
    images: (B, 3, H, W) in [0, 1]."""
    scores = []
    for pixels, prompt in zip(images, prompts, strict=True):
        words = prompt.split()
        color = next((word for word in words if word in COLORS), None)
        shape = next((word for word in words if word in SHAPES), None)
        rgb = pixels * 255
        image = Image.fromarray(rgb.detach().round().clamp(0, 255).byte().permute(1, 2, 0).cpu().numpy())
        _, drawn_shape = judge(image)
        shape_score = float(shape is not None and drawn_shape == shape)
        color_score = rgb.new_zeros(())
        if color is not None:
            border = torch.cat([rgb[:, 0], rgb[:, -1], rgb[:, :, 0], rgb[:, :, -1]], dim=1)
            background = border.median(dim=1).values.detach().view(3, 1, 1)
            # The foreground's weights carry no gradient: the color half moves the drawn pixels' colors, never the
            # outline (with them, dropping a square's off-color corners from the foreground raised the score).
            foreground = torch.sigmoid(((rgb - background).norm(dim=0) - FOREGROUND_DISTANCE) / 10).detach()
            target = torch.tensor(COLORS[color], dtype=rgb.dtype, device=rgb.device).view(3, 1, 1)
            nearness = 1 - (rgb - target).norm(dim=0) / (255 * 3**0.5)
            least = MIN_FOREGROUND_FRACTION * foreground.numel()  # a speck of color is no shape of it
            color_score = (foreground * nearness).sum() / foreground.sum().clamp(min=least)
        scores.append(0.5 * shape_score + 0.5 * color_score)
    return torch.stack([torch.as_tensor(score, dtype=images.dtype, device=images.device) for score in scores])


@torch.no_grad()
def judged_samples(
    components: Components, prompts: list[str], settings: EvalSettings, print_status: PrintStatus = None
) -> list[dict]:
    """Each prompt's samples (fixed seeds, `drawn_by_prompt`), judged: one row per image."""
    drawing, options, size = components.family.drawing, components.family_options, settings.resolution
    rows = []
    for prompt, seed, image in drawn_by_prompt(
        components,
        prompts,
        settings,
        print_status,
        lambda pipeline, batch, **arguments: drawing.draw(pipeline, options, batch, [], size, size, **arguments),
    ):
        color, shape = judge(image)
        rows.append({"prompt": prompt, "seed": seed, "color": color, "shape": shape, "image": image})
    return rows


@torch.no_grad()
def judged_clips(
    components: Components, prompts: list[str], settings: EvalSettings, frames: int, print_status: PrintStatus = None
) -> list[dict]:
    """Each prompt's clips (fixed seeds, as `judged_samples`), judged: one row per clip."""
    drawing, size = components.family.drawing, settings.resolution
    rows = []
    for prompt, seed, clip in drawn_by_prompt(
        components,
        prompts,
        settings,
        print_status,
        lambda pipeline, batch, **arguments: drawing.draw_clips(pipeline, batch, [], size, size, frames, **arguments),
    ):
        colors, shapes, direction = judge_clip(clip)
        rows.append(
            {"prompt": prompt, "seed": seed, "colors": colors, "shapes": shapes, "direction": direction, "clip": clip}
        )
    return rows


def clip_accuracy(rows: list[dict]) -> dict:
    """Fractions of frames in the asked color, of the asked shape, and both; of clips moving the asked way; and of
    clips with all of it in every frame (`a <color> <shape> moving <direction>`)."""

    def asked(row):
        *_, color, shape, _, direction = row["prompt"].split()
        return color, shape, direction

    color = [[c == asked(row)[0] for c in row["colors"]] for row in rows]
    shape = [[s == asked(row)[1] for s in row["shapes"]] for row in rows]
    direction = [row["direction"] == asked(row)[2] for row in rows]
    both = [np.logical_and(c, s) for c, s in zip(color, shape, strict=True)]
    return {
        "color": float(np.mean(color)),
        "shape": float(np.mean(shape)),
        "both": float(np.mean(both)),
        "direction": float(np.mean(direction)),
        "all": float(np.mean([b.all() and d for b, d in zip(both, direction, strict=True)])),
        "clips": len(rows),
    }


def clip_prompts_for(colors) -> list[str]:
    return [f"a {color} {shape} moving {direction}" for color in colors for shape in SHAPES for direction in DIRECTIONS]


def clip_score(
    components: Components,
    seen_colors,
    concept_color: str,
    settings: EvalSettings,
    frames: int,
    concept_word: str = "",
    print_status: PrintStatus = None,
) -> dict:
    """`score` for a video base: clip accuracies on the seen prompts and the concept's (overall and per shape), each
    prompt naming a direction; `samples_per_prompt` clips per (color, shape), spread over the directions."""
    per_direction = replace(settings, samples_per_prompt=max(1, settings.samples_per_prompt // len(DIRECTIONS)))
    seen = judged_clips(components, clip_prompts_for(seen_colors), per_direction, frames, within(print_status, "seen"))
    concept = judged_clips(
        components,
        clip_prompts_for([concept_word or concept_color]),
        per_direction,
        frames,
        within(print_status, "concept"),
    )
    for row in concept:
        row["prompt"] = row["prompt"].replace(concept_word or concept_color, concept_color)
    return {
        "seen": clip_accuracy(seen),
        "concept": clip_accuracy(concept),
        "concept_by_shape": {
            shape: clip_accuracy([r for r in concept if f" {shape} " in r["prompt"]]) for shape in SHAPES
        },
    }


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


def score(
    components: Components,
    seen_colors,
    concept_color: str,
    settings: EvalSettings,
    concept_word: str = "",
    print_status: PrintStatus = None,
) -> dict:
    """Accuracies on the seen prompts and on the concept's prompts (overall and per shape). `concept_word` is what
    the concept's prompts say instead of its color (a textual-inversion token); they are judged by the color."""
    seen = judged_samples(components, prompts_for(seen_colors), settings, within(print_status, "seen"))
    concept = judged_samples(
        components, prompts_for([concept_word or concept_color]), settings, within(print_status, "concept")
    )
    for row in concept:
        row["prompt"] = row["prompt"].replace(concept_word or concept_color, concept_color)
    return {
        "seen": accuracy(seen),
        "concept": accuracy(concept),
        "concept_by_shape": {shape: accuracy([r for r in concept if r["prompt"].endswith(shape)]) for shape in SHAPES},
    }


def judged_edits(
    components: Components, colors, source_colors, settings: EvalSettings, print_status: PrintStatus = None
) -> list[dict]:
    """`samples_per_prompt` fixed recolor pairs per (asked color, shape), each control drawn from `source_colors`,
    edited with the instruction (sample k of a prompt with seed + k), judged: one row per edit."""

    def pairs(count: int, seed: int, color: str, shape: str) -> list:
        return recolor_pairs(count, seed, (color,), source_colors, (shape,))

    return _judged_pairs(components, colors, pairs, shape_mask, True, settings, print_status)


@torch.no_grad()
def _judged_pairs(
    components: Components,
    colors,
    pairs,
    control_mask,
    with_controls: bool,
    settings: EvalSettings,
    print_status: PrintStatus,
) -> list[dict]:
    """`samples_per_prompt` fixed pairs (control, target, prompt) per (color, shape) of `colors`, made by
    `pairs(count, seed, color, shape)`, each drawn from its prompt (and, `with_controls`, its control; sample k of a
    (color, shape) with seed + k), judged: its color, its shape and the overlap (intersection over union) of the drawn
    shape with `control_mask(control)`. One row per pair."""
    pipeline, guidance = eval_pipeline(components, settings)
    rows = []
    for prompt in counted([f"{color} {shape}" for color in colors for shape in SHAPES], print_status):
        color, shape = prompt.split()
        pair_seed = settings.seed + 1000 * list(COLORS).index(color) + 100 * SHAPES.index(shape)
        for k, (control, _, text) in enumerate(pairs(settings.samples_per_prompt, pair_seed, color, shape)):
            [image] = components.family.drawing.draw(
                pipeline,
                components.family_options,
                text,
                [control] if with_controls else [],
                settings.resolution,
                settings.resolution,
                num_inference_steps=settings.steps,
                **guidance,
                generator=torch.Generator("cpu").manual_seed(settings.seed + k),
            )
            drawn_color, drawn_shape = judge(image)
            wanted, drawn = control_mask(control), shape_mask(image)
            overlap = float((wanted & drawn).sum() / (wanted | drawn).sum()) if drawn is not None else 0.0
            rows.append(
                {
                    "asked": color,
                    "shape": shape,
                    "color": drawn_color,
                    "drawn_shape": drawn_shape,
                    "overlap": overlap,
                    "image": image,
                }
            )
    return rows


def edit_accuracy(rows: list[dict]) -> dict:
    """Fractions of edits (or placements) in the asked color, with the control's shape, in its place, color and shape
    both, and all; the mean overlap with the control's shape."""
    color = [row["color"] == row["asked"] for row in rows]
    shape = [row["drawn_shape"] == row["shape"] for row in rows]
    place = [row["overlap"] >= MIN_PLACE_OVERLAP for row in rows]
    return {
        "color": float(np.mean(color)),
        "shape": float(np.mean(shape)),
        "place": float(np.mean(place)),
        "both": float(np.mean(np.logical_and(color, shape))),
        "all": float(np.mean(np.logical_and.reduce([color, shape, place]))),
        "overlap": float(np.mean([row["overlap"] for row in rows])),
        "edits": len(rows),
    }


def silhouette_mask(control: Image.Image) -> np.ndarray:
    """The white shape of a ControlNet's control image (`placed_shape_pairs`), (H, W) bool."""
    return np.asarray(control.convert("L")) > 127


def judged_placements(
    components: Components, colors, settings: EvalSettings, print_status: PrintStatus = None
) -> list[dict]:
    """`samples_per_prompt` fixed ControlNet pairs per (color, shape) (`placed_shape_pairs`; seeds of their own, so
    held out from any training set made with small seeds), each drawn from its caption and, where the components
    read control images (`Drawing.draws_from_control`), its control image (the base alone draws the caption),
    judged: its color and shape, and the overlap of the drawn shape with the control's silhouette (intersection over
    union)."""

    def pairs(count: int, seed: int, color: str, shape: str) -> list:
        return placed_shape_pairs(count, seed, (color,), (shape,))

    return _judged_pairs(
        components,
        colors,
        pairs,
        silhouette_mask,
        components.family.drawing.draws_from_control(components),
        settings,
        print_status,
    )


def placement_score(components: Components, colors, settings: EvalSettings, print_status: PrintStatus = None) -> dict:
    """A ControlNet's accuracies on `colors`' shapes: overall (`seen`, as the other scores name what was trained) and
    per shape."""
    rows = judged_placements(components, colors, settings, print_status)
    return {
        "seen": edit_accuracy(rows),
        "seen_by_shape": {shape: edit_accuracy([r for r in rows if r["shape"] == shape]) for shape in SHAPES},
    }


def edit_score(
    components: Components, seen_colors, concept_color: str, settings: EvalSettings, print_status: PrintStatus = None
) -> dict:
    """An edit base's accuracies on the seen colors' edits and on the concept's (overall and per shape); every
    control is of a seen color."""
    return _seen_and_concept(
        judged_edits, edit_accuracy, "edits", components, seen_colors, concept_color, settings, print_status
    )


def _seen_and_concept(
    judged, accuracy_of, what: str, components, seen_colors, concept_color, settings, print_status
) -> dict:
    """`judged` (edits or fills) of the seen colors and of the concept's, each from images of the seen colors, and
    `accuracy_of` them: overall, and the concept's per shape."""
    seen = judged(components, seen_colors, seen_colors, settings, within(print_status, f"seen {what}"))
    concept = judged(components, [concept_color], seen_colors, settings, within(print_status, f"concept {what}"))
    return {
        "seen": accuracy_of(seen),
        "concept": accuracy_of(concept),
        "concept_by_shape": {shape: accuracy_of([r for r in concept if r["shape"] == shape]) for shape in SHAPES},
    }


@torch.no_grad()
def judged_inpaints(
    components: Components, colors, source_colors, settings: EvalSettings, print_status: PrintStatus = None
) -> list[dict]:
    """`samples_per_prompt` fixed inpainting cases per (asked color, shape), each image of `source_colors`, drawn
    into its mask (sample k of a prompt with seed + k), judged: its color and shape, the share of the drawn shape
    inside the mask and the mean difference from the image outside it. One row per fill."""
    pipeline, guidance = eval_pipeline(components, settings)
    rows = []
    for prompt in counted([f"{color} {shape}" for color in colors for shape in SHAPES], print_status):
        color, shape = prompt.split()
        case_seed = settings.seed + 1000 * list(COLORS).index(color) + 100 * SHAPES.index(shape)
        cases = inpaint_cases(settings.samples_per_prompt, case_seed, (color,), source_colors, (shape,))
        for k, (image, mask, text) in enumerate(cases):
            [drawn] = components.family.drawing.draw(
                pipeline,
                components.family_options,
                text,
                [image, mask],
                settings.resolution,
                settings.resolution,
                num_inference_steps=settings.steps,
                **guidance,
                generator=torch.Generator("cpu").manual_seed(settings.seed + k),
            )
            inside = np.asarray(mask) > 127
            drawn_color, drawn_shape = judge(drawn)
            blob = shape_mask(drawn)
            difference = np.abs(np.asarray(drawn, np.float32) - np.asarray(image, np.float32))[~inside].mean()
            rows.append(
                {
                    "asked": color,
                    "shape": shape,
                    "color": drawn_color,
                    "drawn_shape": drawn_shape,
                    "inside": float((blob & inside).sum() / blob.sum()) if blob is not None else 0.0,
                    "kept_difference": float(difference),
                    "image": drawn,
                }
            )
    return rows


def inpaint_accuracy(rows: list[dict]) -> dict:
    """Fractions of fills in the asked color, shape, both, inside the mask, with the rest kept, and all of these;
    the mean difference outside the masks."""
    color = [row["color"] == row["asked"] for row in rows]
    shape = [row["drawn_shape"] == row["shape"] for row in rows]
    inside = [row["inside"] >= MIN_INSIDE for row in rows]
    kept = [row["kept_difference"] <= MAX_KEPT_DIFFERENCE for row in rows]
    return {
        "color": float(np.mean(color)),
        "shape": float(np.mean(shape)),
        "both": float(np.mean(np.logical_and(color, shape))),
        "inside": float(np.mean(inside)),
        "kept": float(np.mean(kept)),
        "all": float(np.mean(np.logical_and.reduce([color, shape, inside, kept]))),
        "kept_difference": float(np.mean([row["kept_difference"] for row in rows])),
        "fills": len(rows),
    }


def inpaint_score(
    components: Components, seen_colors, concept_color: str, settings: EvalSettings, print_status: PrintStatus = None
) -> dict:
    """An inpainting base's accuracies on fills of the seen colors and of the concept (overall and per shape); every
    image it fills is of a seen color."""
    return _seen_and_concept(
        judged_inpaints, inpaint_accuracy, "fills", components, seen_colors, concept_color, settings, print_status
    )


class ShapesJudge:
    """`validation.eval_concept`'s judge on the shapes bases (`training.validation.Judge`), registered in
    pyproject.toml: a color is scored on its shapes' prompts, the other colors' prompts measure forgetting."""

    concepts = tuple(COLORS)

    def scores(self, components: Components, concept: str, samples_per_prompt: int) -> tuple[float, float]:
        seen = [color for color in COLORS if color != concept]
        report = score(components, seen, concept, EvalSettings(samples_per_prompt=samples_per_prompt))
        return report["concept"]["both"], report["seen"]["both"]


SHAPES_JUDGE = ShapesJudge()


def model_score(
    components: Components,
    seen_colors,
    concept_color: str,
    settings: EvalSettings,
    concept_word: str = "",
    print_status: PrintStatus = None,
    placements: bool = False,
) -> dict:
    """A model's scores as `evaluate` takes them, on what `scored_on` says (a sound base's: `seen_colors` and
    `concept_color` are pitches, `concepts_of`)."""
    scored = scored_on(components, placements)
    if scored == "sounds":
        return tone_score(components, seen_colors, concept_color, settings, concept_word, print_status)
    if scored == "placements":
        return placement_score(components, seen_colors, settings, print_status)
    if scored == "edits":
        return edit_score(components, seen_colors, concept_color, settings, print_status)
    if scored == "fills":
        return inpaint_score(components, seen_colors, concept_color, settings, print_status)
    if scored == "clips":
        return clip_score(components, seen_colors, concept_color, settings, CLIP_FRAMES, concept_word, print_status)
    return score(components, seen_colors, concept_color, settings, concept_word, print_status)


def scored_on(components: Components, placements: bool = False) -> str:
    """What a model is scored on: `placements` (a ControlNet or control LoRA: where the seen colors' shapes are
    drawn), edits for an edit base, fills for an inpainting base, clips for a video base, sounds for a sound base (the
    tone judge's), else prompts (`score`)."""
    if placements:
        return "placements"
    if components.family.reads_sound:
        return "sounds"
    if components.family.edit_base:
        return "edits"
    if isinstance(components.family.drawing, InpaintDrawing):
        return "fills"
    return "clips" if components.family.reads_clips else "prompts"


def concepts_of(base: str) -> tuple[tuple[str, ...], str]:
    """What a base is judged by: the shapes' colors and the one the tiny bases never saw, or for a sound base the
    tones' pitches and the one the tiny sound base never heard."""
    from difftune.families import family_of
    from difftune.toy.tones import HELD_OUT_PITCH, PITCHES

    if family_of(ModelConfig(base=base)).reads_sound:
        return tuple(PITCHES), HELD_OUT_PITCH
    return tuple(COLORS), "purple"


def evaluate(
    base: str,
    adapter: Path | None,
    seen_colors,
    concept_color: str,
    settings: EvalSettings,
    concept_word: str = "",
    print_status: PrintStatus = None,
) -> dict:
    """The base's scores, and with `adapter`, the adapted model's and the forgetting between them; `concept_word`
    (see `score`) in the adapted model's concept prompts. `print_status` hears each prompt as it starts."""
    from difftune.adapters.export import apply_adapters

    report = {"settings": vars(settings) | {"base": base, "concept_color": concept_color}}
    components = load_components(ModelConfig(base=base))
    if concept_word and scored_on(components) == "edits":
        raise DifftuneError(f"--concept-word: {base} is an edit base, scored on edits that name the color")
    # The adapted model loaded beside the base: whether it draws from controls (a ControlNet, a control LoRA's
    # widened denoiser) decides what the base is scored on too.
    adapted = None
    if adapter:
        adapted = load_components(ModelConfig(base=base))
        apply_adapters(adapted, [(adapter, 1.0)])
    placements = adapted is not None and adapted.family.drawing.draws_from_control(adapted)

    def scored(components: Components, model: str, word: str = "") -> dict:
        said = within(print_status, f"{model}:")
        return model_score(components, seen_colors, concept_color, settings, word, said, placements)

    report["scored"] = scored_on(components, placements)
    report["before"] = scored(components, "base")
    if adapted is not None:
        report["adapter"] = str(adapter)
        report["after"] = scored(adapted, "adapted", concept_word)
        report["settings"]["concept_word"] = concept_word or concept_color
        report["forgetting"] = report["before"]["seen"]["both"] - report["after"]["seen"]["both"]
    return report
