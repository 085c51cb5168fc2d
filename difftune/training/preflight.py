"""What can be said against a run before the seconds of heavy imports (torch, diffusers: 5 s idle, 30 s on a
loaded machine) and the minutes of loading: the paths it reads and writes, a base that another family reads,
adapter targets that name no layer, a batch larger than the machine, a precision its device lacks.

Only light modules are imported here. A base's structure is read from what lies on disk without torch: a
pipeline's `model_index.json` (which family reads it, from the published bases' pipeline classes) and its parts'
safetensors headers (the names of the layers adapters may target). What needs the loaded model is checked again
where the model is loaded (`families.family_of`, `adapters.check_targets`), with the same words.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from difftune import published
from difftune.adapters.targets import layer_suffixes, missing_targets, unmatched_targets
from difftune.config import HUB_ID, Config, wrong_family
from difftune.data.sources import FolderOfFiles, data_source
from difftune.errors import DifftuneError, require_extra
from difftune.files import hub_unavailable, part_weight_files, pipeline_index, unreachable_base


def check_before_start(config: Config) -> None:
    """Every refusal that needs no weights, in about a second (what `difftune train` checks first; train() again)."""
    _check_paths(config)
    _check_batch_within_data(config)  # the likelier mistake: said first
    _check_batch_fits(config)
    _check_precision_device(config)
    _check_family_reads_base(config)
    _check_targets_on_disk(config)
    _check_trackers(config)


def _check_paths(config: Config) -> None:
    """The folders a run reads must be folders, and those it writes into must not be files."""
    base = config.model.base
    if not Path(base).exists() and not HUB_ID.fullmatch(base):
        raise DifftuneError(
            f"model.base {base}: no such folder or file here, and not a hub id (owner/name); point it at "
            "a diffusers folder, a .safetensors file, or a Hugging Face hub id"
        )
    if not Path(base).exists() and (unavailable := hub_unavailable(base)):  # before the memory plan's own failure
        raise DifftuneError(unreachable_base("model.base", base, unavailable))
    folders = [("validation.path", config.validation.path, "captioned images", data_source)]
    datasets = zip(config.data.each_dataset(), config.data.dataset_keys(), strict=True)
    for data, key in [] if config.reward.enabled else datasets:  # a reward run reads prompts alone
        setting = key.removesuffix(".path")  # `data`, or `data.datasets[1]`
        folders += [
            (key, data.path, "captioned images", data_source),
            (f"{setting}.mask_path", data.mask_path if data.masks == "folder" else "", "mask images", FolderOfFiles),
            (f"{setting}.control_path", data.control_path, "control images", FolderOfFiles),
        ]
    for key, folder, holding, source in folders:
        if folder:  # the training and validation data may be stored records; masks and controls are files
            source(folder).check_present(key, holding)
    for key, folder, holding, source in folders:
        located = source(folder) if folder and holding == "captioned images" else None
        if isinstance(located, FolderOfFiles):  # an empty folder named before the base loads, not after it
            located.check_holds_media(key)
    for entry in config.sample.prompts:
        missing = [control for control in getattr(entry, "controls", []) if not Path(control).is_file()]
        if missing:
            raise DifftuneError(f"sample.prompts: control image {missing[0]} of {entry.prompt!r} does not exist")
    for key, folder in {"train.output_dir": config.train.output_dir, "cache.dir": config.cache.dir}.items():
        blocking = next(
            (path for path in (Path(folder), *Path(folder).parents) if path.exists() and not path.is_dir()), None
        )
        if blocking:
            raise DifftuneError(f"{key} {folder}: {blocking} is a file, not a folder; choose a folder")


def _check_batch_fits(config: Config) -> None:
    """Refuse a batch whose images alone (fp32 RGB at the training size) outgrow this machine's memory: it would
    grow until killed (a batch size of 1e9 took 6 GB and counting), never training."""
    import psutil

    side = max(data.bucket_max_side if data.buckets else data.resolution for data in config.data.each_dataset())
    batch_bytes = config.train.batch_size * 3 * side * side * 4
    total = psutil.virtual_memory().total
    if batch_bytes > total:
        raise DifftuneError(
            f"train.batch_size {config.train.batch_size}: one batch of images at {side} px is "
            f"{batch_bytes / 2**30:,.0f} GiB, "
            f"more than this machine's {total / 2**30:,.0f} GiB of memory; `difftune find-batch` finds one that fits"
        )


def _check_batch_within_data(config: Config) -> None:
    """A batch larger than the data could ever hold, refused from the folders' file names in milliseconds (a batch of
    600,000 over 16 images tokenised 600,000 prompts in the memory check first, silently); the run refuses it again
    once the data is read, counting what is usable and the processes. Not said where the names cannot tell (clips,
    records, metadata.jsonl, class images to come), nor for a reward run (its batch is of prompts)."""
    if config.prior.enabled or config.reward.enabled:
        return
    total = 0
    for data in config.data.each_dataset():
        source = data_source(data.path)
        most = source.most_examples() if isinstance(source, FolderOfFiles) else None
        if most is None:
            return
        total += most * data.repeats
    if config.train.batch_size > total:
        paths = ", ".join(dict.fromkeys(data.path for data in config.data.each_dataset()))
        raise DifftuneError(
            f"train.batch_size {config.train.batch_size}: a batch of {config.train.batch_size} is more than the data "
            f"holds (at most {total} images in {paths}); use at most {total}, or repeat the data (data.repeats, or "
            "N_name folders)"
        )


def _check_precision_device(config: Config) -> None:
    """fp16 autocast needs CUDA; FP8 matmuls need tensor cores that have them (Ada, Hopper and newer: compute
    capability 8.9+) and torchao. Asking the device imports torch (a second), never diffusers."""
    precision = config.train.mixed_precision
    if precision not in ("fp16", "fp8"):
        return
    import torch

    if precision == "fp16" and not torch.cuda.is_available():
        raise DifftuneError('train.mixed_precision = "fp16" needs a CUDA device; use "bf16" or "no" here')
    if precision == "fp8":
        capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        if capability is None or capability < (8, 9):
            where = (
                f"this GPU has compute capability {capability[0]}.{capability[1]}"
                if capability
                else "this run has no CUDA device"
            )
            raise DifftuneError(
                'train.mixed_precision = "fp8" needs a GPU with FP8 tensor cores (compute '
                f'capability 8.9 or newer: L4, L40S, RTX 40xx, H100); {where}. Use "bf16"'
            )
        require_extra("torchao", "torchao", 'train.mixed_precision = "fp8"', 'use "bf16"')


def _check_family_reads_base(config: Config) -> None:
    """A pipeline folder whose class is a published base's of another family than `model.family` names."""
    if config.model.family == "auto" or (index := pipeline_index(Path(config.model.base))) is None:
        return
    class_name = index.get("_class_name")
    readers = {
        published.model_index(base)["_class_name"]: family
        for family, base in published.reference_bases().items()
        if published.is_published(base)
    }
    reader = readers.get(class_name)
    if reader and reader != config.model.family:
        raise wrong_family(config.model.family, config.model.base, f"a {class_name}", reader)


def _check_targets_on_disk(config: Config) -> None:
    """Configured adapter targets that name no layer of their part, read from a local pipeline folder's
    safetensors headers (a hub id or single file is checked once loaded)."""
    base = Path(config.model.base)
    if not config.adapter.is_adapter or (parts := pipeline_index(base)) is None:
        return
    denoiser = "transformer" if "transformer" in parts else "unet"
    for part, targets, key in [
        (denoiser, config.adapter.target_modules, "adapter.target_modules"),
        *[
            (part, targets, f"adapter.text_encoder_targets.{part}")
            for part, targets in config.adapter.text_encoder_targets.items()
        ],
    ]:
        layers = _stored_layers(base / part, config.model.variant)
        if targets and layers:
            _check_targets_name_layers(key, part, targets, layers)


def _stored_layers(folder: Path, variant: str) -> dict[str, int]:
    """Each parameter-holding module of a part folder by name, with its weight's number of dimensions, from its
    safetensors headers; empty where the folder holds none (a hub cache, pickles)."""
    from safetensors import safe_open

    layers: dict[str, int] = {}
    for file in part_weight_files(folder, variant):
        with safe_open(file, "np") as weights:
            for key in weights.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                name, _, kind = key.rpartition(".")
                dims = len(weights.get_slice(key).get_shape()) if kind == "weight" else 0
                layers[name] = max(layers.get(name, 0), dims)
    return layers


def _check_targets_name_layers(key: str, part: str, targets: list[str], layers: dict[str, int]) -> None:
    names = {".".join(name.split(".")[:end]) for name in layers for end in range(1, name.count(".") + 2)}
    missing = missing_targets(targets, names)
    if missing:
        raise unmatched_targets(key, part, missing, layer_suffixes(name for name, dims in layers.items() if dims >= 2))


def _check_trackers(config: Config) -> None:
    """A tracker asked for is installed."""
    if config.log.wandb and importlib.util.find_spec("wandb") is None:
        raise DifftuneError(
            "log.wandb: the wandb package is not installed; pip install wandb (or set log.wandb = false)"
        )
