"""Build a bundled tiny edit base: `python scripts/make_tiny_edit_base.py [--family flux|qwen_image]`
(models/tiny-flux_kontext from models/tiny-flux; models/tiny-qwen_image_edit_plus from models/tiny-qwen_image)
and the default edit jobs' pairs (examples/purple_edits).

The text-to-image base's components in its edit pipeline (its family's micro `edit_pipeline_of`), its transformer
fully fine-tuned by difftune on "make it <color>" recolor pairs of the seen colors (the held-out color never asked
for and never shown), with Qwen's language model, which learns to read the control; scored with the edit judge
against the same model before edit training, and the model card written. Deterministic by seed.
"""

import argparse
import json
import shutil
from pathlib import Path

from difftune.toy.judge import edit_score
from difftune.toy.tiny import recolor_pairs, write_pair_folder
from difftune.toy.tiny_base import (
    HELD_OUT_COLOR,
    SEEN_COLORS,
    TINY_BASES,
    build_edit_base,
    copy_into_borrowers,
    link_borrowed_files,
    scored_build,
)

CARD = """---
library_name: diffusers
pipeline_tag: image-to-image
tags: [difftune, tiny, synthetic, edit]
---
# {name}: a 32 px {kind} edit model of colored shapes, trained by difftune

`{source}`'s components ({components}, a {params:,}-parameter `{transformer}`) in a `{pipeline}`, {trained} by
`difftune train` on recolor pairs: a control image of a shape in one of the colors {seen}, the instruction
`make it <color>` (another of them), and the target: the same shape at the same place in that color. `{held_out}` is
never asked for nor shown: it is the edit the default edit job teaches (`configs/{job}.toml`).

Weights are fp16; on a CPU load them as fp32: `{pipeline}.from_pretrained(path, dtype=torch.float32)`.
{sampling}

## Recipe (`python scripts/make_tiny_edit_base.py --family {family}`, seed {seed})

{pairs} pairs, {steps} steps at batch {batch_size}, AdamW lr {learning_rate} cosine, rectified flow with the sampler's
resolution shift, caption dropout 0.1, cached latents, EMA {ema_decay} (what is saved); {seconds:.0f} s on 2 CPU cores.

## Scores (`difftune eval --base models/{name}`: {n} fixed pairs per color and shape)

| | before edit training | this base |
| --- | ---: | ---: |
| seen edits: asked color | {before_color:.3f} | {color:.3f} |
| seen edits: shape kept | {before_shape:.3f} | {shape:.3f} |
| seen edits: in place (mask overlap >= 0.5) | {before_place:.3f} | {place:.3f} |
| seen edits: color and shape | {before_both:.3f} | {both:.3f} |
| held-out edit (`make it {held_out}`): color and shape | {before_concept:.3f} | {concept:.3f} |

Full numbers: `scores.json`.
"""


# What each source family's edit base card says (the edit base's name, its job, how to sample it).
CARDS = {
    "flux": {
        "name": "tiny-flux_kontext",
        "kind": "FLUX.1 Kontext-style",
        "job": "flux_kontext_edit",
        "components": "autoencoders, CLIP, T5",
        "transformer": "FluxTransformer2DModel",
        "pipeline": "FluxKontextPipeline",
        "trained": "its transformer fully fine-tuned",
        "sampling": 'Sample with the control at the output\'s size: `pipeline(image=control, prompt="make it red", '
        'height=32, width=32,\nmax_area=32 * 32, _auto_resize=False, true_cfg_scale=3.0, negative_prompt="")` '
        "(no guidance embedding).",
    },
    "qwen_image": {
        "name": "tiny-qwen_image_edit_plus",
        "kind": "Qwen-Image-Edit-2509-style",
        "job": "qwen_image_edit",
        "components": "autoencoders, a Qwen2.5-VL language model with a vision tower, its tokenizer extended by the "
        "edit template's words and the vision tokens",
        "transformer": "QwenImageTransformer2DModel",
        "pipeline": "QwenImageEditPlusPipeline",
        "trained": "its transformer and language model fully fine-tuned",
        "sampling": "The pipeline resizes every control to about 1 MP; `difftune sample --base models/"
        'tiny-qwen_image_edit_plus --control\ncontrol.png --prompt "make it red" --resolution 32 '
        "--guidance-scale 3 --out samples` sizes it to the output's area.",
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(CARDS), default="flux", help="the text-to-image base's family")
    parser.add_argument("--source", type=Path, help="the text-to-image base (default: models/tiny-<family>)")
    parser.add_argument("--model-dir", type=Path, help="where the edit base goes (default: models/<its name>)")
    parser.add_argument("--examples-dir", type=Path, default=Path("examples"))
    parser.add_argument("--work-dir", type=Path, help="default: output/<its name>-build")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, help="default: the family's recipe's")
    args = parser.parse_args()
    card = CARDS[args.family]
    args.source = args.source or Path(f"models/tiny-{args.family}")
    args.model_dir = args.model_dir or Path("models") / card["name"]
    args.work_dir = args.work_dir or Path("output") / f"{card['name']}-build"
    recipe = TINY_BASES[args.family].edit_recipe | ({"steps": args.steps} if args.steps else {})
    copy_into_borrowers(args.model_dir)
    facts = build_edit_base(args.model_dir, args.work_dir, args.source, recipe, args.seed)
    link_borrowed_files(args.model_dir)
    facts = scored_build(
        args.model_dir,
        args.work_dir,
        facts,
        edit_score,
        "before_edit_training",
        CARD,
        **{key: value for key, value in card.items() if key != "name"},
        family=args.family,
        source=args.source.name,
        pairs=recipe["pairs_per_prompt"] * len(SEEN_COLORS) * 3,
    )
    scores, before = facts["base"], facts["before_edit_training"]
    # The default edit job's pairs: 16 purple edits of seen-color shapes 3 times per epoch, and 15 seen edits beside
    # them (as the text-to-image jobs keep renders of the seen colors: the frozen T5 puts "purple" near "green").
    folder = args.examples_dir / "purple_edits"
    shutil.rmtree(folder, ignore_errors=True)
    write_pair_folder(folder / "3_purple", recolor_pairs(16, args.seed + 7, (HELD_OUT_COLOR,), SEEN_COLORS))
    write_pair_folder(folder / "1_seen", recolor_pairs(15, args.seed + 21, SEEN_COLORS, SEEN_COLORS))
    print(
        json.dumps(
            {
                "seconds": facts["seconds"],
                "base_seen": scores["seen"],
                "base_concept": scores["concept"],
                "before_seen": before["seen"],
            }
        )
    )


if __name__ == "__main__":
    main()
