"""What every judge draws with (the shapes judge's, judge.py; the tone judge's, tone_judge.py): an evaluation's
settings, the pipeline it draws through, its progress lines, and each prompt's drawings at fixed seeds."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from difftune.families.common.drawing import sampling_scheduler
from difftune.models.components import Components
from difftune.toy.tiny import IMAGE_SIZE
from difftune.toy.tones import TONE_SECONDS


@dataclass
class EvalSettings:
    samples_per_prompt: int = 8
    seed: int = 1000  # sample k of a prompt uses seed + k, for every prompt and every model
    steps: int = 20
    guidance_scale: float = 3.0
    scheduler: str = "auto"  # the family's default sampler
    resolution: int = IMAGE_SIZE  # the judge's: a pipeline's own default may be another (FluxPipeline's is 1024 px)
    seconds: float = TONE_SECONDS  # a sound's, the tone judge's: a sound base's own may be another (ACE-Step's 30 s)


PrintStatus = Callable[[str], None] | None  # where a long evaluation says how far it is (None: nowhere)


def counted(prompts: list[str], print_status: PrintStatus):
    """The prompts, each said as it starts: `3/24 a red circle`."""
    for number, prompt in enumerate(prompts, 1):
        if print_status:
            print_status(f"{number}/{len(prompts)} {prompt}")
        yield prompt


def within(print_status: PrintStatus, what: str) -> PrintStatus:
    return (lambda line: print_status(f"{what} {line}")) if print_status else None


def eval_pipeline(components: Components, settings: EvalSettings) -> tuple:
    """The components' pipeline with the eval's sampler, in eval mode, and its guidance arguments."""
    pipeline = components.pipeline(sampling_scheduler(settings.scheduler, components))
    pipeline.set_progress_bar_config(disable=True)
    for module in components.modules():
        module.eval()
    return pipeline, components.family.drawing.sampling_arguments(components, settings.guidance_scale, "")


def drawn_by_prompt(
    components: Components, prompts: list[str], settings: EvalSettings, print_status: PrintStatus, draw: Callable
) -> Iterator[tuple[str, int, object]]:
    """(prompt, seed, what was drawn) for each prompt's `settings.samples_per_prompt` drawings, sample k of every
    prompt from seed `settings.seed` + k: `draw(pipeline, prompts, **arguments)` draws a prompt's all at once (images,
    clips or sounds) through the evaluation's pipeline, with its steps, generators and guidance."""
    pipeline, guidance = eval_pipeline(components, settings)
    for prompt in counted(prompts, print_status):
        seeds = [settings.seed + k for k in range(settings.samples_per_prompt)]
        drawn = draw(
            pipeline,
            [prompt] * len(seeds),
            num_inference_steps=settings.steps,
            generator=[torch.Generator("cpu").manual_seed(seed) for seed in seeds],
            **guidance,
        )
        yield from ((prompt, seed, item) for seed, item in zip(seeds, drawn, strict=True))
