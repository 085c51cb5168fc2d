"""A family's files in other tools' layouts, the role a family holds as `layout`: its kohya / A1111 / ComfyUI adapter
names (what `adapters/kohya.py` converts by), its single files (read and written) and the original model's names.

`Layout` is the UNet families' and the base of the others: each part under its diffusers module path with `_` and the
family's prefix, a UNet's modules found under their LDM / SGM names too.

Fused (`FusedLayout`): the original model fuses layers that diffusers keeps apart (Flux.1's and SD3's attention `qkv`,
Flux's single-block `linear1`): one adapter per original layer, named by the original model (`lora_unet_<original name
with _>`), over the diffusers modules it holds; and, for families that give the original layout's tables
(`original_blocks`, `original_globals`), their single files: the denoiser alone in the original layout, written and
read from the same tables (`original_state_dict`, `diffusers_state_dict`). The family's layout gives `kohya_blocks`
(per list of blocks, each original name with the block's index as `{i}` -> the diffusers modules it holds, in the
order of its output rows), `kohya_globals` for layers outside the blocks and, where the modules' widths differ,
`fused_row_sizes`. Writing stacks the modules' downs and puts their ups block-diagonal (`kohya.fuse`), so the fused
change is exactly the modules' changes; reading splits them back, or shares a trained fused down (`kohya.split`).

The single files' tables and conversions are `OriginalFileLayout`'s, which a renamed layout mixes in too where its
single files fuse what its adapters keep apart (HunyuanVideo 1.5's token refiner).

Renamed one for one (`RenamedLayout`: Krea 2's, Wan's): each module under its original name (`original_name`).
Not renamed at all (`DiffusersNamedLayout`: Qwen-Image's, HiDream's, ERNIE-Image's): the original names are diffusers'.

A layout holds facts and weight-name conversions only; a family module subclasses the one it needs and the family
holds an instance (`layout = FluxLayout()`).
"""

from __future__ import annotations

import re

import torch

from difftune.errors import DifftuneError
from difftune.models import single_file
from difftune.models.denoiser_files import DENOISER_FILE_PREFIXES

KOHYA_DENOISER_PREFIX = "lora_unet_"
BLOCK = re.compile(r"^(\w+)\.(\d+)\.")  # a block's list and index: `single_transformer_blocks.3.`
# The same where the list may be a dotted path: `txt_in.individual_token_refiner.blocks.0.`.
LISTED_BLOCK = re.compile(r"^(.+?)\.(\d+)\.")

OriginalBlocks = dict[str, tuple[str, dict[str, list[str]]]]


def swap_halves(value: torch.Tensor) -> torch.Tensor:
    """A modulation's two halves in the other order: (scale, shift) in diffusers, (shift, scale) in the originals."""
    return torch.cat(value.chunk(2)[::-1])


def kohya_blocks_of(original_blocks: OriginalBlocks) -> dict[str, dict[str, list[str]]]:
    """Each block list's adaptable original layers as the kohya layout names them (`double_blocks_{i}_img_attn_qkv`):
    every layer but the norms."""
    return {
        blocks: {
            f"{kind}_{{i}}_{name.replace('.', '_')}": modules
            for name, modules in layers.items()
            if ".norm." not in f".{name}"
        }
        for blocks, (kind, layers) in original_blocks.items()
    }


def kohya_globals_of(original_globals: dict[str, str], swapped_halves: tuple[str, ...]) -> dict[str, list[str]]:
    """The layers outside the blocks as the kohya layout names them (`img_in`), but those whose halves the original
    model swaps (an adapter's rows would have to be swapped too)."""
    return {
        original.replace(".", "_"): [module]
        for module, original in original_globals.items()
        if f"{module}.weight" not in swapped_halves
    }


def has_file_key(keys: set[str], key: str) -> bool:
    """Whether a single file's `keys` hold `key`, as it is or under one of ComfyUI's prefixes."""
    return file_key(keys, key) is not None


def file_key(keys: set[str], key: str) -> str | None:
    """How a single file's `keys` spell `key`: as it is or under one of ComfyUI's prefixes; None where they lack it."""
    return next((prefix + key for prefix in ("", *DENOISER_FILE_PREFIXES) if prefix + key in keys), None)


class Layout:
    kohya_prefixes: dict[str, str]  # part -> key prefix in kohya / A1111 / ComfyUI files
    kohya_text_model_parts: tuple[str, ...] = (
        "text_encoder",
    )  # CLIP encoders: kohya names their modules `text_model_*`
    kohya_model_version: str | None = None  # kohya's `ss_base_model_version`, where one name covers the family's bases
    embedding_keys: tuple[str, ...] = ("emb_params",)  # per text encoder: its key in A1111 / ComfyUI embedding files
    single_file_layout: str | None = None  # what its single files (read and written) hold; None: not read
    denoiser_file_key: str | None = None  # a key every denoiser-alone single file of the family has
    # Keys of another model's files that have `denoiser_file_key` too (a model built on the family's layers)
    other_models_file_keys: tuple[str, ...] = ()
    # The denoiser's input layer's weight in its single files (ComfyUI's may prefix it): its inputs tell the family's
    # variants apart where their keys are one (an inpainting UNet reads 9 channels, SD's 4: `Family.file_inputs`)
    input_file_key: str | None = None

    def reads_single_file(self, keys: set[str]) -> bool:
        """Whether a single file with these keys is this family's: where its single files hold the denoiser alone,
        they have `denoiser_file_key` (ComfyUI's files may prefix it) and none of `other_models_file_keys`; families
        without single files read none (a diffusers folder of theirs is what to pass)."""
        return (
            self.denoiser_file_key is not None
            and has_file_key(keys, self.denoiser_file_key)
            and not self.holds_other_model(keys)
        )

    def holds_other_model(self, keys: set[str]) -> bool:
        return any(has_file_key(keys, key) for key in self.other_models_file_keys)

    def diffusers_names(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A denoiser file's tensors (ComfyUI's prefixes gone) under diffusers' names: as they are, unless the
        family's files have another layout. Only moves, splits, joins and reshapes (vectors): denoiser_files.py runs
        it over codes of the file's rows, never over its weights."""
        return weights

    def to_single_file(self, components) -> dict[str, torch.Tensor]:
        """Every weight under the original (LDM / SGM) single-file keys that A1111, ComfyUI and
        `from_single_file` read; a family without a single-file layout (`single_file_layout` None) refuses."""
        raise DifftuneError(
            f"merge --single-file: no single-file layout is built for {components.family.description}; merge into a "
            "diffusers folder (without --single-file), which its pipeline loads"
        )

    def read_original_layout(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """An adapter file in the family's original layout that only diffusers' reader for the family converts (fused
        layers split, as other trainers write them), recognised by its keys alone: its tensors in diffusers' layout
        (`transformer.<module>.lora_A.weight`, ...), or None for any other file (the generic readers take it)."""
        return None

    def original_module_names(self, denoiser_modules: list[str]) -> dict[str, str]:
        """The denoiser's modules by their names in the original (non-diffusers) model, as kohya files may use them:
        a UNet's LDM/SGM names (none for a transformer: where its original layout fuses layers, `FusedLayout`'s table
        names them)."""
        return single_file.unet_ldm_module_names(denoiser_modules)

    def base_model_version(self, model) -> str | None:
        """kohya's `ss_base_model_version` of adapters for `model` (a `ModelConfig`; None: unknown): the family's,
        where one version name covers all its bases."""
        return self.kohya_model_version

    def problems(self, config) -> list[str]:
        """The settings of `config` (a `Config`) whose files this layout cannot write, each named."""
        return []


class OriginalFileLayout:
    """Single files in the original layout, from the family's tables, before the layout class in its bases
    (`FusedLayout`'s, and a renamed layout whose single files fuse what its adapters keep apart: HunyuanVideo 1.5's
    token refiner). A block list may be a dotted path (`context_embedder.token_refiner.refiner_blocks`)."""

    kohya_layout_name: str
    denoiser_file_key: str | None
    # The original layout, where the family's single files use it: diffusers block list -> (the original block list,
    # {original layer: the diffusers modules it holds, in the order of its output rows}); outside the blocks,
    # diffusers module -> original layer; the weights whose two halves the original model holds in the other order
    # (a final modulation's shift and scale). A layer named `.norm.` (BFL's query and key norms) keeps its weight as
    # `scale` there.
    original_blocks: OriginalBlocks = {}
    original_globals: dict[str, str] = {}
    swapped_halves: tuple[str, ...] = ()
    # Original layers in a block whose rows hold the module's two halves in the other order (MiniMax-H3's SwiGLU
    # `mlp.fc1`: gate, value, where diffusers' `ff.net.0.proj` holds value, gate); its adapters' ups are swapped too.
    swapped_block_layers: tuple[str, ...] = ()

    def fused_row_sizes(self, modules: list[str], rows: int, columns: int) -> list[int]:
        """How a fused layer's `rows` output rows split among its `modules` (`columns`: its input width): evenly,
        unless the family says otherwise."""
        return [rows // len(modules)] * len(modules)

    def to_single_file(self, components) -> dict[str, torch.Tensor]:
        if not self.original_blocks:
            return super().to_single_file(components)
        return self.original_state_dict(components.denoiser.state_dict())

    def diffusers_names(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A file in the original layout (it has `denoiser_file_key`) converted; diffusers' names as they are."""
        return (
            self.diffusers_state_dict(weights)
            if self.original_blocks and self.denoiser_file_key in weights
            else weights
        )

    def original_state_dict(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The denoiser's weights in the original layout: each original layer's modules stacked by rows (q, k and v
        fused), norm weights as `scale`, swapped halves in the original's order. Every weight is written once."""
        weights, out = dict(weights), {}
        for blocks, (kind, layers) in self.original_blocks.items():
            indices = sorted(
                {
                    int(match.group(2))
                    for key in weights
                    if (match := LISTED_BLOCK.match(key)) and match.group(1) == blocks
                }
            )
            for i in indices:
                for original, modules in layers.items():
                    for parameter in ("weight", "bias"):
                        keys = [f"{blocks}.{i}.{module}.{parameter}" for module in modules]
                        if keys[0] in weights:
                            saved = "scale" if ".norm." in f".{original}" else parameter
                            value = torch.cat([weights.pop(key) for key in keys])
                            swapped = original in self.swapped_block_layers
                            out[f"{kind}.{i}.{original}.{saved}"] = swap_halves(value) if swapped else value
        for key, value in weights.items():
            module, parameter = key.rsplit(".", 1)
            if module not in self.original_globals:
                raise DifftuneError(
                    f"merge --single-file: {key} has no name in {self.kohya_layout_name}'s original layout"
                )
            if key in self.swapped_halves:
                value = swap_halves(value)
            out[f"{self.original_globals[module]}.{parameter}"] = value
        return {key: value.contiguous() for key, value in out.items()}

    def diffusers_state_dict(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`original_state_dict` undone: a single file's original-layout weights under diffusers' names, each fused
        layer split by rows as `fused_row_sizes` says."""
        blocks_of = {kind: (blocks, layers) for blocks, (kind, layers) in self.original_blocks.items()}
        module_of = {original: module for module, original in self.original_globals.items()}
        out = {}
        for key, value in weights.items():
            layer, parameter = key.rsplit(".", 1)
            match = LISTED_BLOCK.match(key)
            if match and match.group(1) in blocks_of:
                blocks, layers = blocks_of[match.group(1)]
                modules = layers.get(layer[match.end() :])
                if modules is None:
                    raise DifftuneError(
                        f"{key}: no layer of a {self.kohya_layout_name} {match.group(1)} block has this name; "
                        "is this file of another model?"
                    )
                parameter = "weight" if parameter == "scale" else parameter
                if layer[match.end() :] in self.swapped_block_layers:
                    value = swap_halves(value)
                # A layer of one module is that module's, whole; a fused one splits as the family says.
                columns = value.shape[-1] if value.ndim > 1 else 0
                sizes = self.fused_row_sizes(modules, value.shape[0], columns) if len(modules) > 1 else [len(value)]
                for module, rows in zip(modules, value.split(sizes), strict=True):
                    out[f"{blocks}.{match.group(2)}.{module}.{parameter}"] = rows
            elif layer in module_of:
                name = f"{module_of[layer]}.{parameter}"
                out[name] = swap_halves(value) if name in self.swapped_halves else value
            else:
                raise DifftuneError(
                    f"{key}: not a layer of {self.kohya_layout_name}'s original layout; is this file of another model?"
                )
        return out


class FusedLayout(OriginalFileLayout, Layout):
    kohya_layout_name: str  # the original model's name, as messages name its layout ("Flux", "SD3")
    kohya_blocks: dict[str, dict[str, list[str]]]  # block list -> {original name with `{i}`: its modules in the block}
    kohya_globals: dict[str, list[str]] = {}  # original name -> the modules it holds, outside the blocks

    def kohya_table(self, denoiser_modules) -> dict[str, list[str]]:
        """Original (kohya) name -> the denoiser's modules (diffusers names) it holds, for every block that
        `denoiser_modules` (module names, or adapted module names) mention."""
        blocks = sorted(
            {
                (match.group(1), int(match.group(2)))
                for module in denoiser_modules
                if (match := BLOCK.match(module)) and match.group(1) in self.kohya_blocks
            }
        )
        table = {}
        for kind, index in blocks:
            table |= {
                pattern.format(i=index): [f"{kind}.{index}.{member}" for member in members]
                for pattern, members in self.kohya_blocks[kind].items()
            }
        return table | self.kohya_globals

    def swaps_halves(self, name: str) -> bool:
        """Whether the kohya layer `name` holds its module's rows with the two halves swapped
        (`swapped_block_layers`)."""
        return any(name.endswith("_" + layer.replace(".", "_")) for layer in self.swapped_block_layers)

    def problems(self, config) -> list[str]:
        problems = super().problems(config)
        if config.adapter.is_adapter and not config.adapter.kind_type.fusable and config.export.format == "kohya":
            problems.append(
                f'adapter.kind = "{config.adapter.kind}" with export.format = "kohya": '
                f'{self.no_fused_lycoris()}; use export.format = "diffusers"'
            )
        return problems

    def no_fused_lycoris(self) -> str:
        return (
            f"the {self.kohya_layout_name} layout fuses q, k and v into "
            "one layer, and separate LoHa/LoKr factors have no fused form"
        )


class DiffusersNamedLayout(Layout):
    """A transformer family whose original model names its modules as diffusers does (Qwen-Image, HiDream,
    ERNIE-Image): the kohya layout is `lora_unet_` + the diffusers module (the transformer's adapters alone), and a
    single file is the transformer alone under those names, the file ComfyUI loads as a diffusion model (the text
    encoders and the autoencoder are files of their own there)."""

    single_file_layout = "transformer alone (diffusers names)"
    kohya_prefixes = {"transformer": KOHYA_DENOISER_PREFIX}
    kohya_text_model_parts = ()

    def to_single_file(self, components) -> dict[str, torch.Tensor]:
        return {key: value.contiguous() for key, value in components.denoiser.state_dict().items()}


class RenamedLayout(Layout):
    """The kohya / ComfyUI layout of a denoiser whose original model names its modules otherwise, one for one (Krea 2,
    Wan): `lora_unet_<original name with _>`, what ComfyUI maps from its own weights' names and the reference trainers
    write; read back through `original_module_names`. The family's layout gives `original_name`."""

    kohya_layout_name: str  # the original model's name, as messages name its layout

    def original_name(self, module: str) -> str | None:
        """A denoiser module's name in the original model (None: it has no adaptable counterpart there)."""
        raise NotImplementedError

    def original_module_names(self, denoiser_modules: list[str]) -> dict[str, str]:
        return {original: module for module in denoiser_modules if (original := self.original_name(module))}
