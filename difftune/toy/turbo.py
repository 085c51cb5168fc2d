"""A turbo base made from a tiny one, and its de-distilling training adapter (`build_turbo_base`).

Distillation (`distil`): the base, guided, is the teacher; the student starts as the base and learns to sample in
`steps` Euler steps without guidance, as Z-Image Turbo and FLUX.1 [schnell] do. The teacher's trajectories are drawn
once (`teacher_trajectories`: from each noise, `teacher_substeps` guided Euler steps within each of the student's, the
states at the student's sigmas kept), and the student regresses, at each of its sigmas, the velocity that lands on
the teacher's state at its next one: trajectory distillation (Luhman & Luhman 2021's direct distillation, taken step
by step as progressive distillation's student is). A regression on fixed pairs needs no second model while training,
which is what makes it fit two CPU cores.

The training adapter is made as ostris made Z-Image Turbo's and FLUX.1 [schnell]'s: images the turbo base drew
itself (`write_own_samples`), and a LoRA trained on them by `difftune train`'s ordinary flow-matching loss at a low
learning rate (`training_adapter_overrides`), which moves it back toward an undistilled model without teaching anything
new.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from difftune.config import ModelConfig, load_config
from difftune.families import load_components
from difftune.models.autoencoders import downsampling, latent_channels
from difftune.models.components import Components
from difftune.toy.judge import EvalSettings, judged_samples, prompts_for
from difftune.toy.tiny import IMAGE_SIZE, write_caption_folder
from difftune.toy.tiny_base import cosine_lr, timed

TRAINING_ADAPTER = "training_adapter.safetensors"  # in the turbo base's folder, as `model.training_adapter` reads it


@dataclass(frozen=True)
class TurboRecipe:
    """How the tiny turbo base and its training adapter are made; the defaults are what
    `scripts/make_tiny_turbo_base.py` commits."""

    seed: int = 0
    steps: int = 4  # the student's sampling steps, unguided
    teacher_substeps: int = 8  # the teacher's Euler steps within each of the student's
    teacher_guidance: float = 3.0  # classifier-free, the empty prompt as the negative (the base's eval setting)
    trajectories_per_prompt: int = 64
    distil_steps: int = 3000
    batch_size: int = 64
    learning_rate: float = 2e-4
    ema_decay: float = 0.99
    # The training adapter: a LoRA on the turbo base's own samples, at a low learning rate
    adapter_images_per_prompt: int = 32
    adapter_steps: int = 600
    adapter_batch_size: int = 16
    adapter_learning_rate: float = 1e-4
    adapter_rank: int = 16
    # The turbo job's seen images: the turbo's own drawings of each seen prompt, so that what the job's LoRA learns of
    # them is what the turbo already draws (with the renders the tiny base learned from, it forgot 0.06-0.13)
    job_seen_per_prompt: int = 2

    def sampling(self, samples_per_prompt: int = 8, seed: int = 1000) -> EvalSettings:
        """How the turbo base is drawn and judged: `steps` steps, unguided (the judge's seeds by default)."""
        return EvalSettings(samples_per_prompt=samples_per_prompt, seed=seed, steps=self.steps, guidance_scale=1.0)


@dataclass
class Trajectories:
    """The teacher's states at the student's sigmas: `states` (N, steps + 1, C, h, w), noise first and the sample's
    latents last; `prompts` (N) indexes the prompts they were drawn for; `schedule` the student's timesteps (steps + 1,
    1000 = pure noise)."""

    states: torch.Tensor
    prompts: torch.Tensor
    schedule: torch.Tensor


def _geometry(batch: int) -> torch.Tensor:
    return torch.tensor([IMAGE_SIZE, IMAGE_SIZE, 0, 0, IMAGE_SIZE, IMAGE_SIZE]).expand(batch, -1)


def _velocity(components: Components, noisy: torch.Tensor, timesteps: torch.Tensor, conditioning: dict):
    timesteps = timesteps.expand(noisy.shape[0])
    return components.family.denoise(components, noisy, timesteps, conditioning, _geometry(noisy.shape[0])).float()


def _rows(conditioning: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: value[rows] for name, value in conditioning.items()}


@torch.no_grad()
def teacher_trajectories(
    components: Components, prompts: list[str], recipe: TurboRecipe, batch_size: int = 128
) -> Trajectories:
    """`recipe.trajectories_per_prompt` guided samples of each prompt by the base, kept at the student's sigmas."""
    family = components.family
    size = IMAGE_SIZE // downsampling(components.vae)
    texts = family.conditioning.encoded_texts(components, [*prompts, ""], torch.device("cpu"))
    prompt_ids = torch.arange(len(prompts)).repeat_interleave(recipe.trajectories_per_prompt)
    generator = torch.Generator().manual_seed(recipe.seed)
    noise = torch.randn((len(prompt_ids), latent_channels(components.vae), size, size), generator=generator)
    schedule = family.objective.sampling_timesteps(components, noise[:1], recipe.steps)
    kept = []
    for start in tqdm(range(0, len(prompt_ids), batch_size), desc="teacher", unit="batch"):
        rows = prompt_ids[start : start + batch_size]
        conditioning = _rows(texts, torch.cat([rows, torch.full_like(rows, len(prompts))]))
        state = noise[start : start + batch_size]
        states = [state]
        for step in range(recipe.steps):
            sigmas = torch.linspace(float(schedule[step]), float(schedule[step + 1]), recipe.teacher_substeps + 1)
            for high, low in zip(sigmas[:-1], sigmas[1:], strict=True):
                prompted, unguided = _velocity(components, torch.cat([state, state]), high, conditioning).chunk(2)
                state = state + (low - high) / 1000 * (unguided + recipe.teacher_guidance * (prompted - unguided))
            states.append(state)
        kept.append(torch.stack(states, dim=1))
    return Trajectories(torch.cat(kept), prompt_ids, schedule)


@torch.no_grad()
def landing_error(components: Components, prompts: list[str], trajectories: Trajectories) -> float:
    """How far the denoiser's unguided Euler steps land from the teacher's next states: the mean squared distance, over
    the trajectories and the student's steps (what `distil` lowers)."""
    texts = components.family.conditioning.encoded_texts(components, prompts, torch.device("cpu"))
    conditioning = _rows(texts, trajectories.prompts)
    states, schedule = trajectories.states, trajectories.schedule
    errors = []
    for level in range(len(schedule) - 1):
        velocity = _velocity(components, states[:, level], schedule[level], conditioning)
        landed = states[:, level] + (schedule[level + 1] - schedule[level]) / 1000 * velocity
        errors.append(torch.mean((landed - states[:, level + 1]) ** 2))
    return float(torch.stack(errors).mean())


def distil(components: Components, prompts: list[str], trajectories: Trajectories, recipe: TurboRecipe) -> list[dict]:
    """The denoiser trained in place to land each of its unguided steps on the teacher's next state (AdamW, cosine from
    `learning_rate`); it keeps its EMA weights. Returns the loss every 100 steps."""
    family, denoiser = components.family, components.denoiser
    texts = family.conditioning.encoded_texts(components, prompts, torch.device("cpu"))
    ema = copy.deepcopy(denoiser).requires_grad_(False)
    denoiser.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(denoiser.parameters(), lr=recipe.learning_rate, weight_decay=0.0)
    schedule, states = trajectories.schedule, trajectories.states
    generator = torch.Generator().manual_seed(recipe.seed + 1)
    losses = []
    for step in tqdm(range(recipe.distil_steps), desc="distil", unit="step"):
        cosine_lr(optimizer, recipe.learning_rate, step, recipe.distil_steps, warmup=1)
        rows = torch.randint(len(states), (recipe.batch_size,), generator=generator)
        level = torch.randint(recipe.steps, (recipe.batch_size,), generator=generator)
        high, low = schedule[level], schedule[level + 1]
        target = (states[rows, level + 1] - states[rows, level]) / ((low - high) / 1000).view(-1, 1, 1, 1)
        prediction = _velocity(components, states[rows, level], high, _rows(texts, trajectories.prompts[rows]))
        loss = torch.nn.functional.mse_loss(prediction, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            for kept, trained in zip(ema.parameters(), denoiser.parameters(), strict=True):
                kept.lerp_(trained, 1 - recipe.ema_decay)
        if step % 100 == 0 or step == recipe.distil_steps - 1:
            losses.append({"step": step, "loss": round(loss.item(), 5)})
    denoiser.load_state_dict(ema.state_dict())
    denoiser.eval().requires_grad_(False)
    return losses


@torch.no_grad()
def write_own_samples(
    components: Components, folder: Path, prompts: list[str], recipe: TurboRecipe, per_prompt: int | None = None
) -> Path:
    """`per_prompt` samples of each prompt (`adapter_images_per_prompt`: what its training adapter learns from) by the
    turbo base as it is drawn (`recipe.sampling`), in the kohya layout; sample k of each from the same seed whatever
    their count, so the turbo job's seen images (`job_seen_per_prompt`) are the adapter's first ones."""
    count = per_prompt or recipe.adapter_images_per_prompt
    settings = recipe.sampling(count, seed=recipe.seed + 10_000)  # not the judge's seeds
    rows = judged_samples(components, prompts, settings)
    shutil.rmtree(folder, ignore_errors=True)
    write_caption_folder(folder, [(row["image"], row["prompt"]) for row in rows])
    return folder


def training_adapter_overrides(recipe: TurboRecipe, base: Path, data_dir: Path, output_dir: Path) -> list[str]:
    """The `difftune train` job that makes the training adapter: a LoRA on the transformer, the ordinary loss, a
    constant low learning rate."""
    values = {
        "model.base": base,
        "data.path": data_dir,
        "data.resolution": IMAGE_SIZE,
        "data.caption_dropout": 0.1,
        "data.num_workers": 0,
        "adapter.kind": "lora",
        "adapter.rank": recipe.adapter_rank,
        "adapter.text_encoder": "false",
        "loss.flow_shift_by_resolution": "true",
        "optim.learning_rate": recipe.adapter_learning_rate,
        "optim.lr_schedule": "constant",
        "train.output_dir": output_dir,
        "train.overwrite": "true",
        "train.max_steps": recipe.adapter_steps,
        "train.batch_size": recipe.adapter_batch_size,
        "train.seed": recipe.seed,
        "cache.latents": "true",
        "cache.dir": output_dir.parent / "cache",
        "checkpoint.every_steps": 0,
        "log.tensorboard": "false",
    }
    return [f"{key}={value}" for key, value in values.items()]


def build_turbo_base(source: Path, out_dir: Path, work_dir: Path, recipe: TurboRecipe, seen_colors) -> dict:
    """`source` distilled into `out_dir` (fp16, with its TAESD if it has one), and its training adapter
    (`make_training_adapter`); returns the build's facts (recipe, seconds, distillation losses)."""
    prompts = prompts_for(seen_colors)
    components = load_components(ModelConfig(base=str(source)))
    seconds = {}
    with timed(seconds, "teacher"):
        trajectories = teacher_trajectories(components, prompts, recipe)
    with timed(seconds, "distil"):
        losses = distil(components, prompts, trajectories, recipe)
    shutil.rmtree(out_dir, ignore_errors=True)
    components.family.loading.save_pipeline(components.pipeline().to(torch.float16), out_dir)
    if (source / "taesd").is_dir():  # a bundled base's TAESD (a micro base has none)
        shutil.copytree(source / "taesd", out_dir / "taesd")
    with timed(seconds, "training_adapter"):
        make_training_adapter(out_dir, work_dir, recipe, seen_colors)
    return {"recipe": asdict(recipe) | {"source": str(source)}, "seconds": seconds, "distil_loss": losses}


def make_training_adapter(turbo_dir: Path, work_dir: Path, recipe: TurboRecipe, seen_colors) -> None:
    """The turbo base's training adapter, written to `TRAINING_ADAPTER` in its folder from its own samples of the seen
    prompts."""
    from difftune.training.train import train

    turbo = load_components(ModelConfig(base=str(turbo_dir)))
    data_dir = write_own_samples(turbo, work_dir / "own_samples", prompts_for(seen_colors), recipe)
    run_dir = work_dir / "training_adapter"
    result = train(load_config(None, training_adapter_overrides(recipe, turbo_dir, data_dir, run_dir)))
    shutil.copyfile(result.trained_path, turbo_dir / TRAINING_ADAPTER)
