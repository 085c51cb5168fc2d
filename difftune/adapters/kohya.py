"""The kohya / A1111 / ComfyUI adapter layout, both ways, lossless.

Keys: a part's prefix (the family's: `lora_unet_` and `lora_te_` for SD; `lora_unet_`, `lora_te1_` and
`lora_te2_` for SDXL) and the module's dotted path joined by `_`, each with `.lora_down.weight` (peft's
lora_A), `.lora_up.weight` (lora_B) and a scalar `.alpha`. A text encoder's path always starts
`text_model_`: transformers 5 dropped that level from CLIPTextModel, and A1111/ComfyUI skip keys without
it, silently.

DoRA magnitudes are written as `.dora_scale` with one value per output row, shaped `[out, 1]` for
a linear layer and `[out, 1, 1, 1]` for a convolution (peft keeps `[out]` and `[1, out, 1, 1]`), the
output-axis orientation kohya/LyCORIS (`wd_on_out`) write and ComfyUI/Forge detect by shape. Readers:
difftune reads it exactly; diffusers drops `dora_scale` (with a log line) and loads the rest as plain LoRA;
ComfyUI normalises output-axis DoRA by the norm of the base weight's rows instead of the adapted weight's, so
it reproduces peft's DoRA only approximately (`COMFYUI_DORA_NOTE`). The file keeps the DoRA formula's values:
they are what every exact reader needs.

LoHa and LoKr (LyCORIS) keep their own tensor names, the same in peft and in LyCORIS files (`.hada_w1_a`, ...,
`.lokr_w1`, `.lokr_w2_a`, ...), with `.alpha`. Readers scale a LoHa by alpha / rank and a LoKr by alpha / rank when
one of its factors is low-rank, else not at all (ComfyUI, A1111, LyCORIS); peft scales a LoKr by alpha / rank always,
so a LoKr with both factors full is written with that scale folded into `lokr_w1`, and read with alpha = rank
whatever its `.alpha` holds. Factors are placed as the file shapes them (export.py), whatever LyCORIS option made them.

Reading back needs the module names of the model the adapter was made for (a `_`-joined name
cannot be split unambiguously): they come from the base model's parts. A UNet's modules are found under either
naming kohya files use: diffusers' (`lora_unet_down_blocks_1_attentions_0_...`, sd-scripts' SD 1.x LoRAs) or the
original SGM/LDM one (`lora_unet_input_blocks_4_1_...`, sd-scripts' SDXL LoRAs), as diffusers' and ComfyUI's
loaders do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import tomllib
import torch

from difftune.adapter_kinds import file_kind
from difftune.adapters.trained import DORA_MAGNITUDE, LYCORIS_TENSORS, adapter_scale, config_alpha, derived_lora_configs
from difftune.families.common.family import Family
from difftune.families.common.layouts import KOHYA_DENOISER_PREFIX, FusedLayout, Layout, RenamedLayout, swap_halves

TEXT_MODEL = "text_model."


def _kohya_module(part: str, module: str, text_model_parts) -> str:
    """A CLIP text encoder's module path as kohya names it: always under `text_model.`."""
    if part in text_model_parts and not module.startswith(TEXT_MODEL):
        return TEXT_MODEL + module
    return module


def to_kohya(
    tensors: dict[str, torch.Tensor], lora_configs: dict, prefixes: dict[str, str], text_model_parts=()
) -> dict[str, torch.Tensor]:
    """difftune/diffusers adapter tensors (`unet.<path>.lora_A.weight`, ...) -> kohya keys, with the family's
    `prefixes` (part -> key prefix); `text_model_parts` are its CLIP encoders."""
    out, lycoris = {}, {}
    for key, value in tensors.items():
        part, _, rest = key.partition(".")
        module, kind = split_adapter_key(rest)
        if part not in prefixes:
            raise ValueError(f"{key}: this model family has no part {part!r} (it has {', '.join(prefixes)})")
        name = prefixes[part] + _kohya_module(part, module, text_model_parts).replace(".", "_")
        if kind in LYCORIS_TENSORS:
            out[f"{name}.{kind}"] = value
            lycoris[name] = (part, module)
        elif kind == "lora_A.weight":
            out[f"{name}.lora_down.weight"] = value
            out[f"{name}.alpha"] = torch.tensor(
                float(adapter_scale(lora_configs, part, module, value.shape[0]) * value.shape[0])
            )
        elif kind == "lora_B.weight":
            out[f"{name}.lora_up.weight"] = value
        else:  # DoRA magnitude: one value per output row
            out[f"{name}.dora_scale"] = value.reshape(-1, 1, 1, 1) if value.ndim == 4 else value.reshape(-1, 1)
    for name, (part, module) in lycoris.items():
        alpha = config_alpha(lora_configs, part, module)
        if f"{name}.lokr_w1" in out and f"{name}.lokr_w2" in out:  # no low-rank factor: readers apply no scale
            out[f"{name}.lokr_w1"] = out[f"{name}.lokr_w1"] * (alpha / _rank(lora_configs, part, module))
        else:
            out[f"{name}.alpha"] = torch.tensor(float(alpha))
    return out


SIMPLETUNER_PREFIX = "lycoris_"  # SimpleTuner's LyCORIS files: the denoiser's modules, diffusers' names


def from_kohya(
    kohya: dict[str, torch.Tensor],
    module_names: dict[str, list[str]],
    prefixes: dict[str, str],
    text_model_parts=(),
    other_names: dict[str, dict[str, str]] | None = None,
    denoiser: str | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """kohya keys -> difftune/diffusers adapter tensors and each part's peft config (rank, alpha, DoRA).

    `module_names` maps each part ("unet", "text_encoder", ...) to the dotted module names of the model to load
    into; `prefixes` maps it to its kohya key prefix; `other_names` gives a part's modules by the other names files
    use for them (the original SGM names of a UNet: kohya sd-scripts writes SDXL LoRAs that way). The `denoiser`
    part's modules are read under `lycoris_` too: SimpleTuner's LyCORIS files name them so, with diffusers' names
    (ComfyUI maps `lycoris_<module>` beside `lora_unet_<module>`).
    """
    lookup = {}
    for part, names in module_names.items():
        if part not in prefixes:
            continue  # a part the family's files never adapt (Qwen-Image's text encoder)
        for name in names:
            lookup[prefixes[part] + name.replace(".", "_")] = (part, name)
            lookup[prefixes[part] + _kohya_module(part, name, text_model_parts).replace(".", "_")] = (part, name)
    for part, names in (other_names or {}).items():
        lookup |= {prefixes[part] + other.replace(".", "_"): (part, name) for other, name in names.items()}
    if denoiser:
        names = module_names.get(denoiser, [])
        lookup |= {SIMPLETUNER_PREFIX + name.replace(".", "_"): (denoiser, name) for name in names}
    tensors, ranks, alphas, dora, kinds, decompose_both, lycoris = {}, {}, {}, {}, {}, set(), {}
    for key, value in kohya.items():
        name, _, kind = key.partition(".")
        if name not in lookup:
            raise ValueError(_foreign_module_message(key, kohya, lookup, prefixes))
        part, module = lookup[name]
        prefix = f"{part}.{module}"
        if kind in LYCORIS_TENSORS:
            tensors[f"{prefix}.{kind}"] = value
            kinds[part] = "LOHA" if kind.startswith("hada_") else "LOKR"
            if kind == "lokr_w1_a":
                decompose_both.add(part)
            lycoris[name] = (part, module)
        elif kind == "lora_down.weight":
            tensors[f"{prefix}.lora_A.weight"] = value
            ranks.setdefault(part, {})[module] = value.shape[0]
        elif kind == "lora_up.weight":
            tensors[f"{prefix}.lora_B.weight"] = value
        elif kind == "alpha":
            alphas.setdefault(part, {})[module] = float(value)
        elif kind == "dora_scale":
            if f"{name}.lora_down.weight" not in kohya:
                raise ValueError(
                    f"{key}: a LoHa/LoKr with weight decomposition (LyCORIS dora_wd), which peft's "
                    "LoHa and LoKr cannot hold; merge it into the base with the tool that made it"
                )
            is_conv = kohya[f"{name}.lora_down.weight"].ndim == 4
            magnitude = value.reshape(1, -1, 1, 1) if is_conv else value.reshape(-1)
            tensors[f"{prefix}.{DORA_MAGNITUDE}.weight"] = magnitude
            dora[part] = True
        else:
            raise ValueError(
                f"{key}: unknown kohya key kind {kind!r} (known: lora_down, lora_up, alpha, dora_scale, and LyCORIS's "
                f"{', '.join(LYCORIS_TENSORS)})"
            )
    for name, (part, module) in lycoris.items():
        ranks.setdefault(part, {})[module], alpha = _lycoris_rank_and_alpha(kohya, name)
        if alpha is not None:
            alphas.setdefault(part, {})[module] = alpha
    return tensors, derived_lora_configs(ranks, alphas, dora, kinds, decompose_both)


def _lycoris_rank_and_alpha(kohya: dict[str, torch.Tensor], name: str) -> tuple[int, float | None]:
    """A LyCORIS module's rank as peft configures it, and the alpha that gives the scale LyCORIS, ComfyUI and A1111
    apply (None: the file has none, so alpha = rank). With a low-rank factor the rank is its inner size and the scale
    alpha / rank, the file's alpha. A LoKr of two full factors has scale 1 whatever its `.alpha` says (LyCORIS stores
    its network's dim there, 10000 under the full-matrix preset): its rank is one at which peft keeps both factors
    full (half their largest side or more), and its alpha that rank."""
    for inner in ("hada_w1_b", "lokr_w2_b", "lokr_w1_b"):
        if f"{name}.{inner}" in kohya:
            alpha = kohya.get(f"{name}.alpha")
            return kohya[f"{name}.{inner}"].shape[0], None if alpha is None else float(alpha)
    rank = max(kohya[f"{name}.lokr_w2"].shape[:2])
    return rank, float(rank)


def _foreign_module_message(key: str, kohya: dict, lookup: dict, prefixes: dict[str, str]) -> str:
    """Why a kohya key has no place in the base: a part the base lacks, or modules its parts lack (how many of the
    file's), both naming the file as made for another model rather than the base as wrong."""
    names = {k.partition(".")[0] for k in kohya}
    unknown = sorted(names - lookup.keys())
    name = key.partition(".")[0]
    if not name.startswith(tuple(prefixes.values())):
        return (
            f"{key}: its prefix names a part this model family does not have (its prefixes: "
            f"{', '.join(prefixes.values())}); the file is for another kind of model"
        )
    return (
        f"{key}: {name!r} is not a module of the base, in diffusers' names or the original (SGM/LDM) ones; "
        f"{len(unknown)} of the file's {len(names)} modules are not (first: {unknown[0]}), so the file was made "
        f"for a model of another architecture than this base"
    )


def fuse(
    tensors: dict[str, torch.Tensor], lora_configs: dict, part: str, modules: list[str]
) -> dict[str, torch.Tensor]:
    """The adapters of `modules` (of `part`) as one adapter of the layer that stacks their output rows (a fused qkv):
    downs stacked, ups block-diagonal, so the fused change is exactly the stacked changes. Alpha keeps the first
    module's scale (alpha / rank); another module's scale is folded into its up. DoRA magnitudes, being per output
    row, stack as they are. One module: its adapter unchanged."""
    downs = [tensors[f"{part}.{module}.lora_A.weight"] for module in modules]
    ups = [tensors[f"{part}.{module}.lora_B.weight"] for module in modules]
    scales = [
        adapter_scale(lora_configs, part, module, down.shape[0]) for module, down in zip(modules, downs, strict=True)
    ]
    rank = sum(down.shape[0] for down in downs)
    fused = {
        "lora_down.weight": torch.cat(downs),
        "lora_up.weight": torch.block_diag(*[up * (scale / scales[0]) for up, scale in zip(ups, scales, strict=True)]),
        "alpha": torch.tensor(scales[0] * rank),
    }
    magnitudes = [
        tensors.get(f"{part}.{module}.{DORA_MAGNITUDE}.weight", tensors.get(f"{part}.{module}.{DORA_MAGNITUDE}"))
        for module in modules
    ]
    if any(magnitude is not None for magnitude in magnitudes):
        fused["dora_scale"] = torch.cat([magnitude.reshape(-1) for magnitude in magnitudes]).reshape(-1, 1)
    return fused


@dataclass
class Split:
    tensors: dict[str, torch.Tensor]  # lora_A.weight, lora_B.weight (and the DoRA magnitude)
    rank: int
    alpha: float


def split(fused: dict[str, torch.Tensor], row_sizes: list[int]) -> list[Split]:
    """Inverse of `fuse`: one fused layer's adapter (kohya kinds) -> one adapter per module, `row_sizes` its output
    rows each. An up that is block-diagonal (what `fuse` writes, or a fresh zero one) gives each module its own
    rank-r/n slice back, exactly; any other (trained fused, as kohya trains it) gives every module the whole
    down with its rows of the up: the same change."""
    down, up = fused["lora_down.weight"], fused["lora_up.weight"]
    rank, count = down.shape[0], len(row_sizes)
    alpha = float(fused.get("alpha", rank))
    blocks = up.split(row_sizes)
    width = rank // count
    diagonal = rank % count == 0 and all(
        not block[:, j * width : (j + 1) * width].any()
        for i, block in enumerate(blocks)
        for j in range(count)
        if i != j
    )
    magnitudes = fused["dora_scale"].reshape(-1).split(row_sizes) if "dora_scale" in fused else [None] * count
    out = []
    for i, (block, magnitude) in enumerate(zip(blocks, magnitudes, strict=True)):
        if diagonal:
            tensors = {
                "lora_A.weight": down[i * width : (i + 1) * width],
                "lora_B.weight": block[:, i * width : (i + 1) * width],
            }
        else:
            tensors = {"lora_A.weight": down, "lora_B.weight": block}
        if magnitude is not None:
            tensors[f"{DORA_MAGNITUDE}.weight"] = magnitude
        sub_rank = width if diagonal else rank
        # Copies: a shared down would make the modules' tensors share memory, which safetensors refuses to write.
        out.append(Split({key: value.clone() for key, value in tensors.items()}, sub_rank, alpha * sub_rank / rank))
    return out


COMFYUI_DORA_NOTE = (
    "note: ComfyUI applies a kohya-layout DoRA file approximately: it divides by the norm of the base weight's "
    "rows where DoRA divides by the norm of the adapted weight's (base + change), so its images differ from "
    "difftune's and diffusers'. For exact DoRA there, merge first (difftune merge --single-file) and load the "
    "merged checkpoint; in diffusers, load the diffusers-layout file."
)


def kohya_metadata(config_toml: str, lora_configs: dict, base: str, base_model_version: str | None) -> dict[str, str]:
    """The `ss_*` fields kohya's scripts write and A1111's UI shows. The training fields come from the difftune
    config when the adapter has one (an adapter from another tool has only its network's shape);
    `ss_base_model_version` (A1111 lists a LoRA under the model versions it names) is left out when unknown."""
    config = tomllib.loads(config_toml) if config_toml else {}
    part = next(key for key in lora_configs if key.endswith(".r")).removesuffix(".r")  # the first part with an adapter
    network_args = file_kind(lora_configs, part).kohya_network_args()
    metadata = {
        "ss_network_module": "lycoris.kohya" if network_args else "networks.lora",
        "ss_network_args": json.dumps(network_args),
        "ss_network_dim": str(lora_configs[f"{part}.r"]),
        "ss_network_alpha": str(config_alpha(lora_configs, part)),
        "ss_output_name": "difftune",
    }
    if base_model_version:
        metadata["ss_base_model_version"] = base_model_version
    if base or config:
        # As kohya's scripts write it: a local base by its folder or file name (no one's home path in a shared
        # file), a hub id as it is.
        name = config["model"]["base"] if config else base
        metadata["ss_sd_model_name"] = Path(name).name if Path(name).exists() else name
    if config:
        metadata |= {
            "ss_resolution": f"({config['data']['resolution']}, {config['data']['resolution']})",
            "ss_max_train_steps": str(config["train"]["max_steps"]),
            "ss_learning_rate": str(config["optim"]["learning_rate"]),
            "ss_seed": str(config["train"]["seed"]),
            "ss_train_text_encoder": str(config["adapter"]["text_encoder"]),
            "ss_training_comment": f"trained with difftune ({config['adapter']['kind']})",
        }
    else:
        metadata["ss_training_comment"] = "converted by difftune"
    return metadata


def split_adapter_key(key: str) -> tuple[str, str]:
    # The magnitude with `.weight` (as difftune writes it) or bare (as diffusers/peft write it).
    for kind in ("lora_A.weight", "lora_B.weight", f"{DORA_MAGNITUDE}.weight", DORA_MAGNITUDE, *LYCORIS_TENSORS):
        if key.endswith("." + kind):
            return key[: -len(kind) - 1], kind
    raise ValueError(f"{key}: not a LoRA/DoRA/LoHa/LoKr tensor (lora_A, lora_B, {DORA_MAGNITUDE}, hada_*, lokr_*)")


def _rank(lora_configs: dict, part: str, module: str) -> int:
    return (lora_configs.get(f"{part}.rank_pattern") or {}).get(module, lora_configs[f"{part}.r"])


# A family's layout: its parts' prefixes and, for the denoiser, the original model's names where the family's layout
# gives them (families/common/layouts.py: fused layers, or modules renamed one for one).


def family_to_kohya(family: Family, tensors: dict[str, torch.Tensor], lora_configs: dict) -> dict[str, torch.Tensor]:
    """difftune-layout adapter tensors -> the family's kohya / A1111 / ComfyUI layout."""
    layout = family.layout
    if isinstance(layout, FusedLayout):
        return _fused_to_kohya(layout, family.denoiser_name, tensors, lora_configs)
    if isinstance(layout, RenamedLayout):
        return _renamed_to_kohya(layout, family.denoiser_name, tensors, lora_configs)
    return to_kohya(tensors, lora_configs, layout.kohya_prefixes, layout.kohya_text_model_parts)


def family_from_kohya(
    family: Family, tensors: dict[str, torch.Tensor], module_names: dict[str, list[str]]
) -> tuple[dict[str, torch.Tensor], dict]:
    """Inverse of `family_to_kohya`, with the base's module names (part -> names): tensors and peft configs. The
    denoiser's modules are found under their original names too (`family.layout.original_module_names`)."""
    if isinstance(family.layout, FusedLayout):
        return _fused_from_kohya(family.layout, family.denoiser_name, tensors, module_names)
    return _plain_from_kohya(family.layout, family.denoiser_name, tensors, module_names)


def _plain_from_kohya(
    layout: Layout, denoiser: str, tensors: dict, module_names: dict[str, list[str]]
) -> tuple[dict, dict]:
    other_names = {denoiser: layout.original_module_names(module_names.get(denoiser, []))}
    return from_kohya(
        tensors,
        module_names,
        layout.kohya_prefixes,
        layout.kohya_text_model_parts,
        other_names,
        denoiser=denoiser,
    )


def _fused_to_kohya(
    layout: FusedLayout, denoiser_name: str, tensors: dict, lora_configs: dict
) -> dict[str, torch.Tensor]:
    """Each original layer one adapter over the diffusers modules it holds (`fuse`); the other parts as any family's."""
    prefix = f"{denoiser_name}."
    denoiser = {key: value for key, value in tensors.items() if key.startswith(prefix)}
    out = to_kohya(
        {key: value for key, value in tensors.items() if key not in denoiser},
        lora_configs,
        layout.kohya_prefixes,
        layout.kohya_text_model_parts,
    )
    kinds = {split_adapter_key(key.removeprefix(prefix))[1] for key in denoiser}
    if kinds & set(LYCORIS_TENSORS):
        raise ValueError(f"a LoHa/LoKr adapter: {layout.no_fused_lycoris()}; write the diffusers layout")
    adapted = {split_adapter_key(key.removeprefix(prefix))[0] for key in denoiser}
    table = layout.kohya_table(adapted)
    for name, modules in table.items():
        present = [module in adapted for module in modules]
        if not any(present):
            continue
        if not all(present):
            raise ValueError(
                f"the kohya {layout.kohya_layout_name} layout fuses {', '.join(modules)} "
                f"into {name}: adapt all of them (or none), or write the diffusers layout"
            )
        fused = fuse(denoiser, lora_configs, denoiser_name, modules)
        if layout.swaps_halves(name):
            fused = _halves_swapped(fused)
        out |= {f"{KOHYA_DENOISER_PREFIX}{name}.{kind}": value for kind, value in fused.items()}
    unnamed = adapted - {module for modules in table.values() for module in modules}
    if unnamed:
        raise ValueError(
            f"{prefix}{sorted(unnamed)[0]}: has no name in the kohya {layout.kohya_layout_name} layout; "
            "write the diffusers layout"
        )
    return out


def _halves_swapped(fused: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A fused layer's adapter for the same layer with its output rows' two halves swapped: the up's rows, and a DoRA
    magnitude's, swapped (its own inverse)."""
    out = fused | {"lora_up.weight": swap_halves(fused["lora_up.weight"])}
    if "dora_scale" in fused:
        out["dora_scale"] = swap_halves(fused["dora_scale"])
    return out


def _fused_from_kohya(
    layout: FusedLayout, denoiser_name: str, tensors: dict, module_names: dict[str, list[str]]
) -> tuple[dict, dict]:
    """The original layout's layers split back into the diffusers modules they hold (`split`); a key named after one
    diffusers module (as sd-scripts' and musubi-tuner's Z-Image and Lumina files are) is read as any family's."""
    table = layout.kohya_table(module_names[denoiser_name])

    def original_layer(key: str) -> str | None:
        name = key.partition(".")[0].removeprefix(KOHYA_DENOISER_PREFIX)
        return name if key.startswith(KOHYA_DENOISER_PREFIX) and name in table else None

    fused = {key: value for key, value in tensors.items() if original_layer(key)}
    out, configs = _plain_from_kohya(
        layout, denoiser_name, {key: value for key, value in tensors.items() if key not in fused}, module_names
    )
    by_name: dict[str, dict] = {}
    for key, value in fused.items():
        name, _, kind = key.removeprefix(KOHYA_DENOISER_PREFIX).partition(".")
        by_name.setdefault(name, {})[kind] = value
    ranks, alphas = {}, {}
    for name, found in by_name.items():
        modules = table[name]
        if layout.swaps_halves(name):
            found = _halves_swapped(found)
        sizes = layout.fused_row_sizes(modules, found["lora_up.weight"].shape[0], found["lora_down.weight"].shape[1])
        for module, part in zip(modules, split(found, sizes), strict=True):
            out |= {f"{denoiser_name}.{module}.{kind}": value for kind, value in part.tensors.items()}
            ranks[module], alphas[module] = part.rank, part.alpha
    if ranks:
        dora = {denoiser_name: any("dora_scale" in found for found in by_name.values())}
        configs |= derived_lora_configs({denoiser_name: ranks}, {denoiser_name: alphas}, dora)
    return out, configs


def _renamed_to_kohya(
    layout: RenamedLayout, denoiser_name: str, tensors: dict, lora_configs: dict
) -> dict[str, torch.Tensor]:
    """Each denoiser module under its original name (`layout.original_name`); the other parts' (Anima's text
    conditioner's) as any family's."""
    prefix, originals = layout.kohya_prefixes[denoiser_name], {}
    for key in tensors:
        part, _, rest = key.partition(".")
        if part != denoiser_name:
            continue
        module = split_adapter_key(rest)[0]
        if (original := layout.original_name(module)) is None:
            raise ValueError(
                f"{denoiser_name}.{module}: has no name in {layout.kohya_layout_name}'s original "
                "layout; write the diffusers layout"
            )
        originals[prefix + module.replace(".", "_")] = prefix + original.replace(".", "_")
    renamed = {}
    for key, value in to_kohya(tensors, lora_configs, layout.kohya_prefixes, layout.kohya_text_model_parts).items():
        name, _, kind = key.partition(".")
        renamed[f"{originals.get(name, name)}.{kind}"] = value
    return renamed
