"""Model families, and which one a base is.

`load_components` is how every command gets a model: it asks which family the base belongs to (from
`model.family`, a pipeline folder's `model_index.json`, or a single file's keys) and lets that family load it.

A family is a folder here, named as the family (`config.FAMILY_NAMES`, which `model.family` accepts), holding all of
it: `__init__.py` defines its `Family` subclass and registers it as `FAMILY`; `bases.json` the configs of the bases
it is published as (`published`, for `difftune plan` offline) and the one it is planned by; `micro.py` its micro model
and tiny base (toy tooling, which the library never imports). Beside them `common/` holds what families share:
`family` (the `Family` base), `flow` (the flow-matching families' base), `layouts` (file layouts), `objective` (the
noise, the timesteps and the per-sample loss), `drawing` (samples drawn through the family's pipeline),
`conditioning`, `loading`, `targets` and the pieces a few related families share.

May import: data, models, memory, the config schema and the leaf modules. Never an adapter or the training loop: they
ask the family.
"""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from difftune import published
from difftune.adapter_kinds import KINDS
from difftune.config import FAMILY_NAMES, ModelConfig, wrong_family
from difftune.errors import DifftuneError
from difftune.families.common.family import Family
from difftune.families.common.inpainting import InpaintDrawing
from difftune.families.common.layouts import file_key
from difftune.files import PIPELINE_INDEXES, pipeline_index
from difftune.models.autoencoders import latent_channels, load_vae
from difftune.models.components import (
    PICKLED_SUFFIXES,
    SINGLE_FILE_SUFFIXES,
    Components,
    explained_load_errors,
    quiet_loading,
)
from difftune.models.denoiser_files import gguf_tensor_names, is_gguf, is_scaled_fp8
from difftune.models.dtypes import FP32_PARTS, PartDtypes

# diffusers warns "Guiders are currently an experimental feature ..." at every guider made, and difftune makes them
# (the families' fixed guiders at import, one per sample drawn, any a base folder holds): a line on nearly every
# command that the user can do nothing about. Its other warnings stay.
logging.getLogger("diffusers.guiders.guider_utils").setLevel(logging.ERROR)


def _discover() -> dict[str, Family]:
    """Each family folder's registered `FAMILY`, by name."""
    families = {}
    for name in FAMILY_NAMES:
        family = importlib.import_module(f"{__name__}.{name}").FAMILY
        if not isinstance(family, Family) or family.name != name:
            raise RuntimeError(f"families/{name}/ registers {family!r} as FAMILY: a Family named as its folder")
        families[name] = family
    return families


FAMILIES: dict[str, Family] = _discover()
FAMILY_OPTIONS = {name: family.options_model for name, family in FAMILIES.items()}  # what model.family_options may set


def family_table_markdown(models_dir: Path, pages: str = "docs/families/") -> str:
    """The table of families in the README and the docs' families page, from the registry (what each trains and
    writes) and the bundled tiny bases' `scores.json` in `models_dir`, each family linked to its page in the folder
    `pages` names relative to where the table is (a test keeps both in sync)."""
    from difftune.config import Config

    rows = [
        "| `model.family` | pipelines | trains | text encoders adapted | kohya / ComfyUI prefixes | single file | "
        "edits | tiny base (its own scores) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, family in FAMILIES.items():
        kinds = [
            kind.label
            for kind_name, kind in KINDS.items()
            if not family.config_problems(Config(adapter={"kind": kind_name, "text_encoder": False}))
        ]
        encoders = ", ".join(f"`{e}`" for e in family.targets.adapted_text_encoders()) or "none"
        prefixes = ", ".join(f"`{prefix}`" for prefix in family.layout.kohya_prefixes.values())
        edits = {0: "no", 1: "1 control"}.get(family.max_controls, f"up to {family.max_controls} controls")
        edits = "an image into layers" if family.conditioning.trains_layers else edits
        edits = "an image's masked part" if isinstance(family.drawing, InpaintDrawing) else edits
        cell = _family_cell(name, family.page, models_dir.parent, pages)
        rows.append(
            f"| {cell} | {', '.join(f'`{c}`' for c in family.pipeline_classes)} | "
            f"{', '.join(kinds)} | "
            f"{encoders} | {prefixes} | {family.layout.single_file_layout or 'not read'} | {edits} | "
            f"{_tiny_base_scores(models_dir / f'tiny-{name}')} |"
        )
    return "\n".join(rows)


def _family_cell(name: str, page_name: str, repository: Path, pages: str) -> str:
    """The family's name, linked to its page for the real model (`docs/families/<page_name>.md`) where it has one."""
    linked = (repository / "docs" / "families" / f"{page_name}.md").is_file()
    return f"[`{name}`]({pages}{page_name}.md)" if linked else f"`{name}`"


def _tiny_base_scores(folder: Path) -> str:
    scores = folder / "scores.json"
    if not scores.is_file():
        return "none bundled"
    base = json.loads(scores.read_text(encoding="utf-8"))["base"]
    if "edits" in base["seen"]:
        return f"`{folder.name}`: seen edits right {base['seen']['all']:.2f}"
    if "fills" in base["seen"]:
        seen = base["seen"]
        return (
            f"`{folder.name}`: seen fills' color and shape {seen['both']:.2f}, inside the mask {seen['inside']:.2f}, "
            f"the rest kept {seen['kept']:.2f}"
        )
    if "pitch" in base["seen"]:  # a sound base's tones
        return (
            f"`{folder.name}`: heard pitch {base['seen']['pitch']:.2f}, timbre {base['seen']['timbre']:.2f}; "
            f"shrill before {base['concept']['pitch']:.2f}"
        )
    direction = f", direction {base['seen']['direction']:.2f}" if "direction" in base["seen"] else ""  # a video base's
    return (
        f"`{folder.name}`: seen color {base['seen']['color']:.2f}, shape {base['seen']['shape']:.2f}{direction}; "
        f"purple before {base['concept']['both']:.2f}"
    )


def load_components(config: ModelConfig, dtypes: PartDtypes = FP32_PARTS) -> Components:
    """Everything training needs from `config.base` (and `config.vae`) on the CPU, each part in its `dtypes` (fp32
    unless told: merging, converting and sampling tools work in fp32); the denoiser left out where `dtypes` says."""
    base = config.base
    if base.endswith(PICKLED_SUFFIXES) and not config.allow_pickled_checkpoint:
        raise DifftuneError(
            f"model.base {base}: a pickle-based checkpoint is not read by default (pickles can run code); convert it "
            f"to .safetensors or a diffusers folder, or set model.allow_pickled_checkpoint = true (read tensors-only)"
        )
    with explained_load_errors("model.base", base), quiet_loading():
        components = family_of(config).loading.load(config, dtypes)
    if config.vae:
        with explained_load_errors("model.vae", config.vae):
            components.vae = load_vae(config.vae).to(dtypes.vae)
    components.latent_normalization = components.family.conditioning.latent_normalization(components.vae)
    # Left out, the denoiser's shape is read from its config.
    denoiser = (
        components.denoiser if components.denoiser is not None else components.family.loading.empty_denoiser(config)
    )
    makes, takes = latent_channels(components.vae), components.family.latent_channels(denoiser)
    if makes != takes:
        raise DifftuneError(
            f"model.vae {config.vae or config.base}: makes {makes}-channel latents but the "
            f"{components.family.denoiser_name} takes {takes}; use an autoencoder made for this base"
        )
    return components


def load_denoiser(components: Components, config: ModelConfig, dtypes: PartDtypes) -> None:
    """The denoiser of a base whose other parts `components` holds (loaded without it, `dtypes.denoiser` None then):
    a pipeline folder's or hub id's part alone, in `dtypes.denoiser`."""
    with explained_load_errors("model.base", config.base), quiet_loading():
        components.denoiser = components.family.loading.load_denoiser(config, dtypes)


def family_of(config: ModelConfig) -> Family:
    """`model.family`, or the family `model.base` shows. A family set by hand may name one for a base that no family
    reads (a custom pipeline class), never one that another family reads: that base would half-load and fail later
    (an SD base as `sdxl`). A hub id is not fetched to check it."""
    base = config.base
    if config.family != "auto":
        family = FAMILIES[config.family]
        readers, what = _readers(config, by_folder=False) if Path(base).exists() else ([], "")
        if readers and family not in readers:
            raise wrong_family(family.name, base, what, readers[0].name)
        return family
    readers, what = _readers(config)
    if not readers:
        if base.endswith(SINGLE_FILE_SUFFIXES):
            what += f" whose keys match no known family ({', '.join(FAMILIES)})"
        raise DifftuneError(
            f"model.base {base}: is {what}; difftune trains {', '.join(f.description for f in FAMILIES.values())}. "
            f"Set model.family if this model is one of them"
        )
    return readers[0]


def _readers(config: ModelConfig, by_folder: bool = True) -> tuple[list[Family], str]:
    """The families that read `model.base` (by a single file's keys, or a pipeline's class), and what the base is.
    Where several read a single file's keys, `by_folder` keeps those of `model.single_file_config`'s pipeline class:
    what `auto` takes; a family named by hand may be any of them (SkyReels' image-to-video transformer, whose keys
    are HunyuanVideo's, read with a HunyuanVideo folder)."""
    base = config.base
    if base.endswith(SINGLE_FILE_SUFFIXES):
        keys = _single_file_keys(base)
        readers = [family for family in FAMILIES.values() if family.layout.reads_single_file(keys)]
        if is_gguf(base) and not all(family.loading.reads_denoiser_files for family in readers):
            raise DifftuneError(
                f"model.base {base}: a GGUF file of a family whose single files hold the whole pipeline "
                f"({', '.join(family.description for family in readers)}); GGUF bases are read for families whose "
                "files hold the denoiser alone. Pass its .safetensors checkpoint"
            )
        if is_scaled_fp8(keys) and not all(family.loading.reads_denoiser_files for family in readers):
            raise DifftuneError(
                f"model.base {base}: a ComfyUI scaled fp8 file (`scaled_fp8`, `.scale_weight` keys) of a family whose "
                "single files diffusers reads whole, and diffusers' reader would not apply its per-tensor scales. Pass "
                'the bf16/fp16 file, and set model.weight_dtype = "fp8" to keep the weights in fp8 while training'
            )
        if (
            len(readers) > 1 and config.single_file_config and by_folder
        ):  # one transformer's keys, several pipelines (Qwen-Image's edits)
            class_name = _pipeline_class_name(config.model_copy(update={"base": config.single_file_config}))
            readers = [family for family in readers if class_name in family.pipeline_classes] or readers
        if len(readers) > 1 and (inputs := _file_inputs(base, keys, readers[0].layout.input_file_key)):
            readers = [family for family in readers if inputs in (family.file_inputs or (inputs,))] or readers
        return readers, "a single file"
    if published.is_published(base) and not Path(base).exists():  # known without asking the hub (offline too)
        class_name = published.model_index(base)["_class_name"]
    else:
        with explained_load_errors("model.base", base):
            class_name = _pipeline_class_name(config)
    return [family for family in FAMILIES.values() if class_name in family.pipeline_classes], f"a {class_name}"


def _file_inputs(path: str, keys: set[str], input_key: str | None) -> int | None:
    """The inputs of a single file's denoiser input layer (`Layout.input_file_key`), None where it has none to read (a
    GGUF file: the families that read one file's keys alike take it)."""
    found = file_key(keys, input_key) if input_key else None
    if found is None or is_gguf(path):
        return None
    with safe_open(path, framework="pt") as handle:
        return handle.get_slice(found).get_shape()[1]


def _pipeline_class_name(config: ModelConfig) -> str:
    index = pipeline_index(Path(config.base))
    if index is not None:
        return index.get("_class_name", "?")
    if Path(config.base).exists():
        raise DifftuneError(
            f"model.base {config.base}: has no model_index.json (nor a modular pipeline's {PIPELINE_INDEXES[1]}); "
            "pass a diffusers pipeline folder"
        )
    from diffusers import DiffusionPipeline, ModularPipeline

    revision = config.revision or None
    try:
        return DiffusionPipeline.load_config(config.base, revision=revision).get("_class_name", "?")
    except OSError:  # a modular pipeline's repository
        return ModularPipeline.load_config(config.base, revision=revision).get("_class_name", "?")


def _single_file_keys(path: str) -> set[str]:
    if not Path(path).is_file():
        raise DifftuneError(f"model.base {path}: no such file")
    try:
        if is_gguf(path):
            return gguf_tensor_names(path)
        if path.endswith(".safetensors"):
            with safe_open(path, framework="pt") as handle:
                return set(handle.keys())
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same explanation
        raise DifftuneError(f"model.base {path}: not a readable checkpoint ({type(err).__name__}: {err})") from None
    return set(state.get("state_dict", state))
