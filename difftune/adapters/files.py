"""Reading LoRA / DoRA files from any tool into one form: difftune's diffusers layout and a peft config per part.

What people share, and how each is read:
- difftune's own files, and diffusers' with peft's `LoraConfig` in the `lora_adapter_metadata` metadata
  (`save_lora_weights(..., unet_lora_adapter_metadata=...)`): keys `unet.<module>.lora_A.weight`, ...;
  rank, alpha and DoRA are read from the metadata.
- diffusers' files without that metadata, as its example training scripts write them
  (`convert_state_dict_to_diffusers`: `unet.<module>.lora.down.weight`, text encoder
  `...lora_linear_layer.down.weight`, older `to_q_lora.down` processor keys), and files saved from a lone
  model (`unet.save_lora_adapter`, peft's `base_model.model.` prefix, ai-toolkit's and ComfyUI's
  `diffusion_model.` one), which are the denoiser's: keys go through diffusers' own converters to peft's names.
- kohya sd-scripts / A1111 / ComfyUI files (`lora_unet_*`, `lora_te_*` / `lora_te1_*` / `lora_te2_*`,
  `.alpha`, `.dora_scale`, and LyCORIS's LoHa/LoKr tensors): kohya.py, with the base model's module names and its
  family's prefixes.
- LoHa/LoKr files in peft's layout with their configs in the metadata, as difftune writes them.
- A family's original-layout files that only diffusers' reader for it converts (Ideogram 4's fused `qkv`, as
  ai-toolkit writes it): the family recognises them by their keys (`Family.read_original_layout`).
Without metadata, the rank of each module is its `lora_A`'s row count (the most common one is `r`, the rest
go to `rank_pattern`) and alpha is the file's `.alpha` where it has one, else the rank (diffusers' own rule).
A key that fits none of these stops the read, naming the key.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
from diffusers.utils.state_dict_utils import convert_state_dict_to_peft, convert_unet_state_dict_to_peft

from difftune.adapters.embeddings import is_token_keyed
from difftune.adapters.kohya import SIMPLETUNER_PREFIX, family_from_kohya, split_adapter_key
from difftune.adapters.trained import DORA_MAGNITUDE, LYCORIS_TENSORS, derived_lora_configs
from difftune.errors import DifftuneError
from difftune.families import FAMILIES
from difftune.families.common.family import Family
from difftune.files import open_safetensors

CONFIG_METADATA_KEY = "difftune_config"
KOHYA_PREFIXES = (
    *{prefix for family in FAMILIES.values() for prefix in family.layout.kohya_prefixes.values()},
    SIMPLETUNER_PREFIX,
)
KNOWN_PARTS = {part for family in FAMILIES.values() for part in family.targets.parts()}  # diffusers-layout key prefixes
# Keys of textual-inversion files, as each family writes them (A1111 / ComfyUI layouts).
EMBEDDING_KEYS = {key for family in FAMILIES.values() for key in family.layout.embedding_keys}
# Prefixes of a file saved from one model rather than a pipeline (peft's; ComfyUI's and ai-toolkit's name the
# denoiser `diffusion_model.`): its keys are the denoiser's.
LONE_MODEL_PREFIXES = ("base_model.model.", "diffusion_model.")
UNET_MODULE = re.compile(
    r"(down_blocks|up_blocks|mid_block|conv_in|conv_out|conv_norm_out|time_embedding|add_embedding)\."
)


@dataclass
class BaseModules:
    """What reading a kohya file needs from the base it was made for."""

    names: dict[str, list[str]]  # part -> dotted names of its adaptable modules
    family: Family  # its kohya layout


# The file's metadata -> the base's modules (the metadata may name the base).
FindBaseModules = Callable[[dict[str, str]], BaseModules]


def is_embedding(keys) -> bool:
    """A textual-inversion file's keys: every one is an embedding key some family writes (A1111 / ComfyUI), or the one
    key is the token itself (diffusers' layout)."""
    keys = set(keys)
    return bool(keys) and (keys <= EMBEDDING_KEYS or is_token_keyed(keys, EMBEDDING_KEYS))


def is_embedding_file(path: Path) -> bool:
    with open_safetensors(path) as handle:
        return is_embedding(handle.keys())


def read_adapter(path: Path, base_modules: FindBaseModules | None = None) -> tuple[dict, dict, str]:
    """An adapter file of any layout above -> (difftune-layout tensors, peft configs by part, difftune config TOML
    or "" when another tool made it). `base_modules` gives the base model's modules, needed for a kohya file only
    (a `_`-joined name cannot be split without them), and called only then, with the file's metadata."""
    path = Path(path)
    with open_safetensors(path) as handle:
        metadata = handle.metadata() or {}
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    if not tensors:
        raise DifftuneError(f"adapter {path}: holds no tensors")
    if is_embedding(tensors):
        raise DifftuneError(
            f"adapter {path}: a textual-inversion embedding ({', '.join(sorted(tensors))}), not a LoRA: it has one "
            f"layout, which A1111, ComfyUI and diffusers all read, so there is nothing to convert or average; "
            f"`difftune sample`, `merge` and `eval` take it as it is"
        )
    check_factors(tensors, path)
    config_toml = metadata.get(CONFIG_METADATA_KEY, "")
    if is_kohya(tensors):
        if base_modules is None:
            raise DifftuneError(
                f"adapter {path}: a kohya-layout file names modules with `_` for `.`; give the base model it was "
                f"trained on (--base) to read them"
            )
        modules = base_modules(metadata)
        try:
            tensors, lora_configs = family_from_kohya(modules.family, tensors, modules.names)
        except ValueError as err:
            raise DifftuneError(f"adapter {path}: {err}") from None
        return tensors, lora_configs, config_toml
    tensors = next(filter(None, (family.layout.read_original_layout(tensors) for family in FAMILIES.values())), tensors)
    tensors, alphas = _from_diffusers(tensors, path)
    if LORA_ADAPTER_METADATA_KEY in metadata:
        lora_configs = json.loads(metadata[LORA_ADAPTER_METADATA_KEY])
        missing = [part for part in parts_of(tensors) if f"{part}.r" not in lora_configs]
        if missing:
            raise DifftuneError(
                f"adapter {path}: its `{LORA_ADAPTER_METADATA_KEY}` metadata has no config for {missing[0]}"
            )
    else:
        lycoris = next((key for key in tensors if split_adapter_key(key.partition(".")[2])[1] in LYCORIS_TENSORS), None)
        if lycoris:
            raise DifftuneError(
                f"adapter {path}: {lycoris} is a LoHa/LoKr tensor in peft's layout without its "
                f"`{LORA_ADAPTER_METADATA_KEY}` "
                "metadata, which its factors' shapes do not determine; convert it from the kohya/LyCORIS layout instead"
            )
        lora_configs = _configs_from_shapes(tensors, alphas)
    return tensors, lora_configs, config_toml


# A LoRA module's two factors, in the kohya layout and in diffusers' / peft's.
FACTOR_PAIRS = (("lora_down.weight", "lora_up.weight"), ("lora_A.weight", "lora_B.weight"))


def check_factors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse a file whose LoRA factors make no LoRA, before any tool computes with them (other tools' files: a
    rank-0 module divided by zero, factors of disagreeing ranks failed in a matrix product, and `convert` rewrote
    them without a word): each module has both factors, of rank 1 or more, the up's columns the down's rows."""
    for down_kind, up_kind in FACTOR_PAIRS:
        downs = {key.removesuffix("." + down_kind): value for key, value in tensors.items() if key.endswith(down_kind)}
        ups = {key.removesuffix("." + up_kind): value for key, value in tensors.items() if key.endswith(up_kind)}
        for module in sorted(downs.keys() ^ ups.keys()):
            have, lack = (down_kind, up_kind) if module in downs else (up_kind, down_kind)
            raise DifftuneError(f"adapter {path}: {module} has a {have} but no {lack}; the file is cut or not a LoRA")
        for module, down in downs.items():
            up = ups[module]
            rank = down.shape[0] if down.ndim else 0
            if rank == 0 or up.ndim < 2 or up.shape[1] != rank:
                problem = (
                    "rank 0" if rank == 0 else f"a down of rank {rank}, an up of {up.shape[1] if up.ndim > 1 else 0}"
                )
                raise DifftuneError(
                    f"adapter {path}: {module}: its factors make no LoRA ({down_kind} {tuple(down.shape)}, {up_kind} "
                    f"{tuple(up.shape)}: {problem}); no tool could apply it, so nothing is done with it"
                )


def is_kohya(tensors: dict) -> bool:
    return any(key.startswith(KOHYA_PREFIXES) for key in tensors)


def placed_on_base(tensors: dict, modules: BaseModules, path: Path) -> dict:
    """`tensors` under the base's module names: a `text_encoder` that is a CLIPTextModelWithProjection (SD3's) keeps
    the `text_model.` level that reading drops for CLIPTextModel (`_text_module`), and gets it back here; a lone
    denoiser's file in the original model's names (Krea 2's reference trainer's and ComfyUI's `diffusion_model.`
    files) is placed by the family's `original_module_names`. Every adapted module must exist in the base: diffusers
    would otherwise drop the rest with a log line."""
    known = {part: set(names) for part, names in modules.names.items()}
    denoiser = modules.family.denoiser_name
    originals = modules.family.layout.original_module_names(modules.names.get(denoiser, []))
    placed = {}
    for key, value in tensors.items():
        part, _, rest = key.partition(".")
        module, kind = split_adapter_key(rest)
        if module not in known.get(part, ()) and f"text_model.{module}" in known.get(part, ()):
            module = f"text_model.{module}"
        if part == denoiser and module not in known[part] and module in originals:
            module = originals[module]
        if module not in known.get(part, ()):
            raise DifftuneError(
                f"adapter {path}: {key}: the base model's {part} has "
                f"no module {module!r}; is this adapter for this model?"
            )
        placed[f"{part}.{module}.{kind}"] = value
    return placed


def _from_diffusers(tensors: dict, path: Path) -> tuple[dict, dict]:
    """diffusers/peft keys (any generation) -> `<part>.<module>.lora_A.weight`, ...; and `.alpha` values by part.
    A key under no known part is a lone denoiser's: a UNet's or a transformer's, by its module names."""
    by_part: dict[str, dict] = {}
    for key, value in tensors.items():
        for prefix in LONE_MODEL_PREFIXES:
            key = key.removeprefix(prefix)
        part, _, rest = key.partition(".")
        if part not in KNOWN_PARTS:  # a lone denoiser's keys: a UNet's modules, or else a transformer's
            part, rest = ("unet" if UNET_MODULE.match(key) else "transformer"), key
        by_part.setdefault(part, {})[rest] = value
    out, alphas = {}, {}
    for part, state in by_part.items():
        for rest, value in _to_peft_names(part, state).items():
            if rest.endswith(".alpha"):
                alphas.setdefault(part, {})[_text_module(part, rest.removesuffix(".alpha"))] = float(value)
                continue
            try:
                module, kind = split_adapter_key(rest)
            except ValueError:
                raise DifftuneError(
                    f"adapter {path}: cannot place key {part}.{rest}: not a LoRA/DoRA tensor of a known layout "
                    f"(diffusers/peft lora_A/lora_B, lora.down/lora.up, kohya lora_down/lora_up, LyCORIS hada_*/lokr_*)"
                ) from None
            kind = f"{DORA_MAGNITUDE}.weight" if kind.startswith(DORA_MAGNITUDE) else kind
            out[f"{part}.{_text_module(part, module)}.{kind}"] = value
    return out, alphas


def _to_peft_names(part: str, state: dict) -> dict:
    """diffusers' own converters: older diffusers names -> peft's (peft names pass through unchanged)."""
    if part == "unet":
        return convert_unet_state_dict_to_peft(state)
    try:
        return convert_state_dict_to_peft(state)
    except ValueError:  # "could not infer the type": already peft names
        return state


def _text_module(part: str, module: str) -> str:
    # transformers 5's CLIPTextModel has no `text_model.` level; files from older versions carry it. (SDXL's
    # second encoder, a CLIPTextModelWithProjection, still has the level: its keys keep it.)
    return module.removeprefix("text_model.") if part == "text_encoder" else module


def parts_of(tensors: dict) -> list[str]:
    """The parts (`unet`, `text_encoder`, ...) a difftune-layout adapter has tensors for."""
    return sorted({key.partition(".")[0] for key in tensors})


def _configs_from_shapes(tensors: dict, alphas: dict) -> dict:
    ranks: dict[str, dict[str, int]] = {}
    dora: dict[str, bool] = {}
    for key, value in tensors.items():
        part, _, rest = key.partition(".")
        module, kind = split_adapter_key(rest)
        if kind == "lora_A.weight":
            ranks.setdefault(part, {})[module] = value.shape[0]
        elif kind.startswith(DORA_MAGNITUDE):
            dora[part] = True
    return derived_lora_configs(ranks, alphas, dora)


def module_names_of(components) -> BaseModules:
    """The adaptable (linear and convolution) modules of a base's parts. A module that already carries a peft
    adapter is named as in the base (peft moves the original to `<name>.base_layer`)."""
    names = {}
    for part, model in components.parts().items():
        if part == components.family.denoiser_name:  # files name an expert's own modules (a Wan 2.2 pair's: either)
            model = next(iter(components.family.drawing.denoiser_pipeline_parts(components).values()))
        layers = [
            name for name, module in model.named_modules() if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d))
        ]
        names[part] = [name.removesuffix(".base_layer") for name in layers if ".lora_" not in name]
    return BaseModules(names, components.family)
