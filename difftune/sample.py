"""Sampling: one function that training (previews, end-of-run samples) and later tools share. A prompt with control
images (an edit base's) draws its edit of them, and its grid cell shows the controls before the result."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from difftune.config import DataConfig, PromptWithControls, SampleConfig
from difftune.autoencoders import load_vae
from difftune.data import BadImage, open_image
from difftune.errors import DifftuneError
from difftune.models import Components, eval_mode


def sampling_scheduler(name: str, components: Components):
    """The named sampler (`auto`: the family's default) over the model's own noise schedule."""
    return components.family.sampler(name).from_config(components.noise_scheduler.config)


@dataclass
class Sample:
    image: Image.Image
    entry: str | PromptWithControls  # the `sample.prompts` entry it was drawn for
    seed: int
    controls: list[Image.Image] = field(default_factory=list)  # an edit's control images, at the image's size (for the grid)

    @property
    def prompt(self) -> str:
        return self.entry if isinstance(self.entry, str) else self.entry.prompt


@torch.no_grad()
def generate_images(components: Components, config: SampleConfig, device: torch.device) -> list[Sample]:
    """`images_per_prompt` images per prompt; image k (counting across prompts) uses seed `config.seed + k`,
    so any image can be re-made alone. No `resolution`: the model's native size."""
    problems = components.family.prompt_control_problems(config.prompts)
    if problems:
        raise DifftuneError("; ".join(problems))
    decoder = load_vae(config.decoder).to(device, components.vae.dtype) if config.decoder else components.vae
    pipeline = replace(components, vae=decoder).pipeline(sampling_scheduler(config.scheduler, components))
    pipeline.set_progress_bar_config(disable=True)
    guidance = components.family.sampling_arguments(components, config.guidance_scale, config.negative_prompt)
    with eval_mode(components.denoiser, *components.text_encoders.values()):
        return _sample_all(pipeline, config, guidance, components)


def _sample_all(pipeline, config: SampleConfig, guidance: dict, components: Components) -> list[Sample]:
    samples = []
    for entry in config.prompts:
        prompt, controls = (entry, []) if isinstance(entry, str) else (entry.prompt, [_open_control(c) for c in entry.controls])
        for _ in range(config.images_per_prompt):
            seed = config.seed + len(samples)
            [image] = components.family.draw(
                pipeline, components.family_options, prompt, controls, config.resolution, config.resolution,
                num_inference_steps=config.steps, generator=torch.Generator("cpu").manual_seed(seed), **guidance,
            )
            samples.append(Sample(image, entry, seed, [c.resize(image.size) for c in controls]))
    return samples


def _open_control(path: str) -> Image.Image:
    try:
        return open_image(Path(path), DataConfig())
    except BadImage as err:
        raise DifftuneError(f"sample.prompts: control image {path}: {err}") from None


def save_images(samples: list[Sample], config: SampleConfig, out_dir: Path, before_dir: Path | None = None) -> list[Path]:
    """Each image as a PNG with its prompt and settings in the text chunk, plus `grid.png`: a cell per image, after its
    controls (an edit's) and, where `before_dir` holds the base's sample of the same number, after that."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, sample in enumerate(samples):
        info = PngInfo()
        info.add_text("prompt", sample.prompt)
        info.add_text(
            "parameters",
            f"negative_prompt={config.negative_prompt!r} steps={config.steps} guidance_scale={config.guidance_scale} "
            f"scheduler={config.scheduler} seed={sample.seed} size={sample.image.width}x{sample.image.height} "
            f"decoder={config.decoder or 'model'}",
        )
        if sample.controls:
            info.add_text("controls", "\n".join(sample.entry.controls))
        path = out_dir / f"{i:03d}.png"
        sample.image.save(path, pnginfo=info)
        paths.append(path)
    befores = [before_dir / path.name if before_dir and (before_dir / path.name).is_file() else None for path in paths]
    make_grid([side_by_side([*sample.controls, *([Image.open(before).convert("RGB")] if before else []), sample.image])
               for sample, before in zip(samples, befores)]).save(out_dir / "grid.png")
    return paths


def side_by_side(images: list[Image.Image]) -> Image.Image:
    """Images of one height in a row, left to right: an edit's controls, then what was drawn."""
    row = Image.new("RGB", (sum(image.width for image in images), images[0].height), "white")
    for i, image in enumerate(images):
        row.paste(image, (sum(other.width for other in images[:i]), 0))
    return row


def make_grid(images: list[Image.Image]) -> Image.Image:
    columns = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / columns)
    width, height = images[0].size
    grid = Image.new("RGB", (columns * width, rows * height), "white")
    for i, image in enumerate(images):
        grid.paste(image, ((i % columns) * width, (i // columns) * height))
    return grid
