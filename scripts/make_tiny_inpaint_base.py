"""Build the bundled tiny inpainting base: `python scripts/make_tiny_inpaint_base.py` (models/tiny-sd_inpaint from
models/tiny-sd) and the default inpainting job's sample (examples/inpaint).

The text-to-image base's components in its inpainting pipeline (the inpainting family's micro `inpaint_pipeline_of`:
the UNet's input layer widened to the mask and the masked image, their weights zero), its UNet fully fine-tuned by
difftune on the seen colors' shapes, each view under a random mask (the held-out color never shown); scored with the
fill judge against the widened model before training, and the model card written. Deterministic by seed.
"""

import argparse
import json
import shutil
from pathlib import Path

from difftune.toy.judge import inpaint_score
from difftune.toy.tiny import inpaint_cases
from difftune.toy.tiny_base import (
    HELD_OUT_COLOR,
    SEEN_COLORS,
    TINY_BASES,
    as_published,
    build_inpaint_base,
    copy_into_borrowers,
    link_borrowed_files,
    scored_build,
)

CARD = """---
library_name: diffusers
pipeline_tag: image-to-image
tags: [difftune, tiny, synthetic, inpainting]
---
# {name}: a 32 px Stable Diffusion inpainting model of colored shapes, trained by difftune

`{source}`'s components in a `StableDiffusionInpaintPipeline`: its {params:,}-parameter `UNet2DConditionModel`
widened to read the mask and the masked image's latents (4 + 1 + 4 channels, the new ones zero at first, as
SD-inpainting was made from SD) and fully fine-tuned by `difftune train` on shapes in the colors {seen}, each view
under a random mask (rectangles, ellipses, brush strokes, now and then the whole image). `{held_out}` is never shown:
it is what the default inpainting job teaches (`configs/tiny_inpaint_lora.toml`).

Weights are fp16; on a CPU load them as fp32: `StableDiffusionInpaintPipeline.from_pretrained(path,
dtype=torch.float32)`. Sample it as `difftune sample --base models/{name} --control image.png --control mask.png
--prompt "a red circle" --resolution 32 --guidance-scale 3 --out samples` (white in the mask: where it draws).

## Recipe (`python scripts/make_tiny_inpaint_base.py`, seed {seed})

{images} images, {steps} steps at batch {batch_size}, AdamW lr {learning_rate} cosine, min-SNR weighting, offset
noise 0.1, caption dropout 0.1, both views, cached latents, EMA {ema_decay} (what is saved); {seconds:.0f} s on 2 CPU
cores.

## Scores (`difftune eval --base models/{name}`: {n} fixed fills per color and shape)

Each fill: an image of a shape in a seen color, its bounding box (and 2 px around) masked, another color and shape
asked for.

| | the widened base, untrained | this base |
| --- | ---: | ---: |
| seen fills: asked color and shape | {before_both:.3f} | {both:.3f} |
| seen fills: the shape inside the mask | {before_inside:.3f} | {inside:.3f} |
| seen fills: the rest kept (mean difference <= 12 of 255) | {before_kept:.3f} | {kept:.3f} |
| seen fills: all of these | {before_all:.3f} | {all:.3f} |
| seen fills: mean difference outside the mask | {before_kept_difference:.1f} | {kept_difference:.1f} |
| held-out fills (`a {held_out} <shape>`): color and shape | {before_concept:.3f} | {concept:.3f} |

Full numbers: `scores.json`.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=Path("models/tiny-sd"), help="the text-to-image base")
    parser.add_argument("--model-dir", type=Path, default=Path("models/tiny-sd_inpaint"))
    parser.add_argument("--examples-dir", type=Path, default=Path("examples"))
    parser.add_argument("--work-dir", type=Path, default=Path("output/tiny-sd_inpaint-build"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="default: the recipe's")
    args = parser.parse_args()
    recipe = TINY_BASES["sd"].inpaint_recipe | ({"steps": args.steps} if args.steps else {})
    copy_into_borrowers(args.model_dir)
    facts = build_inpaint_base(args.model_dir, args.work_dir, args.source, recipe, args.seed)
    as_published(args.model_dir)
    link_borrowed_files(args.model_dir)
    images = recipe["images_per_prompt"] * len(SEEN_COLORS) * 3
    facts = scored_build(
        args.model_dir,
        args.work_dir,
        facts,
        inpaint_score,
        "before_inpaint_training",
        CARD,
        source=args.source.name,
        images=images,
    )
    scores, before = facts["base"], facts["before_inpaint_training"]
    # The default inpainting job's sample: a seen-color shape whose box is filled with a purple one
    folder = args.examples_dir / "inpaint"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    [(image, mask, _)] = inpaint_cases(1, args.seed + 5, (HELD_OUT_COLOR,), SEEN_COLORS)
    image.save(folder / "image.png")
    mask.save(folder / "mask.png")
    print(json.dumps({"seconds": facts["seconds"], "base_seen": scores["seen"], "before_seen": before["seen"]}))


if __name__ == "__main__":
    main()
