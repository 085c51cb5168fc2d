"""Caches of VAE posteriors and text-encoder states, in a folder or on object storage (cache_folders.py): encode once,
reuse across runs, processes and machines.

An entry's file name is the SHA-256 of everything its content depends on, and of `FORMAT` (bumped when what
an entry holds changes):
- latents: the image file's bytes, the VAE's weights and config, the training size, the crop, the color
  transparent pixels are composited onto (`data.alpha_background`; or that their alpha is kept, `data.keep_alpha`)
  and the view (as is, or mirrored); for a clip, also its window of frames (first frame and count), so another
  `data.target_frames` or extraction is another entry;
- text: the token ids each text encoder reads (so the tokenizers and their max lengths are covered too), and
  where the text encoder sees an edit pair's controls (Qwen-Image-Edit), their patches; the text encoders'
  weights and configs; an entry holds the family's whole text conditioning (SDXL: both encoders' states and the
  pooled embedding).
A changed image, another VAE or another setting therefore misses and is encoded again, and an entry made
under other settings can never be read. Each entry is one
safetensors file, written under a temporary name and renamed into place (an object is put whole), so processes
sharing a cache never see half an entry (two writing the same entry write the same bytes). Files are spread over 256
subfolders by the first two hex digits of their name.

An edit pair's control images are entries of the same kind, at the control's training size (an image trained as
a target and as a control at one size shares its entries).

A latent entry holds the posterior's `mean` and `std` of one view of an image, not one sample: the training
step samples it with the sample's own generator, exactly as an uncached run does, so caching changes the
speed and nothing else. The mirrored view is an entry of its own: turning `data.random_flip` on later
encodes the mirrored views alone, and turning it off reads the plain ones already there.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from PIL import Image
from tqdm.auto import tqdm

from difftune.config import Config, DataConfig
from difftune.data.cache_folders import existing, folder, write_tensors
from difftune.data.clips import read_frames
from difftune.data.dataset import (
    Example,
    Prompt,
    Size,
    clip_to_tensor,
    image_to_tensor,
    mask_file,
    open_image,
    place_crop,
    prompt_controls,
    resize_and_crop,
)
from difftune.data.sound_files import read_window
from difftune.data.sources import Stored, is_sound
from difftune.models.autoencoders import encode_posterior
from difftune.models.components import Components


def cache_root(config: Config) -> Path:
    """The cache folder: local, or on object storage (cache_folders.py)."""
    if config.cache.dir:
        return folder(config.cache.dir)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "difftune"


def model_identity(module: torch.nn.Module) -> str:
    """SHA-256 of a model's config and every weight: what its outputs depend on. Each weight is hashed where it lies,
    not copied to bytes first (umT5's 2 GiB embedding was, at the caching phase's peak)."""
    config = module.config.to_dict() if hasattr(module.config, "to_dict") else dict(module.config)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # 0-d too
    return digest.hexdigest()


FORMAT = "3"  # 1: one latent entry per image, with `mean_flip`/`std_flip` inside when flips were on; 2: text
# entries held `states` alone
VIEWS = ("plain", "flipped")


def _entry(root: Path, kind: str, *parts: str | bytes) -> Path:
    digest = hashlib.sha256(FORMAT.encode() + b"\0")
    for part in parts:
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"\0")
    name = digest.hexdigest()
    return root / kind / name[:2] / f"{name}.safetensors"


def latent_entries(
    examples: list[Example], sizes: list[Size], vae_identity: str, config: Config, masks_kept: bool = False
) -> list[dict[str, Path]]:
    """Each example's cache files, one per view it can be trained in (`plain`, and `flipped` with its dataset's
    `random_flip`); repeats of an image share them. Keyed by its training size (`data.training_sizes`) and, where
    the entries hold what the family made of the views' masks (`masks_kept`), by its mask."""
    views, flips = _views(config, vae_identity), _flips(config)
    datasets = config.data.each_dataset()
    return [
        views(
            example.path,
            size,
            flips[example.dataset],
            example.frames,
            datasets[example.dataset] if masks_kept else None,
        )
        for example, size in zip(examples, sizes, strict=True)
    ]


def control_latent_entries(
    examples: list[Example], control_sizes: list[tuple[Size, ...]], vae_identity: str, config: Config
) -> list[list[dict[str, Path]]]:
    """Each example's controls' cache files (as `latent_entries`), at their training sizes (`data.control_sizes`)."""
    views, flips = _views(config, vae_identity), _flips(config)
    return [
        [views(path, size, flips[example.dataset]) for path, size in zip(example.control_paths, sizes, strict=True)]
        for example, sizes in zip(examples, control_sizes, strict=True)
    ]


def _flips(config: Config) -> list[bool]:
    """Whether each dataset's images are flipped at random (and cached in both views)."""
    return [data.random_flip for data in config.data.each_dataset()]


def _views(config: Config, vae_identity: str) -> Callable[..., dict[str, Path]]:
    """(image or clip file, training size, whether it is flipped at random[, a clip's window]) -> its entry per view;
    each file's bytes are hashed once. Cached images are center-cropped in every dataset (config.py), so a view's
    key holds no dataset's settings: an image two datasets read at one size is one entry."""
    root, data = cache_root(config), config.data
    alpha = "kept" if data.keep_alpha else ",".join(map(str, data.alpha_background))
    settings = f"crop=center alpha_background={alpha}"
    contents: dict[Path, str] = {}

    def entries(
        path: Path,
        size: Size,
        flips: bool,
        window: tuple[int, int] | None = None,
        masks: DataConfig | None = None,
    ) -> dict[str, Path]:
        if path not in contents:  # a stored record was hashed as its source was read
            contents[path] = _digest(path)
        width, height = size
        where = (f"frames={window[0]}+{window[1]}",) if window else ()  # images' keys as before clips were read
        if masks is not None and masks.masks != "off" and window is None:  # the mask: the image's alpha, or its file
            source = mask_file(path, masks) if masks.masks != "alpha" else None
            where += (f"masks={masks.masks}", _digest(source) if source else "")
        return {
            view: _entry(root, "latents", contents[path], vae_identity, f"{width}x{height}", settings, *where, view)
            for view in (VIEWS if flips else VIEWS[:1])
        }

    return entries


def _digest(path: Path | Stored) -> str:
    """A file's digest: a stored record's, hashed as its source was read, or its bytes'."""
    return path.digest if isinstance(path, Stored) else _file_digest(path)


def _file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, read in pieces (a clip can be larger than memory is spare)."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while piece := file.read(1 << 24):
            digest.update(piece)
    return digest.hexdigest()


def fill_latents(
    paths: list[Path],
    sizes: list[Size],
    entries: list[dict[str, Path]],
    vae,
    config: Config,
    batch_size: int,
    windows: list[tuple[int, int] | None] | None = None,
    from_pixels: Callable[[torch.Tensor], dict[str, torch.Tensor]] | None = None,
    from_sound: Callable[[list[tuple[Path, tuple[int, int] | None]]], dict[str, torch.Tensor]] | None = None,
    frame_rates: list[float] | None = None,
    masks_of: Callable[[Path, Size, bool], torch.Tensor] | None = None,
) -> int:
    """Encode the views whose entries are missing (image `paths[i]` at `sizes[i]`, or a clip's window `windows[i]` of
    it, its views' files `entries[i]`), in batches of one training size, frame count and (given `frame_rates`) frame
    rate; returns how many. An entry holds the posterior's `mean` and `std`, what `from_pixels` (the family's
    `pixel_conditioning`) makes of the same pixels, and what `from_sound` (an audio-video family's
    `sound_conditioning`) makes of the clips' sound under the same windows (a flipped view's sound is the plain
    one's; windows of one length hold as much sound at one rate only). `masks_of` (image, size, flipped) -> the
    view's mask (1, H, W), for a family whose `pixel_conditioning` reads them (an image without one: all ones)."""
    windows = windows or [None] * len(paths)
    frame_rates = frame_rates or [0.0] * len(paths)
    missing: dict[tuple, dict[Path, tuple[Path, tuple[int, int] | None, str]]] = {}
    present = existing([entry for views in entries for entry in views.values()])
    for path, views, size, window, rate in zip(paths, entries, sizes, windows, frame_rates, strict=True):
        for view, entry in views.items():
            if entry not in present:
                missing.setdefault((size, window[1] if window else 0, rate), {})[entry] = (path, window, view)
    chunks = [
        (size, list(group.items())[start : start + batch_size])
        for (size, _, _), group in sorted(missing.items())
        for start in range(0, len(group), batch_size)
    ]
    for size, chunk in tqdm(chunks, desc="caching latents", disable=not chunks or config.log.quiet):
        pixels = []
        for _, (path, window, view) in chunk:
            if window and is_sound(path):  # at the autoencoder's rate, as the scan counted its window
                pixels.append(read_window(path, window, vae.config.sampling_rate))
                continue
            if window:
                frames = read_frames(path, *window)
                pixels.append(
                    clip_to_tensor(frames, place_crop(frames[0].size, size, "center"), size, view == "flipped")
                )
                continue
            image = resize_and_crop(open_image(path, config.data), size, "center")  # cached images' crop
            pixels.append(
                image_to_tensor(
                    image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if view == "flipped" else image,
                    config.data.keep_alpha,
                )
            )
        batch = torch.stack(pixels)
        masks = {}
        if masks_of:
            masks["masks"] = torch.stack([masks_of(path, size, view == "flipped") for _, (path, _, view) in chunk])
        with torch.no_grad():
            mean, std = encode_posterior(vae, batch)
            extra = from_pixels(batch, **masks) if from_pixels else {}
            if from_sound:
                extra |= from_sound([(path, window) for _, (path, window, _) in chunk])
        for i, (entry, _) in enumerate(chunk):
            write_tensors(entry, {"mean": mean[i], "std": std[i]} | {name: value[i] for name, value in extra.items()})
    return sum(len(group) for group in missing.values())


def text_identity(components: Components) -> str:
    """What every text entry of these encoders depends on: each encoder's weights and config, and what of their
    outputs the run keeps (the family's `text_kept`)."""
    identity = "+".join(model_identity(encoder) for encoder in components.text_encoders.values())
    return identity + components.family.conditioning.text_kept(components)


def text_entries(
    prompts: set[Prompt], identity: str, config: Config, tokenize: Callable[..., dict[str, torch.Tensor]]
) -> dict[Prompt, Path]:
    """Each prompt's cache file, keyed by what its encoders read (`tokenize`: the family's, over the base's
    tokenizers): its token ids, whatever the tokenizers, and where the text encoder sees an edit pair's controls,
    their patches as it sees them (so a changed control file, size or view is another entry)."""
    root = cache_root(config)
    entries = {}
    for prompt in sorted(prompts):
        inputs = _tokenized([prompt], tokenize, config)
        entries[prompt] = _entry(root, "text", *(value[0].numpy().tobytes() for value in inputs.values()), identity)
    return entries


def _tokenized(prompts: list[Prompt], tokenize: Callable[..., dict[str, torch.Tensor]], config: Config) -> dict:
    captions = [prompt.caption for prompt in prompts]
    if not prompts[0].controls:
        return tokenize(captions)
    return tokenize(captions, [prompt_controls(prompt, config.data) for prompt in prompts])


def fill_text(entries: dict[Prompt, Path], components: Components, device: torch.device, config: Config) -> int:
    """Encode the prompts whose entries are missing (the text encoders on `device`), in batches of prompts whose
    controls share their sizes; returns how many."""
    family = components.family
    tokenize = family.conditioning.tokenizer(components)
    present = existing(list(entries.values()))
    todo = sorted((prompt, path) for prompt, path in entries.items() if path not in present)
    by_sizes: dict[tuple, list] = {}
    for prompt, path in todo:
        by_sizes.setdefault(tuple(size for _, size in prompt.controls), []).append((prompt, path))
    batch_size = config.train.batch_size
    chunks = [
        group[start : start + batch_size] for group in by_sizes.values() for start in range(0, len(group), batch_size)
    ]
    for chunk in tqdm(chunks, desc="caching captions", disable=not chunks or config.log.quiet):
        inputs = _tokenized([prompt for prompt, _ in chunk], tokenize, config)
        with torch.no_grad():
            conditioning = family.conditioning.encode_prompts(
                components, {name: value.to(device) for name, value in inputs.items()}
            )
        for i, (_, path) in enumerate(chunk):
            write_tensors(
                path, family.conditioning.cached_conditioning({name: value[i] for name, value in conditioning.items()})
            )
    return len(todo)
