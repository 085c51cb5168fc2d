"""DreamBooth prior preservation: class images trained beside the instance images, so the adapter learns the
instance without forgetting what its class looks like (Ruiz et al. 2023).

Class images come from `prior.class_path`; when it holds fewer than `prior.num_class_images`, the base model draws
the rest from `prior.class_prompt` before training, as diffusers' DreamBooth script does. Each drawn image is written
under a name that says its index, as it is finished (atomically, with its caption), from a seed that is a function
of the index: an interrupted fill resumes where it stopped and gives the same images as one that was not. Without
a `class_path` they are kept in the cache folder, keyed by the base's weights and the drawing settings, and reused
by later runs.

Mixing is kohya's: the class images join the data with the loss weight `prior.loss_weight`, cycled or cut to as many
per epoch as there are instance images, so caches, buckets and the data order treat them as any other image.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from difftune.config import Config
from difftune.data.cache import cache_root, model_identity
from difftune.data.cache_folders import is_remote
from difftune.data.dataset import IMAGE_EXTENSIONS, Example, derive_seed, scan_examples
from difftune.errors import DifftuneError
from difftune.families.common.drawing import sampling_scheduler
from difftune.models.components import Components, eval_mode

PRIOR_STREAM = 4  # dataset.py's seed streams are 0, 1 and 3; validation.py's is 2
DRAWN_PREFIX = "class_"


def class_folder(config: Config, components: Components) -> Path:
    """Where the class images are: `prior.class_path`, or a cache folder for these drawing settings and this base."""
    if config.prior.class_path:
        return Path(config.prior.class_path)
    settings = {
        "prompt": config.prior.class_prompt,
        "negative": config.prior.negative_prompt,
        "steps": config.prior.steps,
        "guidance": config.prior.guidance_scale,
        "resolution": config.data.resolution,
        "seed": config.prior.seed,
        "scheduler": config.sample.scheduler,
    }
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    digest.update(model_identity(components.denoiser).encode())
    if is_remote(cache_root(config)):
        raise DifftuneError(
            f"prior preservation draws its class images into cache.dir, and {config.cache.dir} is on object "
            f"storage; set prior.class_path to a local folder for them"
        )
    return cache_root(config) / "class_images" / digest.hexdigest()[:32]


def fill_class_images(config: Config, components: Components, device: torch.device, folder: Path) -> int:
    """Draw the class images `folder` (`class_folder`'s) lacks, up to `num_class_images`, with the untouched base;
    returns how many."""
    prior = config.prior
    folder.mkdir(parents=True, exist_ok=True)
    have = [p for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS]
    drawn = {p.stem for p in have if p.stem.startswith(DRAWN_PREFIX)}
    todo = [i for i in range(prior.num_class_images) if f"{DRAWN_PREFIX}{i:05d}" not in drawn]
    todo = todo[: max(0, prior.num_class_images - len(have))]
    if not todo:
        return 0
    for module in components.modules():
        module.to(device)
    pipeline = components.pipeline(sampling_scheduler(config.sample.scheduler, components))
    pipeline.set_progress_bar_config(disable=True)
    guidance = components.family.drawing.sampling_arguments(components, prior.guidance_scale, prior.negative_prompt)
    chunks = [todo[start : start + prior.batch_size] for start in range(0, len(todo), prior.batch_size)]
    with eval_mode(components.denoiser, *components.text_encoders.values()), torch.no_grad():
        for chunk in tqdm(chunks, desc="drawing class images"):
            images = components.family.drawing.draw(
                pipeline,
                components.family_options,
                [prior.class_prompt] * len(chunk),
                [],
                config.data.resolution,
                config.data.resolution,
                num_inference_steps=prior.steps,
                **guidance,
                generator=[torch.Generator("cpu").manual_seed(derive_seed(PRIOR_STREAM, prior.seed, i)) for i in chunk],
            )
            for index, image in zip(chunk, images, strict=True):
                _write_class_image(
                    folder / f"{DRAWN_PREFIX}{index:05d}", image, prior.class_prompt, config.data.caption_extension
                )
    return len(todo)


def _write_class_image(stem: Path, image, caption: str, caption_extension: str) -> None:
    """The caption first, then the image renamed into place: a folder never shows an image without its caption."""
    stem.with_suffix(caption_extension).write_text(caption, encoding="utf-8")
    handle, staging = tempfile.mkstemp(dir=stem.parent, suffix=".png.tmp")
    os.close(handle)
    image.save(staging, format="PNG")
    os.replace(staging, stem.with_suffix(".png"))


def class_examples(config: Config, folder: Path, instances: int) -> tuple[list[Example], list]:
    """The class images in `folder` as examples with the prior's loss weight, cycled or cut to `instances` per epoch;
    an image without a caption file is captioned with `class_prompt`. Also the files left out, with their reasons."""
    missing = "empty" if config.prior.class_prompt else "error"  # uncaptioned images take the class prompt
    data = config.data.model_copy(update={"path": str(folder), "missing_caption": missing, "masks": "off"})
    found, bad = scan_examples(data)
    if not found:
        raise DifftuneError(
            f"prior preservation: {folder} holds no class images; set prior.num_class_images to draw some"
        )
    found = [
        replace(e, caption=e.caption or config.prior.class_prompt, loss_weight=config.prior.loss_weight) for e in found
    ]
    return [found[i % len(found)] for i in range(instances)], bad
