"""Build the bundled tiny sound base: `python scripts/make_tiny_sound_base.py` (models/tiny-ace_step).

ACE-Step's classes at toy size trained on tones (difftune/toy/tiny_sound_base.py): the autoencoder on tones of every
pitch, the transformer on the heard pitches' tones alone; then scored by the tone judge (toy/tone_judge.py), with the
untrained model as a control, and the model card written; and a job's tones written (examples/shrill_with_heard).
Deterministic by seed. `--card-only` writes the card and the job's tones again from the built base's scores.json.
"""

import argparse
import json
import shutil
from dataclasses import fields
from pathlib import Path

from difftune.config import ModelConfig
from difftune.families import load_components
from difftune.toy.judge import EvalSettings
from difftune.toy.tiny_sound_base import SoundRecipe, build_sound_base
from difftune.toy.tone_judge import tone_score
from difftune.toy.tones import HEARD_PITCHES, HELD_OUT_PITCH, PITCHES, TIMBRES, tone_sounds, write_sound_folder

ARCHITECTURE = (
    "ACE-Step 1.5's architecture at toy size, from the same classes (`AceStepTransformer1DModel`, a DiT over\n"
    "time with sliding and full self-attention and cross-attention to its conditioning, over Stable Audio's kind of\n"
    "`AutoencoderOobleck`, an `AceStepConditionEncoder` and a `Qwen3Model` language model, with a byte-level\n"
    "`Qwen2Tokenizer` built here), drawn by `AceStepPipeline`"
)

CARD = """---
library_name: diffusers
pipeline_tag: text-to-audio
tags: [difftune, tiny, synthetic, audio]
---
# {name}: a one-second text-to-sound model of tones, trained by difftune

{architecture}, trained on synthetic tones at {rate} Hz captioned `a <pitch> <timbre>` for pitches {heard} and
timbres {timbres} (difftune/toy/tones.py: a hum is a sine, a buzz adds its odd harmonics). The pitch `{held_out}`
({held_out_hz:.0f} Hz, a fourth above `high`) was never played to the transformer or the text encoder: it is the
concept a LoRA on it is judged by (`examples/shrill_with_heard`). Its autoencoder heard every pitch, as an image
base's autoencoder sees every color.

Draw it: `difftune sample --base models/{name} --seconds {seconds:g} --prompt "a low hum" --out samples` (FLAC and
their spectrograms); judge it: `difftune eval --base models/{name}`. Weights are fp16; on a CPU load them as fp32.

## Recipe (`python scripts/make_tiny_sound_base.py`, seed {seed})

- autoencoder: the micro `AutoencoderOobleck` ({rate} Hz stereo, {hop} samples a latent frame: {fps:g} a second,
  {channels} channels), trained on fresh tones of every pitch and timbre each step (a twentieth silence): waveform L1
  plus spectral L1s of magnitudes and log magnitudes at three resolutions, as Stable Audio's autoencoder is trained,
  and {kl_weight:g} KL; {vae_steps} steps at batch {vae_batch}, lr {vae_learning_rate} cosine ({vae_s:.0f} s). Its
  reconstructions are judged as the tone was: {autoencoder_judged}{shortfall}; {snr_db} dB signal to noise; latent
  spread {latent_std}. Every tone starts at phase 0 (toy/tones.py says why). The condition encoder's learned silence is
  its encoding of silence, as ACE-Step's is.
- transformer ({layers} blocks, width {width}) ({params:,} parameters) trained by `difftune train` with
  `adapter.kind = "none"`: {steps} steps at batch {batch_size}, AdamW lr {learning_rate} cosine, flow matching, caption
  dropout 0.1 (the null condition, as ACE-Step's trainer drops conditions), cached latents and captions, EMA
  {ema_decay} (the EMA weights are what is saved); {tones} tones ({per_prompt} per prompt), {denoiser_s:.0f} s on 2 CPU
  cores. The Qwen3 text encoder and the condition encoder stay at their random init (as tiny-flux's T5): the
  condition encoder reads 30 s of silence for its timbre at every call, which would be most of every step's time.

## Scores (the tone judge: the loudest frequency's nearest pitch, the third harmonic's level for the timbre)

{n} samples per prompt, 20 steps, guidance 3 (the pipeline's adaptive projected guidance), seeds fixed:

| model | heard prompts: pitch | timbre | both | `{held_out}` prompts: pitch |
| --- | ---: | ---: | ---: | ---: |
| {name} | {pitch:.3f} | {timbre:.3f} | {both:.3f} | {concept:.3f} |
| untrained (its init) | {before_pitch:.3f} | {before_timbre:.3f} | {before_both:.3f} | {before_concept:.3f} |
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path("models/tiny-ace_step"))
    parser.add_argument("--work-dir", type=Path, default=Path("output/tiny-ace_step-build"))
    parser.add_argument("--examples-dir", type=Path, default=Path("examples"))
    parser.add_argument(
        "--card-only", action="store_true", help="write the card and the job's tones again from the built base's scores"
    )
    for field in fields(SoundRecipe):
        if field.name in ("seed", "steps", "vae_steps", "batch_size"):
            parser.add_argument(f"--{field.name.replace('_', '-')}", type=int, default=field.default)
    args = parser.parse_args()
    recipe = SoundRecipe(
        family="ace_step", seed=args.seed, steps=args.steps, vae_steps=args.vae_steps, batch_size=args.batch_size
    )
    if not args.card_only:
        facts = build_sound_base(args.model_dir, args.work_dir, recipe)
    built = load_components(ModelConfig(base=str(args.model_dir)))  # loaded once: scored, then described
    if args.card_only:
        facts = json.loads((args.model_dir / "scores.json").read_text())
    else:
        settings = EvalSettings()
        scores = tone_score(built, HEARD_PITCHES, HELD_OUT_PITCH, settings)
        untrained = load_components(ModelConfig(base=str(args.work_dir / "init")))
        control = tone_score(untrained, HEARD_PITCHES, HELD_OUT_PITCH, settings)
        facts |= {"base": scores, "untrained": control, "eval_settings": vars(settings)}
        (args.model_dir / "scores.json").write_text(json.dumps(facts, indent=2) + "\n")
    (args.model_dir / "README.md").write_text(model_card(args.model_dir.name, built, facts))
    write_job_tones(args.examples_dir, built.vae.config.sampling_rate, facts["recipe"]["seconds"], args.seed)
    print(json.dumps({"base": facts["base"]["seen"], "concept": facts["base"]["concept"]}, indent=1))


def model_card(name: str, built, facts: dict) -> str:
    vae, denoiser, recipe = built.vae.config, built.denoiser, facts["recipe"]
    judged = facts["autoencoder"]["judged_as_the_tone"]
    scores, control = facts["base"], facts["untrained"]
    return CARD.format(
        name=name,
        architecture=ARCHITECTURE,
        rate=vae.sampling_rate,
        hop=built.pixels_per_latent,
        fps=vae.sampling_rate / built.pixels_per_latent,
        channels=vae.decoder_input_channels,
        heard=", ".join(HEARD_PITCHES),
        timbres=", ".join(TIMBRES),
        held_out=HELD_OUT_PITCH,
        held_out_hz=PITCHES[HELD_OUT_PITCH],
        autoencoder_judged=", ".join(f"{pitch} {value:.2f}" for pitch, value in judged.items()),
        shortfall="".join(
            f" (the {pitch} tones' a timbre short: the base plays them so too)"
            for pitch, value in judged.items()
            if value < 1
        ),
        snr_db=facts["autoencoder"]["snr_db"],
        latent_std=facts["autoencoder"]["latent_std"],
        vae_s=facts["seconds"]["autoencoder"],
        denoiser_s=facts["seconds"]["denoiser"],
        layers=denoiser.config.num_hidden_layers,
        width=denoiser.config.hidden_size,
        params=sum(p.numel() for p in denoiser.parameters()),
        tones=recipe["tones_per_prompt"] * len(HEARD_PITCHES) * len(TIMBRES),
        per_prompt=recipe["tones_per_prompt"],
        n=facts["eval_settings"]["samples_per_prompt"],
        **{key: value for key, value in recipe.items() if key != "family"},
        **scores["seen"],
        concept=scores["concept"]["pitch"],
        **{f"before_{key}": value for key, value in control["seen"].items()},
        before_concept=control["concept"]["pitch"],
    )


def write_job_tones(examples_dir: Path, rate: int, seconds: float, seed: int) -> None:
    """A job's tones, as the image jobs' purple_with_seen: the held-out pitch's, three times an epoch, beside two of
    each heard prompt's."""
    folder = examples_dir / "shrill_with_heard"
    shutil.rmtree(folder, ignore_errors=True)
    write_sound_folder(folder / "3_shrill", tone_sounds(16, seed + 20, seconds, rate, pitches=(HELD_OUT_PITCH,)))
    write_sound_folder(folder / "1_heard", tone_sounds(12, seed + 21, seconds, rate))


if __name__ == "__main__":
    main()
