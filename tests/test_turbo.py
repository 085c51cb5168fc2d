"""The tiny turbo base's making (toy/turbo.py): the teacher's trajectories are the family's own pipeline's guided
samples, kept at the student's sigmas, and distillation brings the student's few unguided steps onto them. The turbo
job's quality (its training adapter keeping the few-step drawing) is test_quality.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from difftune.config import ModelConfig
from difftune.families import load_components
from difftune.toy.turbo import TurboRecipe, distil, landing_error, teacher_trajectories

PROMPTS = ["a red circle", "a blue square"]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def base(micro_base):
    return micro_base("z_image")


def test_the_teachers_trajectory_is_the_pipelines_guided_sample(base):
    """The last state kept is what ZImagePipeline draws from the same noise over the same sigmas, guided as difftune
    guides at 3 (the pipeline's 2); the first is the noise, and one state is kept at each of the student's sigmas."""
    components = load_components(ModelConfig(base=str(base)))
    recipe = TurboRecipe(steps=2, teacher_substeps=3, trajectories_per_prompt=2)
    trajectories = teacher_trajectories(components, PROMPTS, recipe)
    states, schedule = trajectories.states, trajectories.schedule
    assert states.shape[:2] == (4, 3) and trajectories.prompts.tolist() == [0, 0, 1, 1]
    assert schedule[0] == 1000 and schedule[-1] == 0 and len(schedule) == 3
    sigmas = torch.cat(
        [torch.linspace(float(high), float(low), 4)[:-1] for high, low in zip(schedule[:-1], schedule[1:], strict=True)]
    )
    pipeline = components.pipeline()
    shift = pipeline.scheduler.config.shift  # the scheduler shifts the sigmas it is given: give it their preimage
    given = (sigmas / 1000) / (shift - (shift - 1) * sigmas / 1000)
    pipeline.set_progress_bar_config(disable=True)
    drawn = pipeline(
        prompt=PROMPTS[1],
        negative_prompt="",
        latents=states[2:3, 0],
        sigmas=given.tolist(),
        guidance_scale=2.0,
        height=32,
        width=32,
        output_type="latent",
    ).images
    torch.testing.assert_close(drawn.float(), states[2:3, -1], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(states[2:3, 1], states[2:3, 0], atol=1e-2)  # a state between them, moved from the noise


def test_distillation_lands_the_students_steps_on_the_teachers_states(base):
    components = load_components(ModelConfig(base=str(base)))
    recipe = TurboRecipe(
        steps=2,
        teacher_substeps=4,
        trajectories_per_prompt=4,
        distil_steps=40,
        batch_size=8,
        learning_rate=1e-3,
        ema_decay=0.0,  # the trained weights themselves
    )
    trajectories = teacher_trajectories(components, PROMPTS, recipe)
    before = landing_error(components, PROMPTS, trajectories)
    losses = distil(components, PROMPTS, trajectories, recipe)
    after = landing_error(components, PROMPTS, trajectories)
    assert [row["step"] for row in losses] == [0, 39]
    assert after < 0.5 * before, (before, after)
    assert not components.denoiser.training and not any(p.requires_grad for p in components.denoiser.parameters())


def test_a_built_turbo_base_loads_and_trains_over_its_training_adapter(base, tmp_path):
    """`build_turbo_base` on the micro Z-Image, every stage cut to a step or two: the folder loads in ZImagePipeline,
    and its training adapter is what `model.training_adapter` merges in (a LoRA on the transformer alone), left out of
    what the run saves."""
    from diffusers import ZImagePipeline
    from safetensors.torch import load_file

    from difftune.config import load_config
    from difftune.toy.turbo import TRAINING_ADAPTER, build_turbo_base
    from difftune.training.train import train

    recipe = TurboRecipe(
        steps=2,
        teacher_substeps=1,
        trajectories_per_prompt=1,
        distil_steps=2,
        batch_size=2,
        adapter_images_per_prompt=1,
        adapter_steps=2,
        adapter_batch_size=2,
    )
    out = tmp_path / "turbo"
    facts = build_turbo_base(base, out, tmp_path / "work", recipe, ["red"])
    assert set(facts["seconds"]) == {"teacher", "distil", "training_adapter"}
    assert len(list((tmp_path / "work" / "own_samples").glob("*.png"))) == 3  # one of each shape
    ZImagePipeline.from_pretrained(out, dtype=torch.float32)
    adapter = load_file(out / TRAINING_ADAPTER)
    assert adapter and all(key.startswith("transformer.") for key in adapter)
    config = load_config(
        None,
        [
            f"model.base={out}",
            f"model.training_adapter={out / TRAINING_ADAPTER}",
            f"data.path={tmp_path / 'work' / 'own_samples'}",
            "data.resolution=32",
            "data.num_workers=0",
            "train.max_steps=2",
            "train.batch_size=2",
            f"train.output_dir={tmp_path / 'run'}",
            "log.tensorboard=false",
        ],
    )
    saved = load_file(train(config).trained_path)
    assert saved.keys() == adapter.keys() and not any(torch.equal(saved[key], adapter[key]) for key in saved)


def test_the_turbo_jobs_seen_images_are_the_turbos_own_first_drawings(tmp_path):
    """examples/turbo_seen (configs/tiny_turbo_lora.toml's seen images) is what the bundled turbo base draws of the
    seen prompts as it is drawn (4 unguided steps) from its training adapter's first seeds: drawn again here for two
    prompts, one image each, within a level of the committed ones (a batch of one sums in another order)."""
    import numpy as np
    from PIL import Image

    from difftune.toy.turbo import write_own_samples

    examples = REPO / "examples" / "turbo_seen"
    recipe = TurboRecipe()
    captions = [path.read_text().strip() for path in sorted(examples.glob("*.txt"))]
    assert len(captions) == 12 * recipe.job_seen_per_prompt
    turbo = load_components(ModelConfig(base=str(REPO / "models" / "tiny-z_image_turbo")))
    prompts = ["a red circle", "a blue square"]
    drawn = write_own_samples(turbo, tmp_path / "drawn", prompts, recipe, per_prompt=1)
    for index, prompt in enumerate(prompts):
        committed = examples / f"{captions.index(prompt):04d}.png"  # the prompt's first drawing
        ours = np.asarray(Image.open(drawn / f"{index:04d}.png"), dtype=np.int16)
        assert np.abs(ours - np.asarray(Image.open(committed), dtype=np.int16)).max() <= 1
