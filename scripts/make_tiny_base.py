"""Build a bundled tiny base: `python scripts/make_tiny_base.py` (models/tiny-sd and the default job's images),
`--family sdxl` (models/tiny-sdxl, from tiny-sd's autoencoders), `--family flux` (models/tiny-flux),
`--family qwen_image` (models/tiny-qwen_image), `--family qwen_image21` (models/tiny-qwen_image21, its own RGBA
autoencoder at 16x), `--family z_image` (models/tiny-z_image, from tiny-flux's autoencoders), `--family flux2_klein`
(models/tiny-flux2_klein), `--family flux3` (models/tiny-flux3, from tiny-flux2_klein's), `--family chroma` or
`--family sd3` (models/tiny-chroma, models/tiny-sd3, both from tiny-flux's autoencoders), `--family wan`
(models/tiny-wan, a video base of moving shapes, its autoencoder tiny-qwen_image's taught time on clips).

Trains an autoencoder (KL, Wan's video kind for Qwen-Image, Qwen-Image 2.1's RGBA kind) and a TAESD on synthetic
shapes (not for SDXL), then the denoiser and text encoder(s) with difftune's own trainer (full fine-tune, EMA), never
showing them the held-out color; scores the result with the judge (and an untrained control) and writes the model
card. Deterministic by seed; on 2 CPU cores about 20 minutes for tiny-sd, 17 for tiny-flux, 21 for tiny-qwen_image,
27 for tiny-qwen_image21. The default jobs' images (examples/purple: renders of the held-out color) are written with
tiny-sd; the Flux and Qwen-Image jobs' (examples/purple_with_seen: the same renders repeated 3 times per epoch and 12
renders of the seen colors) with tiny-flux; the Wan job's clips (examples/purple_clips) with tiny-wan.
"""

import argparse
import json
import shutil
from functools import partial
from pathlib import Path

from difftune.config import ModelConfig
from difftune.families import FAMILIES, load_components
from difftune.families.common.flow import FlowMatching
from difftune.families.common.modular import ModularBase
from difftune.models.autoencoders import PATCHED_AUTOENCODERS, frames_per_latent
from difftune.toy.judge import EvalSettings, clip_score, score
from difftune.toy.tiny import (
    CLIP_FRAMES,
    CLIP_SPEED,
    DIRECTIONS,
    SHAPES,
    moving_shape_clips,
    placed_shape_pairs,
    preference_pairs,
    shape_images,
    write_caption_folder,
    write_clip_folder,
    write_pair_folder,
)
from difftune.toy.tiny_base import (
    HELD_OUT_COLOR,
    SEEN_COLORS,
    TINY_BASES,
    Recipe,
    as_published,
    build_base,
    continue_denoiser,
    copy_into_borrowers,
    link_borrowed_files,
    refresh_clip_decoder,
)

CARD = """---
library_name: diffusers
pipeline_tag: text-to-image
tags: [difftune, tiny, synthetic]
---
# {name}: a 32 px text-to-image model of colored shapes, trained by difftune

{architecture}, trained on synthetic renders
captioned `a <color> <shape>` for colors {seen} and shapes circle, square, triangle. The color
`{held_out}` was never shown to the UNet or the text encoder(s): it is the concept the default fine-tuning
job teaches. `taesd/` is an `AutoencoderTiny` distilled to the same latent space (encode for training
with `model.vae = "models/{name}/taesd"`, or decode previews with `sample.decoder`).

Weights are fp16; on a CPU load them as fp32: {loading}.

## Recipe (`{command}`, seed {seed})

- autoencoders{autoencoders_note}: {autoencoder_images} renders of every color; KL VAE ({vae_loss}, {vae_steps} steps at batch
  {autoencoder_batch}, then {vae_decoder_steps} steps at lr {vae_decoder_lr} of the decoder alone on the posterior means, as SD's ft-MSE
  VAE), {normalization}; TAESD distilled for {taesd_steps}
  steps (encoder -> the VAE's scaled latents, decoder <- them)
- {denoiser} ({denoiser_params:,} parameters){text_encoder_note}
  by `difftune train` with `adapter.kind = "none"`, `adapter.text_encoder = {train_text_encoder}`: {steps} steps at batch
  {batch_size}, AdamW lr {learning_rate} cosine, {objective}, noise offset {noise_offset}, caption dropout 0.1, cached latents,
  EMA {ema_decay} (the EMA weights are what is saved)
- time on 2 CPU cores: autoencoders {t_ae:.0f} s, {denoiser_short} + text encoder(s) {t_unet:.0f} s{continued}

## Scores

| | value |
| --- | ---: |
| VAE reconstruction PSNR (300 held-out renders) | {vae_psnr:.1f} dB |
| TAESD reconstruction PSNR | {taesd_psnr:.1f} dB |
| TAESD latent RMSE vs the VAE's scaled latents (latents have std ~1) | {taesd_rmse:.3f} |
| the closest two colors in the VAE's normalised latents (RMS distance, same renders) | {closest_colors} |
| seen prompts, color accuracy ({n} samples per prompt, fixed seeds) | {seen_color:.3f} |
| seen prompts, shape accuracy | {seen_shape:.3f} |
| held-out color before fine-tuning (both right) | {concept_both:.3f} |
| untrained control (random {denoiser_short} and text encoders), color / shape | {control_color:.3f} / {control_shape:.3f} |

Judged by `difftune.toy.judge.judge` (pixel statistics: on a plain background the foreground must be one
blob of one palette color, else nothing is named; the nearest palette color; where the blob fills its
bounding box for the shape).
Full numbers: `scores.json`.
"""

CLIP_CARD = """---
library_name: diffusers
pipeline_tag: text-to-video
tags: [difftune, tiny, synthetic]
---
# {name}: a 32 px text-to-video model of moving colored shapes, trained by difftune

{architecture}, trained on synthetic clips of {frames} frames captioned `a <color> <shape> moving <direction>`
(a shape sliding {travel} px left, right, up or down) for colors {seen} and shapes circle, square, triangle. The color
`{held_out}` was never shown to the transformer: it is the concept the default fine-tuning job (`configs/{job}`)
teaches. {text_note}

Weights are fp16; on a CPU load them as fp32: `{pipeline_class}.from_pretrained(path, dtype=torch.float32)`, and draw
`num_frames={frames}` at `height=width=32`.

## Recipe (`{command}`, seed {seed})

- autoencoder: {autoencoder_start}, trained on {vae_clips} moving-shape clips of
  every color for {vae_steps} steps (MSE + 1e-6 KL){decoder_phase}, per-channel `latents_mean` / `latents_std` of its
  clip latents
- {denoiser} ({denoiser_params:,} parameters) trained by `difftune train` with `adapter.kind = "none"`, the text encoder
  ({text_params:,} parameters) frozen: {steps} steps at batch {batch_size} over {train_clips} clips, AdamW lr {learning_rate}
  cosine, flow matching with the sampler's shift, noise offset {noise_offset}, caption dropout 0.1, cached latents and
  captions, EMA {ema_decay} (the EMA weights are what is saved)
- time on 2 CPU cores: autoencoder {t_ae:.0f} s, transformer {t_unet:.0f} s{t_refresh}{continued}

## Scores

| | value |
| --- | ---: |
| autoencoder reconstruction PSNR (100 held-out clips): whole clip / first frame / later frames | {vae_psnr:.1f} / {first_psnr:.1f} / {later_psnr:.1f} dB |
| seen prompts ({n} clips per color and shape, fixed seeds): color / shape of each frame | {seen_color:.3f} / {seen_shape:.3f} |
| seen prompts: clips moving the asked way | {seen_direction:.3f} |
| held-out color before fine-tuning (color and shape right, per frame) | {concept_both:.3f} |
| untrained control (random transformer): color / shape / direction | {control_color:.3f} / {control_shape:.3f} / {control_direction:.3f} |

Judged by `difftune.toy.judge.judge_clip`: each frame by the shapes judge (pixel statistics: one blob of one palette
color on a plain background, where it fills its bounding box for the shape), the motion by the shape's centre from
the first frame it is seen in to the last (at least 3 px, mostly the asked way). Full numbers: `scores.json`.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=TINY_BASES, default="sd")
    parser.add_argument("--model-dir", type=Path, help="default: models/tiny-<family>")
    parser.add_argument(
        "--autoencoders-from",
        type=Path,
        help="a built base whose vae/ and taesd/ are reused instead of trained (default: the family's lender, "
        + "; ".join(
            f"{name}: models/{spec.autoencoders_from}" for name, spec in TINY_BASES.items() if spec.autoencoders_from
        )
        + "; for another family, its own earlier build of the same recipe)",
    )
    parser.add_argument("--examples-dir", type=Path, default=Path("examples"))
    parser.add_argument("--work-dir", type=Path, help="default: output/tiny-<family>-build")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--steps",
        type=int,
        help="denoiser/text-encoder training steps (default: "
        + ", ".join(f"{spec.recipe.get('steps', Recipe.steps)} for {name}" for name, spec in TINY_BASES.items())
        + ")",
    )
    parser.add_argument(
        "--refresh-decoder",
        action="store_true",
        help="a built video base: train its autoencoder's decoder again alone (the recipe's decoder phase; encoder, "
        "latent statistics and transformer kept, so the transformer needs no retraining), then score it again",
    )
    parser.add_argument(
        "--continue-steps",
        type=int,
        metavar="N",
        help="a built base: train its denoiser N more steps by the base's job from its saved weights, at half the "
        "recipe's learning rate (autoencoders and text encoders kept), then score it again",
    )
    args = parser.parse_args()
    args.model_dir = args.model_dir or Path(f"models/tiny-{args.family}")
    args.work_dir = args.work_dir or Path(f"output/tiny-{args.family}-build")
    spec = TINY_BASES[args.family]
    lender = Path("models") / spec.autoencoders_from if spec.autoencoders_from else None  # the same autoencoder kind
    args.autoencoders_from = args.autoencoders_from or lender
    recipe = Recipe(seed=args.seed, family=args.family, **spec.recipe)
    recipe.steps = args.steps or recipe.steps
    copy_into_borrowers(args.model_dir)
    if args.refresh_decoder:
        if not FAMILIES[args.family].reads_clips:
            parser.error(
                "--refresh-decoder: only a video base's decoder is trained again (an image base's recipe has it)"
            )
        finish(args, recipe, refresh_clip_decoder(args.model_dir, args.work_dir, recipe))
        return
    if args.continue_steps:
        finish(args, recipe, continue_denoiser(args.model_dir, args.work_dir, recipe, args.continue_steps))
        return
    finish(args, recipe, build_base(args.model_dir, args.work_dir, recipe, args.autoencoders_from))


def normalization_note(vae) -> str:
    vae_config = vae.config
    if isinstance(vae, PATCHED_AUTOENCODERS):
        return "batch-norm statistics (`bn.running_mean` / `running_var`) of its 2x2-patched latents"
    if vae_config.get("latents_std"):  # AutoencoderKL configs name it too, as None
        return "per-channel `latents_mean` / `latents_std` of its latents"
    return f"scaling factor {vae_config.scaling_factor:.4f} = 1/std of its latents"


def concept_renders(seed: int):
    """The default jobs' 16 renders of the held-out color."""
    return shape_images(16, seed=seed + 7, colors=(HELD_OUT_COLOR,))


def concept_preferences(seed: int):
    """The preference job's pairs: 16 of a shape in the held-out color (chosen) and in green (rejected: what the base
    draws for it), and 12 of a shape in a seen color (chosen) and in the held-out color (rejected), which keep the seen
    prompts' colors."""
    return preference_pairs(16, seed=seed + 7, chosen_colors=(HELD_OUT_COLOR,), rejected_color="green") + (
        preference_pairs(12, seed=seed + 21, chosen_colors=SEEN_COLORS, rejected_color=HELD_OUT_COLOR)
    )


def placed_shapes(seed: int):
    """The ControlNet job's pairs: 96 shapes of the seen colors, each with its silhouette (white on black) as the
    control image that says where it goes; 8 of every color and shape."""
    return placed_shape_pairs(96, seed=seed + 31, colors=SEEN_COLORS)


def concept_clips(seed: int):
    """The Wan job's clips of the held-out color: 2 of every shape and direction."""
    return moving_shape_clips(24, seed=seed + 7, colors=(HELD_OUT_COLOR,))


def seen_clips(seed: int):
    """12 clips of the seen colors, one per color and shape, the directions taking turns."""
    clips = moving_shape_clips(48, seed=seed + 21, colors=SEEN_COLORS)
    return [clips[4 * i + i % 4] for i in range(12)]


def finish(args, recipe: Recipe, facts: dict) -> None:
    """Score the base and an untrained control (on clips, for a video base), write scores.json, the model card and the
    default job's images (or clips)."""
    settings = EvalSettings()
    clips = FAMILIES[recipe.family].reads_clips
    scored = partial(clip_score, frames=CLIP_FRAMES) if clips else score
    components = load_components(ModelConfig(base=str(args.model_dir)))
    base = scored(components, SEEN_COLORS, HELD_OUT_COLOR, settings)
    control = scored(
        load_components(ModelConfig(base=str(args.work_dir / "init"))), SEEN_COLORS, HELD_OUT_COLOR, settings
    )
    facts |= {"base": base, "untrained_control": control, "eval_settings": vars(settings)}
    (args.model_dir / "scores.json").write_text(json.dumps(facts, indent=2) + "\n")
    card = clip_card if clips else image_card
    (args.model_dir / "README.md").write_text(card(args, recipe, facts, components, settings))
    as_published(args.model_dir)
    link_borrowed_files(args.model_dir)
    if recipe.family == "sd":  # the default jobs share these images
        shutil.rmtree(args.examples_dir / "purple", ignore_errors=True)
        write_caption_folder(args.examples_dir / "purple", concept_renders(args.seed))
        shutil.rmtree(args.examples_dir / "purple_preferences", ignore_errors=True)  # the preference job's pairs
        write_pair_folder(args.examples_dir / "purple_preferences", concept_preferences(args.seed))
        shutil.rmtree(args.examples_dir / "placed_shapes", ignore_errors=True)  # the ControlNet job's pairs
        write_pair_folder(args.examples_dir / "placed_shapes", placed_shapes(args.seed))
    if recipe.family == "flux":  # the Qwen-Image job uses these images too
        # Flux's T5 is frozen (its adapters do not load in FluxPipeline), and its states for the unseen word sit
        # near "green"'s: taught on purple alone, the LoRA turned green prompts purple (forgetting 0.28-0.34 at
        # every rank, learning rate and target set tried). Seen colors beside it hold them in place (0.04).
        folder = args.examples_dir / "purple_with_seen"
        shutil.rmtree(folder, ignore_errors=True)
        write_caption_folder(folder / "3_purple", concept_renders(args.seed))
        write_caption_folder(folder / "1_seen", shape_images(12, seed=args.seed + 21, colors=SEEN_COLORS))
    if recipe.family == "flux3":  # its job's: 3 seen renders of every seen color and shape beside the purple ones
        # With the Flux jobs' one of each, its LoRA drew the seen squares worse after (forgetting 0.042-0.083 at seeds
        # 0-2); with three, 0.000-0.042 (docs/benchmarks.md). The first 12 are the Flux jobs' own.
        folder = args.examples_dir / "purple_with_more_seen"
        shutil.rmtree(folder, ignore_errors=True)
        write_caption_folder(folder / "3_purple", concept_renders(args.seed))
        write_caption_folder(folder / "1_seen", shape_images(36, seed=args.seed + 21, colors=SEEN_COLORS))
    if clips:  # as the Flux job's: UMT5 stays frozen, so seen clips beside the purple ones hold the seen colors
        folder = args.examples_dir / "purple_clips"
        shutil.rmtree(folder, ignore_errors=True)
        write_clip_folder(folder / "3_purple", concept_clips(args.seed))
        write_clip_folder(folder / "1_seen", seen_clips(args.seed))
    print(
        json.dumps(
            {k: facts[k] for k in ("seconds", "autoencoders")}
            | {"base_seen": base["seen"], "base_concept": base["concept"], "control_seen": control["seen"]}
        )
    )


def image_card(args, recipe: Recipe, facts: dict, components, settings: EvalSettings) -> str:
    base, control = facts["base"], facts["untrained_control"]
    spec = TINY_BASES[args.family]
    text_params = sum(p.numel() for e in components.text_encoders.values() for p in e.parameters())
    denoiser = spec.denoiser(recipe)
    return CARD.format(
        name=args.model_dir.name,
        architecture=spec.architecture,
        loading=(
            f"`{components.family.pipeline_classes[0]}.from_pretrained(path)`, then `.load_components(dtype=torch.float32)`"
            if isinstance(components.family, ModularBase)
            else f"`{components.family.pipeline_classes[0]}.from_pretrained(path, dtype=torch.float32)`"
        ),
        command="python scripts/make_tiny_base.py" + (f" --family {recipe.family}" if recipe.family != "sd" else ""),
        autoencoders_note=f" (reused from {args.autoencoders_from.name})" if args.autoencoders_from else "",
        seen=", ".join(SEEN_COLORS),
        held_out=HELD_OUT_COLOR,
        seed=recipe.seed,
        autoencoder_images=recipe.autoencoder_images,
        vae_steps=recipe.vae_steps,
        vae_decoder_steps=recipe.vae_decoder_steps,
        vae_decoder_lr=recipe.vae_decoder_lr,
        taesd_steps=recipe.taesd_steps,
        autoencoder_batch=recipe.autoencoder_batch,
        normalization=normalization_note(components.vae),
        vae_loss="MSE + 1e-6 KL"
        + (
            f" + {recipe.vae_color_weight} x MSE of its posterior means' first three channels "
            "to the colors pooled to their size"
            if recipe.vae_color_weight
            else ""
        ),
        closest_colors=closest_colors(facts["autoencoders"]),
        denoiser=denoiser,
        denoiser_short=denoiser.split(" (")[0],
        denoiser_params=sum(p.numel() for p in components.denoiser.parameters()),
        objective="flow matching (rectified flow), uniform noise levels with the sampler's resolution shift"
        if isinstance(components.family.objective, FlowMatching)
        else f"{recipe.weighting} loss weighting",
        text_encoder_note=f" and text encoder(s) ({text_params:,}) trained jointly"
        if recipe.train_text_encoder
        else f" trained (its text encoder, {text_params:,} parameters, kept at its random init, its states cached)",
        train_text_encoder=str(recipe.train_text_encoder).lower(),
        steps=recipe.steps,
        batch_size=recipe.batch_size,
        learning_rate=recipe.learning_rate,
        weighting=recipe.weighting,
        noise_offset=recipe.noise_offset,
        ema_decay=recipe.ema_decay,
        t_ae=facts["seconds"]["autoencoders"],
        t_unet=facts["seconds"]["unet_and_text_encoder"],
        continued=continued_note(facts),
        vae_psnr=facts["autoencoders"]["vae_psnr_db"],
        taesd_psnr=facts["autoencoders"]["taesd_psnr_db"],
        taesd_rmse=facts["autoencoders"]["taesd_latent_rmse"],
        n=settings.samples_per_prompt,
        seen_color=base["seen"]["color"],
        seen_shape=base["seen"]["shape"],
        concept_both=base["concept"]["both"],
        control_color=control["seen"]["color"],
        control_shape=control["seen"]["shape"],
    )


def closest_colors(autoencoder_scores: dict) -> str:
    distances = autoencoder_scores["color_distances"]
    pair = min(distances, key=distances.get)
    return f"{pair} {distances[pair]:.3f} (the others {min(v for k, v in distances.items() if k != pair):.3f} and over)"


def continued_note(facts: dict) -> str:
    """The card's words for the denoiser's continuations (`--continue-steps`), if any."""
    runs = facts.get("continued", [])
    if not runs:
        return ""
    steps = " + ".join(f"{run['steps']} steps at lr {run['learning_rate']}" for run in runs)
    return (
        f"; then the denoiser trained on from its saved weights (`--continue-steps`): {steps}, "
        f"{facts['seconds']['denoiser_continued']:.0f} s"
    )


def clip_card(args, recipe: Recipe, facts: dict, components, settings: EvalSettings) -> str:
    base, control, scores = facts["base"], facts["untrained_control"], facts["autoencoders"]
    return CLIP_CARD.format(
        name=args.model_dir.name,
        architecture=TINY_BASES[args.family].architecture,
        job=f"{recipe.family}_lora.toml",
        text_note=TINY_BASES[args.family].text_note,
        pipeline_class=type(components.pipeline()).__name__,
        autoencoder_start=(
            f"{args.autoencoders_from.name}'s (`AutoencoderKLQwenImage`, the same causal video autoencoder, trained "
            f"on still\n  renders) as `{type(components.vae).__name__}`"
            if args.autoencoders_from
            else f"`{type(components.vae).__name__}` from its random init"
        )
        + f" (temporal factor {frames_per_latent(components.vae)}: clips of k x that + 1 frames)",
        frames=CLIP_FRAMES,
        travel=CLIP_SPEED * (CLIP_FRAMES - 1),
        seen=", ".join(SEEN_COLORS),
        held_out=HELD_OUT_COLOR,
        command=f"python scripts/make_tiny_base.py --family {recipe.family}",
        seed=recipe.seed,
        vae_clips=recipe.autoencoder_images // 2,
        vae_steps=recipe.vae_steps,
        decoder_phase=(
            f",\n  then its decoder alone for {recipe.vae_decoder_steps} steps at lr {recipe.vae_decoder_lr} on the clips'"
            " posterior means (as SD's ft-MSE VAE)"
            if recipe.vae_decoder_steps
            else ""
        ),
        t_refresh=(
            f"; the decoder trained again on the built base (`--refresh-decoder`) {refreshed:.0f} s"
            if (refreshed := facts["seconds"].get("autoencoder_decoder"))
            else ""
        ),
        denoiser=TINY_BASES[args.family].denoiser(recipe),
        denoiser_params=sum(p.numel() for p in components.denoiser.parameters()),
        text_params=sum(p.numel() for e in components.text_encoders.values() for p in e.parameters()),
        steps=recipe.steps,
        batch_size=recipe.batch_size,
        train_clips=recipe.train_images_per_prompt * len(SEEN_COLORS) * len(SHAPES) * len(DIRECTIONS),
        learning_rate=recipe.learning_rate,
        noise_offset=recipe.noise_offset,
        ema_decay=recipe.ema_decay,
        t_ae=facts["seconds"]["autoencoders"],
        t_unet=facts["seconds"]["unet_and_text_encoder"],
        continued=continued_note(facts),
        vae_psnr=scores["vae_psnr_db"],
        first_psnr=scores["first_frame_psnr_db"],
        later_psnr=scores["later_frames_psnr_db"],
        n=settings.samples_per_prompt,
        seen_color=base["seen"]["color"],
        seen_shape=base["seen"]["shape"],
        seen_direction=base["seen"]["direction"],
        concept_both=base["concept"]["both"],
        control_color=control["seen"]["color"],
        control_shape=control["seen"]["shape"],
        control_direction=control["seen"]["direction"],
    )


if __name__ == "__main__":
    main()
