"""What every judge draws with (the shapes judge's, judge.py; the tone judge's, tone_judge.py): an evaluation's
settings, the pipeline it draws through, and its progress lines."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from difftune.families.common.drawing import sampling_scheduler
from difftune.models.components import Components
from difftune.toy.tiny import IMAGE_SIZE


@dataclass
class EvalSettings:
    samples_per_prompt: int = 8
    seed: int = 1000  # sample k of a prompt uses seed + k, for every prompt and every model
    steps: int = 20
    guidance_scale: float = 3.0
    scheduler: str = "auto"  # the family's default sampler
    resolution: int = IMAGE_SIZE  # the judge's: a pipeline's own default may be another (FluxPipeline's is 1024 px)


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
