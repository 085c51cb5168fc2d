"""Text-to-image sampling: one function that training (end-of-run samples) and later tools share."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from difftune.config import SampleConfig
from difftune.autoencoders import load_vae
from difftune.models import Components, eval_mode


def sampling_scheduler(name: str, components: Components):
    """The named sampler (`auto`: the family's default) over the model's own noise schedule."""
    return components.family.sampler(name).from_config(components.noise_scheduler.config)


@dataclass
class Sample:
    image: Image.Image
    prompt: str
    seed: int


@torch.no_grad()
def generate_images(components: Components, config: SampleConfig, device: torch.device) -> list[Sample]:
    """`images_per_prompt` images per prompt; image k (counting across prompts) uses seed `config.seed + k`,
    so any image can be re-made alone. No `resolution`: the model's native size."""
    decoder = load_vae(config.decoder).to(device, components.vae.dtype) if config.decoder else components.vae
    pipeline = replace(components, vae=decoder).pipeline(sampling_scheduler(config.scheduler, components))
    pipeline.set_progress_bar_config(disable=True)
    guidance = components.family.sampling_arguments(components, config.guidance_scale, config.negative_prompt)
    with eval_mode(components.denoiser, *components.text_encoders.values()):
        return _sample_all(pipeline, config, guidance)


def _sample_all(pipeline, config: SampleConfig, guidance: dict) -> list[Sample]:
    samples = []
    for prompt in config.prompts:
        for _ in range(config.images_per_prompt):
            seed = config.seed + len(samples)
            image = pipeline(
                prompt,
                num_inference_steps=config.steps,
                **guidance,
                height=config.resolution,
                width=config.resolution,
                generator=torch.Generator("cpu").manual_seed(seed),
            ).images[0]
            samples.append(Sample(image, prompt, seed))
    return samples


def save_images(samples: list[Sample], config: SampleConfig, out_dir: Path) -> list[Path]:
    """Each image as a PNG with its prompt and settings in the text chunk, plus `grid.png`."""
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
        path = out_dir / f"{i:03d}.png"
        sample.image.save(path, pnginfo=info)
        paths.append(path)
    make_grid([sample.image for sample in samples]).save(out_dir / "grid.png")
    return paths


def make_grid(images: list[Image.Image]) -> Image.Image:
    columns = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / columns)
    width, height = images[0].size
    grid = Image.new("RGB", (columns * width, rows * height), "white")
    for i, image in enumerate(images):
        grid.paste(image, ((i % columns) * width, (i // columns) * height))
    return grid
