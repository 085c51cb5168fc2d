"""Fine-tuning quality on a bundled tiny base: a default job and its variants, each trained and judged.

    python scripts/bench_quality.py [--job sdxl_lora] [--only NAME ...] [--out FILE]
    python scripts/bench_quality.py --table [--job sdxl_lora]   # docs/benchmarks.md's table from those lines
    python scripts/bench_quality.py --convergence --only min_snr soft_min_snr debiased uniform_weighting
    python scripts/bench_quality.py --convergence --table       # steps to a validation-loss target

With `--convergence` each variant also scores a held-out set of 24 concept renders every 20 steps
(`validation.path`); its lines (benchmarks/convergence-<job>.jsonl) hold the validation curve, and the table says
at which step each run first reached the targets: the default job's (Min-SNR's) best validation loss + 5% and + 2%.

Each variant is `difftune train --config configs/<job>.toml <overrides>` (job tiny_lora: lines in
benchmarks/quality-finetune.jsonl; another job: benchmarks/quality-finetune-<job>.jsonl), then
`difftune eval` of its
adapter (the base is scored once): one JSON line per variant with the held-out concept's accuracy before
and after (overall and per shape) and the forgetting of the seen prompts. docs/benchmarks.md's table is these lines.
"""

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

from difftune.adapters.export import apply_adapters, variant_of
from difftune.config import load_config
from difftune.families import load_components
from difftune.families.flux3 import BLOCK_TARGETS as FLUX3_BLOCK_TARGETS
from difftune.toy.judge import EvalSettings, concepts_of, model_score
from difftune.toy.tiny import shape_images, write_caption_folder
from difftune.toy.tiny_base import HELD_OUT_COLOR
from difftune.toy.turbo import TurboRecipe
from difftune.training.metrics import read_metrics
from difftune.training.train import train

SEEDS = {"": [], "_seed_1": ["train.seed=1"], "_seed_2": ["train.seed=2"]}
# Chroma's default targets less the text stream's (add_q/k/v_proj, to_add_out, ff_context): the image tokens' layers.
CHROMA_IMAGE_STREAM = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2", "proj_mlp"]


FLUX3_NO_IMAGE_BLOCKS = str(
    [
        f"{blocks}.{index}.{layer}"
        for blocks in ("txt_mode_blocks", "single_transformer_blocks")
        for index in range(2)
        for layer in FLUX3_BLOCK_TARGETS
    ]
).replace(" ", "")


# How a job's models are judged where it is not the judge's default (20 steps, guided at 3): a turbo base as it is
# drawn, in 4 unguided steps.
JOB_EVAL_SETTINGS = {"tiny_turbo_lora": TurboRecipe().sampling()}


def at_seeds(name: str, *overrides: str) -> dict[str, list[str]]:
    """A variant at the job's seed (0) and at train.seed 1 and 2: name, name_seed_1, name_seed_2."""
    return {name + suffix: [*overrides, *seed] for suffix, seed in SEEDS.items()}


# The reward job's prompts with the purple three listed three times (the seen twelve once)
PURPLE_PROMPTS_X3 = str(
    [f"a purple {shape}" for shape in ("circle", "square", "triangle")] * 3
    + [
        f"a {color} {shape}"
        for color in ("red", "green", "blue", "yellow")
        for shape in ("circle", "square", "triangle")
    ]
).replace("'", '"')
PURPLE, SEEN = 'path = "examples/purple"', 'path = "examples/purple_with_seen/1_seen"'


def datasets(*tables: str) -> str:
    """A `data.datasets` override of these tables' settings, its braces kept through the `{folder}` formatting."""
    return "data.datasets=[" + ", ".join("{{" + table + "}}" for table in tables) + "]"


# Overrides of each default job; `{renders_32}` is 32 renders of the concept written by this script.
VARIANTS = {
    "tiny_lora": {
        "lora_r16_te": [],
        "min_snr": [],  # the default again, named for the weighting comparison (--convergence)
        "lora_r16_unet_only": ["adapter.text_encoder=false"],
        "lora_r4_te": ["adapter.rank=4"],
        "lora_r8_te": ["adapter.rank=8"],
        "dora_r4_te": ["adapter.kind=dora", "adapter.rank=4"],
        "dora_r8_te": ["adapter.kind=dora", "adapter.rank=8"],
        "dora_r16_te": ["adapter.kind=dora"],
        "uniform_weighting": ["loss.weighting=uniform"],
        "noise_offset_0.1": ["loss.noise_offset=0.1"],
        "taesd_latents": ["model.vae=models/tiny-sd/taesd"],
        "ema": ["ema.enabled=true", "ema.decay=0.99"],
        "loss_huber": ["loss.type=huber"],  # kohya's pseudo-Huber, c by its snr schedule from 0.1
        "loss_smooth_l1": ["loss.type=smooth_l1"],
        "loss_l1": ["loss.type=l1"],
        "200_steps": ["train.max_steps=200"],
        "600_steps": ["train.max_steps=600"],
        "lr_2e-3": ["optim.learning_rate=2e-3"],
        "text_encoder_lr_3e-3": ["optim.text_encoder_learning_rate=3e-3"],
        "no_caption_dropout": ["data.caption_dropout=0.0"],
        "32_renders": ["data.path={renders_32}"],
        "lr_from_find_lr": [
            "optim.learning_rate=1.79e-3"
        ],  # find-lr's suggestion at train.seed=2 (benchmarks/find-lr-*)
        "activations_every_10": ["log.activations_every_steps=10"],
        "unet_stored_fp16": [
            "model.weight_dtype=fp16"
        ],  # frozen UNet kept in fp16, computed in fp32 (README: on a CPU)
        # Issue 19's techniques.
        "soft_min_snr": ["loss.weighting=soft_min_snr"],
        "debiased": ["loss.weighting=debiased"],
        "loha_r8_te": ["adapter.kind=loha", "adapter.rank=8"],
        "lokr_r8_te": ["adapter.kind=lokr", "adapter.rank=8"],
        "prodigy": ["optim.optimizer=prodigy", "optim.learning_rate=1.0"],
        "schedule_free": ["optim.optimizer=adamw_schedule_free", "optim.lr_schedule=constant"],
        "loraplus_16": ["optim.loraplus_ratio=16"],
        "rslora": ["adapter.rank_stabilized=true"],
        "pissa": ["adapter.init=pissa"],
        "masked_loss": ["data.masks=folder", "data.mask_path={purple_masks}"],
        "prior_red_circles": [
            "prior.class_prompt=a red circle",
            "prior.num_class_images=16",
            "prior.steps=20",
            "prior.guidance_scale=3.0",
            "prior.class_path={class_images}",
        ],
        "unet_only_prior_drawn": [
            "adapter.text_encoder=false",
            "prior.class_prompt=a red circle",
            "prior.num_class_images=16",
            "prior.steps=20",
            "prior.guidance_scale=3.0",
            "prior.class_path={class_images}",
        ],
        "unet_only_prior_seen_renders": [
            "adapter.text_encoder=false",
            "prior.class_path=examples/purple_with_seen/1_seen",
        ],
        # Several datasets (issue 56 item 5): the seen renders as a second dataset, at full and half loss weight,
        # and the purple renders at two resolutions.
        "unet_only_seen_dataset": ["adapter.text_encoder=false", datasets(PURPLE, SEEN)],
        "unet_only_seen_dataset_half": ["adapter.text_encoder=false", datasets(PURPLE, f"{SEEN}, loss_weight = 0.5")],
        "two_resolutions_32_48": [datasets(f"{PURPLE}, resolution = [32, 48]")],
        "loraplus_16_lr_2.5e-4": ["optim.loraplus_ratio=16", "optim.learning_rate=2.5e-4"],
        "tag_shuffle_variants": [
            "data.caption_prefix=sks ",
            "data.shuffle_tags=true",
            "data.tag_separator= ",
            "data.keep_tokens=1",
            "data.caption_variants=4",
        ],
        "seed_1": ["train.seed=1"],
        "seed_2": ["train.seed=2"],
    },
    "tiny_embedding": {
        "embedding_init_red": [],
        "embedding_random_init": ["adapter.embedding_init_word="],
        "embedding_2_vectors": ["adapter.embedding_vectors=2"],
    },
    "sdxl_lora": {
        "dora_r4_te": [],
        "lora_r4_te": ["adapter.kind=lora"],
        "lora_r8_te": ["adapter.kind=lora", "adapter.rank=8"],
        "lora_r16_te": ["adapter.kind=lora", "adapter.rank=16"],
        "lora_r16_unet_only": ["adapter.kind=lora", "adapter.rank=16", "adapter.text_encoder=false"],
        "dora_r16_te": ["adapter.rank=16"],
        "600_steps": ["train.max_steps=600"],
    },
    "flux_lora": {
        "lora_r16_te": [],
        "lora_r4_te": ["adapter.rank=4"],
        "dora_r4_te": ["adapter.kind=dora", "adapter.rank=4"],
        "dora_r16_te": ["adapter.kind=dora"],
        "lora_r16_transformer_only": ["adapter.text_encoder=false"],
        "no_shift": ["loss.flow_shift_by_resolution=false"],
        "logit_normal": ["loss.timestep_sampling=logit_normal"],
        "shift_3": ["loss.flow_shift_by_resolution=false", "loss.flow_shift=3.0"],
        "600_steps": ["train.max_steps=600"],
        "lr_5e-4": ["optim.learning_rate=5e-4"],
        "dora_r4_te_lr_5e-4": ["adapter.kind=dora", "adapter.rank=4", "optim.learning_rate=5e-4"],
        "no_caption_dropout": ["data.caption_dropout=0.0"],
        "200_steps": ["train.max_steps=200"],
        "text_encoder_lr_5e-3": ["optim.text_encoder_learning_rate=5e-3"],
        "image_stream_only": [
            "adapter.target_modules=['attn.to_q','attn.to_k','attn.to_v','attn.to_out.0','ff.net.0.proj','ff.net.2','proj_mlp']"
        ],
        "seed_1": ["train.seed=1"],
        "seed_2": ["train.seed=2"],
    },
    "qwen_image_lora": {
        # Measured on the rebuilt base, whose autoencoder keeps purple apart from blue (benchmarks/
        # quality-finetune-qwen_image_lora-colors.jsonl); quality-finetune-qwen_image_lora.jsonl holds the first base's
        # lines, whose variants are in this file's history.
        **at_seeds("lora_r8_lr_5e-4"),
        **at_seeds("lora_r4_lr_5e-4", "adapter.rank=4"),
        **at_seeds("lora_r4_lr_1e-3", "adapter.rank=4", "optim.learning_rate=1e-3"),
        **at_seeds("lora_r4_lr_2e-3", "adapter.rank=4", "optim.learning_rate=2e-3"),  # the first base's default
        **at_seeds("lora_r4_lr_5e-4_1800_steps", "adapter.rank=4", "train.max_steps=1800"),
        **at_seeds("lora_r4_lr_1e-3_600_steps", "adapter.rank=4", "optim.learning_rate=1e-3", "train.max_steps=600"),
    },
    "flux2_klein_lora": {
        # The lora_r4 lines were measured when the job's default was rank 4 (`lora_r4` had no overrides).
        **at_seeds("lora_r8"),
        **at_seeds("lora_r8_1800_steps", "train.max_steps=1800"),
        **at_seeds("lora_r4", "adapter.rank=4"),
        **at_seeds("lora_r4_lr_2e-3", "adapter.rank=4", "optim.learning_rate=2e-3"),
        **at_seeds("lora_r4_2400_steps", "adapter.rank=4", "train.max_steps=2400"),
    },
    "z_image_lora": {
        # The 900_steps, dora_r4 and caption_dropout_0.2 lines were measured when the job's learning rate was 2e-3.
        **at_seeds("lora_r4"),
        **at_seeds("lora_r4_lr_2e-3", "optim.learning_rate=2e-3"),
        **at_seeds("lora_r4_lr_1e-3", "optim.learning_rate=1e-3"),
        **at_seeds("lora_r4_900_steps", "train.max_steps=900"),
        **at_seeds("dora_r4", "adapter.kind=dora"),
        **at_seeds("lora_r4_caption_dropout_0.2", "data.caption_dropout=0.2"),
    },
    "chroma_lora": {
        **at_seeds("lora_r8"),
        **at_seeds("lora_r4", "adapter.rank=4"),
        **at_seeds("lora_r8_lr_5e-4", "optim.learning_rate=5e-4"),
        **at_seeds("lora_r8_600_steps", "train.max_steps=600"),
        **at_seeds("lora_r16_400_steps", "adapter.rank=16", "train.max_steps=400"),  # the Flux job's settings
        **at_seeds("lora_r8_image_stream", "adapter.target_modules=" + str(CHROMA_IMAGE_STREAM).replace(" ", "")),
        **at_seeds("lora_r8_ema", "ema.enabled=true", "ema.decay=0.99"),
        **at_seeds("lora_r8_1800_steps", "train.max_steps=1800"),
        **at_seeds("lora_r16", "adapter.rank=16"),
        **at_seeds("lora_r8_2400_steps", "train.max_steps=2400"),
        **at_seeds("lora_r8_logit_normal", "loss.timestep_sampling=logit_normal"),
        **at_seeds("lora_r8_shift_1", "loss.flow_shift_by_resolution=false", "loss.flow_shift=1.0"),
        **at_seeds("lora_r8_2400_steps_ema", "train.max_steps=2400", "ema.enabled=true", "ema.decay=0.995"),
        **at_seeds(
            "lora_r16_2400_steps_lr_5e-4", "adapter.rank=16", "train.max_steps=2400", "optim.learning_rate=5e-4"
        ),
        **at_seeds("lora_r8_3200_steps", "train.max_steps=3200"),
    },
    "sd3_lora": {
        **at_seeds("lora_r8"),
        **at_seeds("lora_r8_clips", "adapter.text_encoder=true"),
    },
    "qwen_image21_lora": {
        **at_seeds("lora_r8"),
    },
    "tiny_dpo": {
        **at_seeds("dpo_text_encoder_chosen_weight_5_rank_32"),
        # Issue 91's search for the forgetting: the job before it (the UNet's LoRA alone at rank 16, no chosen loss,
        # 400 steps), then each of the two changes alone, and both at rank 16, over 600 steps.
        "plain_dpo": [
            "adapter.rank=16",
            "adapter.text_encoder=false",
            "preference.chosen_weight=0",
            "train.max_steps=400",
        ],
        "unet_only_chosen_weight_5": ["train.max_steps=600", "adapter.rank=16", "adapter.text_encoder=false"],
        "text_encoder_no_chosen_loss": ["train.max_steps=600", "adapter.rank=16", "preference.chosen_weight=0"],
        **at_seeds("rank_16", "train.max_steps=600", "adapter.rank=16"),  # seed 2 drew 7 of 8 purple squares
        **at_seeds("600_steps", "train.max_steps=600"),  # seed 0 drew 7 of 8 purple squares
    },
    "tiny_reward": {
        **at_seeds("draft_anchored_noise_1"),
        "draft_anchored_noise_1_500_steps": ["train.max_steps=500"],
        "draft_anchored_noise_1_anchor_0.005": ["reward.kl_weight=0.005"],
        "draft_anchored_noise_1_anchor_0.02": ["reward.kl_weight=0.02"],
        "draft_anchored_noise_1_rank_32": ["adapter.rank=32"],
        "draft_anchored_noise_1_purple_prompts_x3": ["reward.prompts=" + PURPLE_PROMPTS_X3],
        # DDIM at eta 1 over 20 steps is the judge's own sampler (DDPM, 20 steps)
        "draft_anchored_noise_1_20_steps": ["reward.steps=20"],
        # ReFL: the image predicted in one jump from a random one of the last N of 8 steps, so the steps that decide a
        # color train too (DRaFT-1 trains the last alone)
        "refl_last_4": ["reward.method=refl", "reward.refl_last_steps=4"],
        "refl_last_2": ["reward.method=refl", "reward.refl_last_steps=2"],
        # Unguided (or less guided) while training: the adapter's color change is then the prompt's alone, and the
        # judge's guidance (3) multiplies it
        "draft_anchored_noise_1_unguided": ["reward.guidance_scale=1.0"],
        "draft_anchored_noise_1_guidance_2": ["reward.guidance_scale=2.0"],
        # The cross-attention's key and value projections alone: they read the prompt, not the noisy latents, so what
        # the last step teaches them of "purple" acts the same at every step, the early ones that decide the color too
        **at_seeds("draft_anchored_noise_1_cross_kv", 'adapter.target_modules=["attn2.to_k", "attn2.to_v"]'),
        # The DRaFT paper's deterministic sample (DDIM, eta 0)
        **at_seeds("draft_anchored", "reward.noise_level=0"),
        "draft_anchored_4_steps": ["reward.noise_level=0", "reward.steps=4"],
        "draft_anchored_500_steps": ["reward.noise_level=0", "train.max_steps=500"],
        "draft_unanchored": ["reward.noise_level=0", "reward.kl_weight=0", "train.max_steps=150"],
        # Flow-GRPO's policy gradient (DDPO's DDIM policy on this epsilon base): 6 images of 3 prompts a step.
        "grpo": [
            "reward.method=grpo",
            "reward.group_size=6",
            "reward.trained_steps=4",
            "reward.noise_level=1.0",
            "train.batch_size=3",
            "optim.learning_rate=2e-3",
        ],
    },
    "tiny_datasets": {
        **at_seeds("purple_and_seen"),
        **at_seeds("seen_at_half_weight", datasets(PURPLE, f"{SEEN}, loss_weight = 0.5")),
    },
    "tiny_inpaint_lora": {
        **at_seeds("lora_r16"),
    },
    # Over the turbo base's training adapter (as shipped), and the same run without it
    "tiny_turbo_lora": {
        **at_seeds("training_adapter"),
        **at_seeds("without_training_adapter", "model.training_adapter="),
    },
    "tiny_ace_step_lora": {
        **at_seeds("lora_r4"),
    },
    "ltx2_lora": {
        **at_seeds("lora_r16"),
        **at_seeds("lora_r16_400_steps", "train.max_steps=400"),
        **at_seeds("lora_r16_1000_steps", "train.max_steps=1000"),
        **at_seeds("lora_r32", "adapter.rank=32"),
    },
    "flux3_lora": {
        **at_seeds("lora_r8"),
        **at_seeds("lora_r8_lr_5e-4", "optim.learning_rate=5e-4"),
        **at_seeds("lora_r8_lr_3e-4", "optim.learning_rate=3e-4"),
        **at_seeds("lora_r4_lr_5e-4", "adapter.rank=4", "optim.learning_rate=5e-4"),
        **at_seeds("lora_r8_600_steps", "train.max_steps=600"),
        **at_seeds("lora_r8_300_steps", "train.max_steps=300"),
        **at_seeds("lora_r8_no_caption_dropout", "data.caption_dropout=0.0"),
        **at_seeds("lora_r4", "adapter.rank=4"),
        # The seen renders as often as the purple ones (12 x 4 beside 16 x 3); the purple renders alone.
        **at_seeds("seen_x4", datasets(f"{PURPLE}, repeats = 3", f"{SEEN}, repeats = 4")),
        **at_seeds("purple_only", "data.path=examples/purple"),
        # The text-mode and joint blocks alone (tiny-flux3 has 2 of each): the image-mode blocks, which draw the shapes,
        # left as they are.
        **at_seeds("lora_r8_no_image_blocks", "adapter.target_modules=" + FLUX3_NO_IMAGE_BLOCKS),
        **at_seeds("lora_r8_ema", "ema.enabled=true", "ema.decay=0.99"),
        **at_seeds("lora_r8_lr_5e-4_ema", "optim.learning_rate=5e-4", "ema.enabled=true", "ema.decay=0.99"),
        **at_seeds("lora_r8_lr_7e-4", "optim.learning_rate=7e-4"),
        **at_seeds("lora_r8_lr_5e-4_1800_steps", "optim.learning_rate=5e-4", "train.max_steps=1800"),
        **at_seeds("lora_r8_caption_dropout_0.2", "data.caption_dropout=0.2"),
        **at_seeds(
            "lora_r8_lr_5e-4_1800_steps_caption_dropout_0.2",
            "optim.learning_rate=5e-4",
            "train.max_steps=1800",
            "data.caption_dropout=0.2",
        ),
        **at_seeds(
            "lora_r8_lr_5e-4_2400_steps_caption_dropout_0.2",
            "optim.learning_rate=5e-4",
            "train.max_steps=2400",
            "data.caption_dropout=0.2",
        ),
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", choices=VARIANTS, default="tiny_lora", help="the default job the variants change")
    parser.add_argument("--only", nargs="*", help="variant names (default: all)")
    parser.add_argument("--out", type=Path, help="default: benchmarks/quality-finetune[-<job>].jsonl")
    parser.add_argument("--work-dir", type=Path, default=Path("output/bench-quality"))
    parser.add_argument("--table", action="store_true", help="print the --out lines as a Markdown table and exit")
    parser.add_argument("--convergence", action="store_true", help="also score a held-out set every 20 steps")
    parser.add_argument("--eval-resolution", type=int, help="draw the judged samples at this size (default: 32 px)")
    args = parser.parse_args()
    config_file = Path("configs") / f"{args.job}.toml"
    default_out = "quality-finetune.jsonl" if args.job == "tiny_lora" else f"quality-finetune-{args.job}.jsonl"
    args.out = args.out or Path("benchmarks") / (f"convergence-{args.job}.jsonl" if args.convergence else default_out)
    if args.table:
        lines = [json.loads(line) for line in args.out.read_text().splitlines()]
        print(convergence_table(lines) if args.convergence else markdown_table(lines))
        return

    settings = JOB_EVAL_SETTINGS.get(args.job, EvalSettings())
    if args.eval_resolution:
        settings = replace(settings, resolution=args.eval_resolution)
    base_config = load_config(config_file)
    concepts, held_out = concepts_of(base_config.model.base)  # a sound base's are the tones' pitches
    seen = [concept for concept in concepts if concept != held_out]
    before = model_score(load_components(base_config.model), seen, held_out, settings)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    folders = {
        "renders_32": args.work_dir / "renders_32",
        "purple_masks": args.work_dir / "purple_masks",
        "class_images": args.work_dir / "class_images",
        "held_out": args.work_dir / "held_out",
    }
    if held_out == HELD_OUT_COLOR:  # the shapes jobs' variants read these
        write_caption_folder(folders["renders_32"], shape_images(32, seed=7, colors=(HELD_OUT_COLOR,)))
        write_caption_folder(folders["held_out"], shape_images(24, seed=11, colors=(HELD_OUT_COLOR,)))
        write_foreground_masks(Path(base_config.data.path), folders["purple_masks"])
    watch = ["validation.path=" + str(folders["held_out"]), "validation.every_steps=20"] if args.convergence else []
    for name, overrides in VARIANTS[args.job].items():
        if args.only and name not in args.only:
            continue
        out_dir = args.work_dir / args.job / name
        overrides = [override.format(**folders) for override in overrides]
        config = load_config(
            config_file,
            [*overrides, *watch, f"train.output_dir={out_dir}", "train.overwrite=true", "sample.prompts=[]"],
        )
        started = time.perf_counter()
        result = train(config)
        seconds = time.perf_counter() - started
        adapters = [result.trained_path] + ([variant_of(result.trained_path, "_ema")] if result.ema else [])
        for adapter in adapters:
            components = load_components(base_config.model)
            apply_adapters(components, [(adapter, 1.0)])
            # An embedding's concept prompts say its token where the others say the color.
            word = config.adapter.embedding_token if config.adapter.kind == "embedding" else ""
            after = model_score(components, seen, held_out, settings, word)
            line = {
                "run": name + (" (EMA weights)" if adapter.stem.endswith("_ema") else ""),
                "overrides": overrides,
                "train_s": round(seconds, 1),
                "concept_before": before["concept"]["both"],
                "concept_after": after["concept"]["both"],
                **{
                    f"by_{part}": {name: scores["both"] for name, scores in after[f"concept_by_{part}"].items()}
                    for part in ("shape", "timbre")  # a sound job's concept is judged per timbre
                    if f"concept_by_{part}" in after
                },
                "seen_both_before": before["seen"]["both"],
                "seen_both_after": after["seen"]["both"],
                "forgetting": round(before["seen"]["both"] - after["seen"]["both"], 3),
                "date": time.strftime("%Y-%m-%d"),  # the quality table keeps each seed's newest
            }
            if args.job in JOB_EVAL_SETTINGS:
                line["judged_at"] = {"steps": settings.steps, "guidance_scale": settings.guidance_scale}
            if "fills" in after["concept"]:  # an inpainting job: drawn inside the mask, the rest kept
                line["fills_after"] = {key: after["concept"][key] for key in ("inside", "kept", "kept_difference")}
            if "direction" in after["concept"]:  # a video job: each clip's motion too
                line["directions_after"] = {"purple": after["concept"]["direction"], "seen": after["seen"]["direction"]}
            if args.convergence:
                line["val_loss"] = {row["step"]: row["val_loss"] for row in read_metrics(out_dir) if "val_loss" in row}
            print(json.dumps(line), flush=True)
            with open(args.out, "a", encoding="utf-8") as out:
                out.write(json.dumps(line) + "\n")


def write_foreground_masks(images: Path, out: Path) -> None:
    """A mask per render: its shape (pixels far from the border's color) grown by 2 pixels, the background black."""
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(images.glob("*.png")):
        pixels = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32)
        border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
        shape = np.linalg.norm(pixels - np.median(border, axis=0), axis=-1) > 60
        grown = Image.fromarray((shape * 255).astype(np.uint8)).filter(ImageFilter.MaxFilter(5))
        grown.save(out / path.name)


def convergence_table(lines: list[dict], margins=(0.05, 0.02)) -> str:
    """Steps to each target validation loss: the default run's best plus each margin (the default is the first line
    without overrides)."""
    default = next(line for line in lines if not line["overrides"])
    best = min(default["val_loss"].values())
    targets = [best * (1 + margin) for margin in margins]
    rows = [
        f"Targets: validation loss <= {', '.join(f'{t:.4f}' for t in targets)} (the default job's best, {best:.4f}, "
        f"+{' and +'.join(f'{100 * m:.0f}%' for m in margins)}); validated every 20 steps.",
        "",
        "| run | overrides | "
        + " | ".join(f"steps to +{100 * m:.0f}%" for m in margins)
        + " | best validation loss (step) | final | purple both after | forgetting |",
        "| --- | --- | " + "---: | " * len(margins) + "---: | ---: | ---: | ---: |",
    ]
    for line in lines:
        curve = {int(step): value for step, value in line["val_loss"].items()}
        reached = [
            next((step for step, value in sorted(curve.items()) if value <= target), "not reached")
            for target in targets
        ]
        best_step = min(curve, key=curve.get)
        overrides = f"`{' '.join(line['overrides'])}`" if line["overrides"] else "(default: Min-SNR)"
        rows.append(
            f"| {line['run']} | {overrides} | "
            + " | ".join(map(str, reached))
            + f" | {curve[best_step]:.4f} ({best_step}) | {curve[max(curve)]:.4f} | {line['concept_after']:.2f} "
            f"| {line['forgetting']:.3f} |"
        )
    return "\n".join(rows)


def markdown_table(lines: list[dict]) -> str:
    clips = any("directions_after" in line for line in lines)  # a video job's lines: the motion's column too
    fills = any("fills_after" in line for line in lines)  # an inpainting job's: inside the mask, the rest kept
    extra = " directions after, purple / seen |" if clips else " purple inside the mask / rest kept |" if fills else ""
    sounds = any("by_timbre" in line for line in lines)  # a sound job's: the shrill pitch, per timbre
    concept, parts = ("shrill", "hum / buzz") if sounds else ("purple", "circle / square / triangle")
    rows = [
        f"| run | overrides | train s | {concept} both, before -> after | {parts} | heard or seen both, before "
        "-> after | forgetting |" + extra,
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if extra else ""),
    ]
    for line in lines:
        name = f"**{line['run']} (default)**" if not line["overrides"] else line["run"]
        overrides = f"`{' '.join(line['overrides'])}`" if line["overrides"] else ""
        shapes = " / ".join(f"{value:.2f}" for value in line.get("by_shape", line.get("by_timbre", {})).values())
        directions, filled = line.get("directions_after", {}), line.get("fills_after", {})
        rows.append(
            f"| {name} | {overrides} | {line['train_s']:.0f} | {line['concept_before']:.2f} -> "
            f"{line['concept_after']:.2f} "
            f"| {shapes} | {line['seen_both_before']:.2f} -> {line['seen_both_after']:.2f} | {line['forgetting']:.3f} |"
            + (f" {directions['purple']:.2f} / {directions['seen']:.2f} |" if clips else "")
            + (f" {filled['inside']:.2f} / {filled['kept']:.2f} |" if fills else "")
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
