"""Text-to-image sampling: one function that training (end-of-run samples) and later tools share."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
)
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from difftune.config import SampleConfig
from difftune.models import Components, assemble_pipeline

SCHEDULERS = {
    "ddim": DDIMScheduler,
    "euler": EulerDiscreteScheduler,
    "euler_a": EulerAncestralDiscreteScheduler,
    "dpmpp_2m": DPMSolverMultistepScheduler,
}


def sampling_scheduler(name: str, components: Components):
    """The named sampler over the model's own noise schedule."""
    return SCHEDULERS[name].from_config(components.noise_scheduler.config)


@torch.no_grad()
def generate_images(components: Components, config: SampleConfig, device: torch.device) -> list[Image.Image]:
    """One image per prompt; image i is drawn with seed `config.seed + i`, so any image can be re-made alone."""
    pipeline = assemble_pipeline(components, sampling_scheduler(config.scheduler, components))
    pipeline.set_progress_bar_config(disable=True)
    images = []
    for i, prompt in enumerate(config.prompts):
        generator = torch.Generator("cpu").manual_seed(config.seed + i)
        images += pipeline(
            prompt,
            negative_prompt=config.negative_prompt or None,
            num_inference_steps=config.steps,
            guidance_scale=config.guidance_scale,
            height=config.resolution,
            width=config.resolution,
            generator=generator,
        ).images
    return images


def save_images(images: list[Image.Image], config: SampleConfig, out_dir: Path) -> list[Path]:
    """Each image as a PNG with its prompt and settings in the text chunk, plus `grid.png`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (image, prompt) in enumerate(zip(images, config.prompts)):
        info = PngInfo()
        info.add_text("prompt", prompt)
        info.add_text(
            "parameters",
            f"negative_prompt={config.negative_prompt!r} steps={config.steps} guidance_scale={config.guidance_scale} "
            f"scheduler={config.scheduler} seed={config.seed + i} size={config.resolution}",
        )
        path = out_dir / f"{i:03d}.png"
        image.save(path, pnginfo=info)
        paths.append(path)
    make_grid(images).save(out_dir / "grid.png")
    return paths


def make_grid(images: list[Image.Image]) -> Image.Image:
    columns = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / columns)
    width, height = images[0].size
    grid = Image.new("RGB", (columns * width, rows * height), "white")
    for i, image in enumerate(images):
        grid.paste(image, ((i % columns) * width, (i // columns) * height))
    return grid
