"""Build the bundled tiny turbo base: `python scripts/make_tiny_turbo_base.py` (models/tiny-z_image_turbo from
models/tiny-z_image, with its training adapter, and examples/turbo_seen, its default job's seen images).

The base distilled to four unguided steps (toy/turbo.py: its guided 32-step trajectories regressed step by step), then
its de-distilling training adapter made as ai-toolkit's are (a LoRA at a low learning rate on the turbo's own
samples); each scored by the shapes judge as the turbo is drawn and as the base is, and the model card written.
Deterministic by seed.
"""

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

from difftune.adapters.export import apply_adapters
from difftune.config import ModelConfig
from difftune.families import load_components
from difftune.toy.judge import EvalSettings, prompts_for, score
from difftune.toy.tiny_base import (
    HELD_OUT_COLOR,
    SEEN_COLORS,
    as_published,
    copy_into_borrowers,
    link_borrowed_files,
    timed,
)
from difftune.toy.turbo import (
    TRAINING_ADAPTER,
    TurboRecipe,
    build_turbo_base,
    make_training_adapter,
    write_own_samples,
)

CARD = """---
library_name: diffusers
pipeline_tag: text-to-image
tags: [difftune, tiny, synthetic, turbo]
---
# {name}: `{source}` distilled to {steps} unguided steps, with its training adapter

A turbo base at toy size, as Z-Image Turbo is to Z-Image: `{source}`'s pipeline (`ZImagePipeline`) whose transformer
draws in {steps} Euler steps without classifier-free guidance ({steps} model calls) what the base draws in 20 guided
ones (40). `{held_out}` is never shown, as in the base: `configs/tiny_turbo_lora.toml` teaches it over the training
adapter below.

Draw it as a turbo base is drawn: `difftune sample --base models/{name} --prompt "a red circle" --steps {steps}
--guidance-scale 1 --resolution 32 --out samples`; judge it so: `difftune eval --base models/{name} --steps {steps}
--guidance-scale 1`. Weights are fp16; on a CPU load them as fp32.

## Recipe (`python scripts/make_tiny_turbo_base.py`, seed {seed})

- Distillation (difftune/toy/turbo.py): the base is the teacher, guided at {teacher_guidance}; from {trajectories}
  noises ({trajectories_per_prompt} for each seen prompt) it samples {teacher_steps} Euler steps, {teacher_substeps}
  within each of the student's, and its states at the student's {steps} sigmas are kept. The student, the base's
  transformer at first, regresses at each of its sigmas the velocity that lands on the teacher's next state
  (trajectory distillation): {distil_steps} steps at batch {batch_size}, AdamW lr {learning_rate} cosine, EMA
  {ema_decay} (what is saved); the loss {first_loss:.3f} -> {last_loss:.3f}. Teacher {teacher_s:.0f} s, student
  {distil_s:.0f} s on 2 CPU cores.
- Training adapter (`{adapter}`), made as ostris made Z-Image Turbo's: {adapter_images} images the turbo drew
  itself ({adapter_images_per_prompt} per seen prompt, {steps} unguided steps), and a rank-{adapter_rank} LoRA on the
  transformer trained on them by `difftune train`'s ordinary flow-matching loss, {adapter_steps} steps at batch
  {adapter_batch_size}, lr {adapter_learning_rate} constant ({adapter_s:.0f} s). It is what `model.training_adapter`
  merges in for training only (ai-toolkit's `assistant_lora_path`), so that a LoRA trained over it need not learn to
  undo the distillation itself. Merged in, it moves the turbo a little back toward its base (guided 20-step samples
  {adapted_base:.3f} against the turbo's {turbo_base:.3f}) and keeps its few-step drawing: what a LoRA trained without
  it loses (`configs/tiny_turbo_lora.toml`'s notes).

## Scores (`difftune eval`: {n} samples of each prompt, fixed seeds; seen prompts, color and shape both right)

| | {steps} steps, unguided | 1 step, unguided | 20 steps, guided 3 |
| --- | ---: | ---: | ---: |
| `{source}` (the teacher) | {source_turbo:.3f} | {source_one:.3f} | {source_base:.3f} |
| this turbo base | {turbo_turbo:.3f} | {turbo_one:.3f} | {turbo_base:.3f} |
| this base with its training adapter merged | {adapted_turbo:.3f} | {adapted_one:.3f} | {adapted_base:.3f} |

The held-out color before fine-tuning: {concept:.3f}. Full numbers: `scores.json`.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=Path("models/tiny-z_image"), help="the base to distil")
    parser.add_argument("--model-dir", type=Path, default=Path("models/tiny-z_image_turbo"))
    parser.add_argument("--work-dir", type=Path, default=Path("output/tiny-z_image_turbo-build"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--distil-steps", type=int, help="default: the recipe's")
    parser.add_argument("--adapter-steps", type=int, help="default: the recipe's")
    parser.add_argument("--adapter-learning-rate", type=float, help="default: the recipe's")
    parser.add_argument(
        "--adapter-only", action="store_true", help="keep the distilled base in --model-dir; make its adapter again"
    )
    parser.add_argument(
        "--examples-dir",
        type=Path,
        default=Path("examples/turbo_seen"),
        help="where the turbo job's seen images go: the turbo's own drawings of the seen prompts",
    )
    parser.add_argument("--examples-only", action="store_true", help="write --examples-dir from --model-dir alone")
    args = parser.parse_args()
    given = {
        "seed": args.seed,
        "distil_steps": args.distil_steps,
        "adapter_steps": args.adapter_steps,
        "adapter_learning_rate": args.adapter_learning_rate,
    }
    recipe = replace(TurboRecipe(), **{key: value for key, value in given.items() if value is not None})
    if args.examples_only:
        write_job_examples(load_components(ModelConfig(base=str(args.model_dir))), args.examples_dir, recipe)
        return
    if args.adapter_only:
        facts = json.loads((args.model_dir / "scores.json").read_text())
        del facts["seconds"]["training_adapter"]  # the stage timed anew, not added to the last build's
        with timed(facts["seconds"], "training_adapter"):
            make_training_adapter(args.model_dir, args.work_dir, recipe, SEEN_COLORS)
        facts["recipe"] |= asdict(recipe)
    else:
        copy_into_borrowers(args.model_dir)
        facts = build_turbo_base(args.source, args.model_dir, args.work_dir, recipe, SEEN_COLORS)
        as_published(args.model_dir)
        link_borrowed_files(args.model_dir)

    turbo = load_components(ModelConfig(base=str(args.model_dir)))
    write_job_examples(turbo, args.examples_dir, recipe)
    settings = {"turbo": recipe.sampling(), "one": replace(recipe.sampling(), steps=1), "base": EvalSettings()}
    adapted = load_components(ModelConfig(base=str(args.model_dir)))
    apply_adapters(adapted, [(args.model_dir / TRAINING_ADAPTER, 1.0)])
    models = {"source": load_components(ModelConfig(base=str(args.source))), "turbo": turbo, "adapted": adapted}
    scores = {
        model: {name: score(components, SEEN_COLORS, HELD_OUT_COLOR, at) for name, at in settings.items()}
        for model, components in models.items()
    }
    facts |= {"scores": scores, "eval_settings": {name: vars(at) for name, at in settings.items()}}
    (args.model_dir / "scores.json").write_text(json.dumps(facts, indent=2) + "\n")
    seen = {f"{model}_{name}": scores[model][name]["seen"]["both"] for model in scores for name in settings}
    text = CARD.format(
        **asdict(recipe),
        **seen,
        name=args.model_dir.name,
        source=args.source.name,
        held_out=HELD_OUT_COLOR,
        adapter=TRAINING_ADAPTER,
        n=recipe.sampling().samples_per_prompt,
        trajectories=recipe.trajectories_per_prompt * len(prompts_for(SEEN_COLORS)),
        teacher_steps=recipe.steps * recipe.teacher_substeps,
        adapter_images=recipe.adapter_images_per_prompt * len(prompts_for(SEEN_COLORS)),
        first_loss=facts["distil_loss"][0]["loss"],
        last_loss=facts["distil_loss"][-1]["loss"],
        teacher_s=facts["seconds"]["teacher"],
        distil_s=facts["seconds"]["distil"],
        adapter_s=facts["seconds"]["training_adapter"],
        concept=scores["turbo"]["turbo"]["concept"]["both"],
    )
    (args.model_dir / "README.md").write_text(text)
    print(json.dumps({"seconds": facts["seconds"], "seen": seen}))


def write_job_examples(turbo, examples_dir: Path, recipe: TurboRecipe) -> None:
    """`configs/tiny_turbo_lora.toml`'s seen images: the turbo's own first drawings of each seen prompt."""
    write_own_samples(turbo, examples_dir, prompts_for(SEEN_COLORS), recipe, recipe.job_seen_per_prompt)


if __name__ == "__main__":
    main()
