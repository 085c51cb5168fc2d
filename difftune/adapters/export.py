"""Writing what training produced, in the formats other tools load; merging adapters into the base.

The diffusers-layout adapter file is one safetensors file that diffusers' `load_lora_weights` reads:
peft keys prefixed by their part (`unet.`, `text_encoder.`, SDXL's `text_encoder_2.`), each part's peft `LoraConfig`
under the metadata key
`lora_adapter_metadata` (so rank, alpha and DoRA are read, not guessed from shapes), and the resolved
difftune config under `difftune_config`. Weights are kept in fp32: lossless, and small. The kohya
layout (kohya.py) is the same tensors under A1111/ComfyUI names, with `ss_*` metadata.

LoHa and LoKr files in the diffusers layout hold peft's tensors and configs the same way; diffusers' LoRA loader
reads neither kind, so difftune attaches them with peft itself (`_attach_lycoris`), and their kohya layout is the
LyCORIS one ComfyUI and A1111 read.
"""

from __future__ import annotations

import json
import tempfile
from functools import singledispatch
from pathlib import Path

import tomllib
import torch
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY, LORA_WEIGHT_NAME_SAFE
from safetensors.torch import save_file

from difftune.adapter_kinds import (
    AdapterKind,
    ControlNet,
    FullFineTune,
    LyCORIS,
    PeftAdapter,
    TokenEmbedding,
    file_kind,
)
from difftune.adapters.embeddings import embedding_file_name, load_embedding, write_embedding
from difftune.adapters.files import (
    CONFIG_METADATA_KEY,
    is_embedding_file,
    module_names_of,
    parts_of,
    placed_on_base,
    read_adapter,
)
from difftune.adapters.kohya import family_to_kohya, kohya_metadata, split_adapter_key
from difftune.adapters.trained import adapter_scale, adapter_state_dict
from difftune.config import Config, ModelConfig, upgrade_moved_keys
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, family_of, load_components
from difftune.families.common.drawing import sampling_scheduler
from difftune.families.common.family import Family
from difftune.families.common.targets import AdapterFile
from difftune.files import open_safetensors, refuse_folder_target, replace_atomically
from difftune.models.components import Components, quiet_loading
from difftune.models.dtypes import DTYPES, PartDtypes

ADAPTER_FILE = LORA_WEIGHT_NAME_SAFE  # the name `pipeline.load_lora_weights(output_dir)` looks for
FULL_MODEL_DIR = "model"
CONTROLNET_DIR = "controlnet"  # a ControlNet run's folder, as diffusers' ControlNet scripts name theirs
CONTROLNET_CONFIG = "difftune_config.toml"  # the run's config, beside the ControlNet's own config.json
SINGLE_FILE = "model.safetensors"
FORMATS = ("diffusers", "kohya")
FOLDED_ALPHA_KEY = "difftune_folded_alpha"  # the alpha settings a diffusers-layout file has in its tensors


def trained_path(config: Config, output_dir: Path, variant: str = "") -> Path:
    """Where a run's result goes: `variant` is "" (raw weights), "_ema", "_avg", or "_best" / "_best_eval" (the
    lowest validation loss / highest judged score so far). An adapter's is its `export.format` file."""
    return variant_of(result_path(config.adapter.kind_type, config, Path(output_dir)), variant)


def result_files(config: Config, output_dir: Path) -> list[Path]:
    """The files (or full-model folder) a finished run's result is: an adapter's `trained_path`, or the files its
    family writes of it (one per Wan 2.2 expert, `Family.adapter_file_suffixes`)."""
    path = trained_path(config, output_dir)
    if not config.adapter.is_adapter:
        return [path]
    return [variant_of(path, suffix) for suffix in family_of(config.model).targets.adapter_file_suffixes(config)]


@singledispatch
def result_path(kind: AdapterKind, config: Config, output_dir: Path) -> Path:
    raise NotImplementedError(f"{kind}: where its result goes")


@result_path.register
def _(kind: PeftAdapter, config: Config, output_dir: Path) -> Path:
    return layout_path(output_dir, config.export.format)


@result_path.register
def _(kind: FullFineTune, config: Config, output_dir: Path) -> Path:
    return output_dir / FULL_MODEL_DIR


@result_path.register
def _(kind: TokenEmbedding, config: Config, output_dir: Path) -> Path:
    return output_dir / f"{embedding_file_name(config.adapter)}.safetensors"


@result_path.register
def _(kind: ControlNet, config: Config, output_dir: Path) -> Path:
    return output_dir / CONTROLNET_DIR


def layout_path(output_dir: Path, layout: str, variant: str = "") -> Path:
    """An adapter file of a run in `layout`: the diffusers layout under the name `load_lora_weights(folder)` looks
    for; the kohya layout, the one ComfyUI, A1111 and kohya read, named after the run, as kohya's and the other
    trainers' files are (the name those tools list it by)."""
    stem = ADAPTER_FILE.removesuffix(".safetensors") if layout == "diffusers" else Path(output_dir).resolve().name
    return variant_of(Path(output_dir) / f"{stem}.safetensors", variant)


def other_layout(layout: str) -> str:
    return next(other for other in FORMATS if other != layout)


def variant_of(path: Path, variant: str) -> Path:
    """The `_ema` / `_avg` sibling of a run's result: `pytorch_lora_weights.safetensors` -> `..._ema.safetensors`."""
    return path.with_name(f"{path.stem}{variant}{path.suffix}")


def save_trained(components: Components, config: Config, path: Path, layout: str | None = None) -> Path:
    """The adapter file (in `layout`, default `export.format`); a full fine-tune's complete diffusers pipeline
    folder; an embedding's textual-inversion file."""
    return save_kind(config.adapter.kind_type, components, config, path, layout or config.export.format)


@singledispatch
def save_kind(kind: AdapterKind, components: Components, config: Config, path: Path, layout: str) -> Path:
    raise NotImplementedError(f"{kind}: how its result is saved")


@save_kind.register
def _(kind: PeftAdapter, components: Components, config: Config, path: Path, layout: str) -> Path:
    """The adapter file; where the family writes several (`adapter_files`), each beside `path` with its suffix, and
    the first returned."""
    return write_adapter_files(result_adapters(components, config), path, layout, components.family)[0]


def result_adapters(components: Components, config: Config) -> list[AdapterFile]:
    """The trained adapter as the files a run writes of it (`Family.adapter_files`: one, or one per expert)."""
    tensors, lora_configs = adapter_state_dict(components, config.adapter)
    return components.family.targets.adapter_files(tensors, lora_configs, config)


def write_adapter_files(files: list[AdapterFile], path: Path, layout: str, family: Family) -> list[Path]:
    """Each of a run's adapter files at `path` with its suffix (`_high_noise`...), in `layout`."""
    return [
        write_adapter(
            variant_of(path, file.suffix), file.tensors, file.lora_configs, file.config.to_toml(), layout, family
        )
        for file in files
    ]


@save_kind.register
def _(kind: FullFineTune, components: Components, config: Config, path: Path, layout: str) -> Path:
    pipeline = components.pipeline(sampling_scheduler(config.sample.scheduler, components))
    _refuse_non_finite(components.denoiser.state_dict(), f"{path}")
    return replace_atomically(path, lambda staging: components.family.loading.save_pipeline(pipeline, staging))


@save_kind.register
def _(kind: TokenEmbedding, components: Components, config: Config, path: Path, layout: str) -> Path:
    # One layout: the one every tool reads.
    return write_embedding(path, components, config.adapter, {CONFIG_METADATA_KEY: config.to_toml()})


@save_kind.register
def _(kind: ControlNet, components: Components, config: Config, path: Path, layout: str) -> Path:
    # The ControlNet's diffusers folder (config.json and its safetensors), as `ControlNetModel.from_pretrained` and
    # ComfyUI's ControlNet loader read it; the run's config beside it says what it was trained on.
    _refuse_non_finite(components.controlnet.state_dict(), f"{path}")

    def write(staging: Path) -> None:
        components.controlnet.save_pretrained(staging, safe_serialization=True)
        (staging / CONTROLNET_CONFIG).write_text(config.to_toml(), encoding="utf-8")

    return replace_atomically(path, write)


def save_adapter_layouts(
    components: Components, config: Config, output_dir: Path, variant: str = ""
) -> dict[str, list[Path] | str]:
    """An adapter run's result in both layouts, whichever `export.format` chose (it names the primary file): one for
    diffusers and peft, one for ComfyUI, A1111 and kohya, so the folder holds a file each tool applies (ComfyUI maps
    none of a Wan file's diffusers keys). {layout: its files (one, or one per expert: `Family.adapter_files`), or why
    the layout cannot hold this adapter (LoHa/LoKr on a family whose kohya layout fuses q, k and v)}; the primary
    layout must be written."""
    files = result_adapters(components, config)
    written: dict[str, list[Path] | str] = {}
    for layout in (config.export.format, other_layout(config.export.format)):
        if layout == "kohya" and config.adapter.control_input:  # refused as export.format by the config
            written[layout] = (
                "a control LoRA's widened input layer has no kohya layout (diffusers' Flux LoRA loader widens the base "
                "as it reads the diffusers file)"
            )
            continue
        path = layout_path(output_dir, layout, variant)
        try:
            written[layout] = write_adapter_files(files, path, layout, components.family)
        except DifftuneError as err:
            if layout == config.export.format:
                raise
            written[layout] = str(err)
    return written


def save_result_files(
    components: Components, config: Config, output_dir: Path, variant: str = ""
) -> dict[str, list[Path] | str]:
    """What a run saves as its result: an adapter in both layouts (`save_adapter_layouts`), else its one full model
    folder ("model"), embedding file ("embedding") or ControlNet folder ("controlnet"), by what `where_files_go` calls
    them."""
    if config.adapter.is_adapter:
        return save_adapter_layouts(components, config, output_dir, variant)
    label = config.adapter.kind_type.result_label
    return {label: [save_trained(components, config, trained_path(config, output_dir, variant))]}


# What each kind of result file is for, by the name `save_result_files` gives it.
FILE_USES = {
    "diffusers": "diffusers and peft (`pipeline.load_lora_weights`), difftune sample / merge",
    "kohya": "ComfyUI (its models/loras folder), A1111 / Forge, kohya",
    "model": "a diffusers pipeline folder (`from_pretrained`), difftune sample",
    "embedding": "A1111, ComfyUI (its models/embeddings folder) and diffusers (`load_textual_inversion`)",
    "controlnet": "the family's diffusers ControlNet pipeline (`ControlNetModel.from_pretrained`), difftune sample",
}


def where_files_go(files: dict[str, list[Path] | str]) -> list[str]:
    """The run's last lines: which of its files goes to which tool."""
    lines = []
    for layout, written in files.items():
        if isinstance(written, str):
            lines.append(f"no {layout}-layout file: {written}")
        else:
            lines.append(f"wrote {' and '.join(str(file) for file in written)}: for {FILE_USES[layout]}")
    return lines


def check_layout(components: Components, config: Config) -> None:
    """Before training: the freshly attached adapter can be written in `export.format`, so a run cannot end
    unable to save what it trained (the kohya Flux layout fuses modules that must be adapted together)."""
    if config.adapter.is_adapter and config.export.format == "kohya":
        for file in result_adapters(components, config):
            try:
                family_to_kohya(components.family, file.tensors, file.lora_configs)
            except ValueError as err:
                raise DifftuneError(f'export.format = "kohya": {err}') from None


def write_adapter(
    path: Path,
    tensors: dict,
    lora_configs: dict,
    config_toml: str,
    layout: str,
    family: Family | None = None,
    base: str = "",
) -> Path:
    """Write an adapter file; a NaN or inf tensor is refused before anything is written. `family` gives the kohya
    layout's prefixes (default: `adapter_family`); `base` names the base model in a kohya file's metadata when
    there is no difftune config (an adapter from another tool)."""
    refuse_folder_target(path)
    _refuse_non_finite(tensors, f"adapter {path}")
    metadata = {"format": "pt"}
    if config_toml:
        metadata[CONFIG_METADATA_KEY] = config_toml
    if layout == "kohya":
        family = family or adapter_family(lora_configs, config_toml, base)
        try:
            tensors = family_to_kohya(family, tensors, lora_configs)
        except ValueError as err:
            raise DifftuneError(f"adapter {path}: {err}") from None
        version = family.layout.base_model_version(_adapter_base(config_toml, base))
        metadata.update(kohya_metadata(config_toml, lora_configs, base, version))
    else:
        tensors, lora_configs, folded = folded_alpha(tensors, lora_configs)
        metadata[LORA_ADAPTER_METADATA_KEY] = json.dumps(lora_configs, sort_keys=True)
        if folded:
            metadata[FOLDED_ALPHA_KEY] = json.dumps(folded, sort_keys=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    return replace_atomically(path, lambda staging: save_file(tensors, staging, metadata=metadata))


def folded_alpha(tensors: dict, lora_configs: dict) -> tuple[dict, dict, dict]:
    """A LoRA / DoRA whose scale (alpha / rank, or alpha / sqrt(rank) with rsLoRA) is not 1 has it multiplied into
    its `lora_B`, and its config says alpha = rank: the diffusers layout holds alpha only in its metadata, which
    ComfyUI and A1111 do not read (they applied a rank-8 alpha-4 Qwen-Image LoRA at 2x), so the file's tensors must
    mean the change alone. DoRA's direction is the same either way, and diffusers applies both files alike. The
    tensors, the configs, and per folded part the alpha settings folded in (recorded in the file). LoHa / LoKr keep
    theirs: no reader but peft (difftune's) takes them in this layout, and it reads the metadata."""
    tensors, lora_configs, folded = dict(tensors), dict(lora_configs), {}
    for part in parts_of(tensors):
        if not file_kind(lora_configs, part).scaled_product:
            continue
        ranks = {
            module: value.shape[0]
            for key, value in tensors.items()
            if key.startswith(f"{part}.")
            for module, kind in [split_adapter_key(key.partition(".")[2])]
            if kind == "lora_A.weight"
        }
        scales = {module: adapter_scale(lora_configs, part, module, rank) for module, rank in ranks.items()}
        if all(scale == 1 for scale in scales.values()):
            continue
        for module, scale in scales.items():
            key = f"{part}.{module}.lora_B.weight"
            tensors[key] = tensors[key] * scale
        folded[part] = {
            field: lora_configs.get(f"{part}.{field}") for field in ("lora_alpha", "alpha_pattern", "use_rslora")
        }
        lora_configs |= {
            f"{part}.lora_alpha": lora_configs[f"{part}.r"],
            f"{part}.use_rslora": False,
            f"{part}.alpha_pattern": dict(lora_configs.get(f"{part}.rank_pattern") or {}),
        }
    return tensors, lora_configs, folded


def adapter_family(lora_configs: dict, config_toml: str, base: str = "") -> Family:
    """The family an adapter is for: its `base`'s when given, the one its difftune config records, else the
    smallest family with all its parts (a UNet-only file is named alike by SD and SDXL: SD's layout is taken)."""
    model = _adapter_base(config_toml, base)
    if model:
        return family_of(model)
    parts = {key.rsplit(".", 1)[0] for key in lora_configs if key.endswith(".r")}
    return min(
        (family for family in FAMILIES.values() if parts <= set(family.targets.parts())), key=lambda f: len(f.parts())
    )


def _adapter_base(config_toml: str, base: str = "") -> ModelConfig | None:
    """The base an adapter is for: `base` when given, else the one its difftune config records (None: unknown)."""
    if base:
        return ModelConfig(base=base)
    if config_toml:
        return ModelConfig.model_validate(upgrade_moved_keys(tomllib.loads(config_toml))["model"])
    return None


def read_any_adapter(path: Path, base: str | None = None) -> tuple[dict, dict, str]:
    """`adapter_files.read_adapter`, with a kohya file's module names from loading `base`, else the base its
    metadata names."""

    def base_modules(metadata: dict[str, str]):
        name = base or _kohya_base_name(metadata)
        if not name:
            raise DifftuneError(f"adapter {path}: a kohya-layout file needs --base (the model it was trained on)")
        return module_names_of(load_components(ModelConfig(base=name)))

    return read_adapter(path, base_modules)


def _kohya_base_name(metadata: dict[str, str]) -> str:
    """The base a kohya file was trained on: difftune's own config in it names it in full (kohya's
    `ss_sd_model_name` holds only a local base's folder name), else `ss_sd_model_name`."""
    if CONFIG_METADATA_KEY in metadata:
        return tomllib.loads(metadata[CONFIG_METADATA_KEY])["model"]["base"]
    return metadata.get("ss_sd_model_name", "")


def convert_adapter(source: Path, target: Path, layout: str, base: str | None = None) -> Path:
    """Rewrite an adapter file (any tool's) in difftune's diffusers or kohya layout; the tensors are unchanged,
    so difftune layout -> other -> back is lossless."""
    if layout not in FORMATS:
        raise DifftuneError(f"--to {layout}: allowed: {', '.join(FORMATS)}")
    tensors, lora_configs, config_toml = read_any_adapter(source, base)
    target.parent.mkdir(parents=True, exist_ok=True)
    return write_adapter(target, tensors, lora_configs, config_toml, layout, base=base or "")


AVERAGE_WEIGHTS = {
    "uniform": lambda n: [1.0] * n,
    "linear": lambda n: [float(i + 1) for i in range(n)],
    "exponential": lambda n: [2.0**i for i in range(n)],
}


def average_adapters(paths: list[Path], weighting: str = "uniform", base: str | None = None) -> tuple[dict, dict, str]:
    """The weighted mean of adapter files, tensor by tensor (later files weigh more under linear/exponential).

    Each tensor is averaged on its own: lora_A, lora_B and, for DoRA, the magnitude. The result is a valid
    adapter of the same rank and kind (a mean of positive magnitudes stays positive, so DoRA loads). For
    snapshots of one run this approximates averaging the weights; it is not the mean of the products
    B @ A, which would need a higher rank (merge each into the base and average the merged models for that).
    """
    if len(paths) < 2:
        raise DifftuneError("averaging needs at least two adapter files")
    adapters = [read_any_adapter(path, base) for path in paths]
    first_tensors, first_configs, _ = adapters[0]
    for path, (tensors, configs, _) in zip(paths[1:], adapters[1:], strict=True):
        mismatched = [k for k in first_tensors if k not in tensors or tensors[k].shape != first_tensors[k].shape]
        if mismatched or tensors.keys() != first_tensors.keys():
            raise DifftuneError(
                f"adapter {path}: its tensors differ from {paths[0]} (first: {(mismatched or ['?'])[0]})"
            )
        for field in [key for key in first_configs if key.endswith((".r", ".lora_alpha", ".use_dora"))]:
            if configs.get(field) != first_configs.get(field):
                raise DifftuneError(
                    f"adapter {path}: {field} = {configs.get(field)} but {paths[0]} has {first_configs.get(field)}"
                )
    weights = AVERAGE_WEIGHTS[weighting](len(paths))
    total = sum(weights)
    averaged = {
        key: sum(
            w / total * tensors[key].double() for w, (tensors, _, _) in zip(weights, adapters, strict=True)
        ).float()
        for key in first_tensors
    }
    return averaged, first_configs, adapters[-1][2]


def is_controlnet_folder(path: Path) -> bool:
    """A diffusers ControlNet folder (a ControlNet run's result): its config.json names a ControlNet model class."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("_class_name", "").endswith("ControlNetModel")
    except (ValueError, AttributeError):
        return False


def load_controlnet(components: Components, path: Path, scale: float = 1.0) -> None:
    """A ControlNet folder read beside the base (`components.controlnet`): it draws through the family's ControlNet
    pipeline, from each prompt's control image."""
    family = components.family
    if family.controlnet is None:
        raise DifftuneError(f"{path}: a ControlNet, and {family.description} bases have none difftune draws with")
    if components.controlnet is not None:
        raise DifftuneError(f"{path}: a second ControlNet; difftune draws with one at a time")
    if scale != 1.0:
        raise DifftuneError(f"{path}: a ControlNet is drawn at its full strength; give it no scale (got {scale})")
    with quiet_loading():
        components.controlnet = family.controlnet.model_class.from_pretrained(path).eval()


def apply_adapters(components: Components, adapters: list[tuple[Path, float]]) -> None:
    """Attach adapter files (either layout) to the denoiser / text encoders with their scales; textual-inversion
    files teach the tokenizers and text encoders their token; a ControlNet folder joins the components.

    Each is read by `adapter_files` (any tool's layout), checked against the model's modules, and handed to
    diffusers' own loader in the diffusers layout with its peft config: diffusers' kohya reader would keep
    `dora_scale`'s shape, which peft then rejects, and it drops keys of modules the model lacks with a log line.
    LoHa and LoKr files are attached with peft (diffusers' loader reads LoRA only), under the same adapter names, so
    `set_adapters` scales and `fuse_lora` merges them all alike.
    """
    controlnets = [(path, scale) for path, scale in adapters if is_controlnet_folder(path)]
    for path, scale in controlnets:
        load_controlnet(components, path, scale)
    adapters = [adapter for adapter in adapters if adapter not in controlnets]
    embeddings = [path for path, _ in adapters if is_embedding_file(path)]
    for path in embeddings:  # a token's vectors have no scale
        load_embedding(components, path)
    adapters = [(path, scale) for path, scale in adapters if path not in embeddings]
    if not adapters:
        return
    pipeline = components.pipeline()
    modules = module_names_of(components)
    names = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (path, _) in enumerate(adapters):
            tensors, lora_configs, config_toml = read_adapter(path, lambda metadata: modules)
            tensors = placed_on_base(tensors, modules, path)
            _refuse_misshapen(components, tensors, path)
            _refuse_unloadable_parts(tensors, components.family, path)
            _refuse_non_finite(tensors, f"adapter {path}")
            names.append(f"adapter_{i}")
            if any(isinstance(file_kind(lora_configs, part), LyCORIS) for part in parts_of(tensors)):
                _attach_lycoris(components, tensors, lora_configs, names[-1], path)
                continue
            staged = write_adapter(
                Path(tmp) / f"{names[-1]}.safetensors",
                tensors,
                lora_configs,
                config_toml,
                "diffusers",
                components.family,
            )
            with quiet_loading():
                pipeline.load_lora_weights(
                    tmp,
                    weight_name=staged.name,
                    adapter_name=names[-1],
                    **components.family.targets.lora_loading_arguments(_file_placement(components, config_toml)),
                )
    pipeline.set_adapters(names, adapter_weights=[scale for _, scale in adapters])
    if components.family.drawing.reads_input_control(components):  # a control LoRA widened the input layer as it loaded
        components.family.input_control.widen(components.denoiser)  # its config says so too (merged folders)


def _attach_lycoris(components: Components, tensors: dict, lora_configs: dict, name: str, path: Path) -> None:
    """A LoHa / LoKr file's parts, each injected by peft from its config (rank and alpha per module: the scale), with
    every module's factors then put in as the file has them.

    peft shapes a LoKr's factors by its own factorization of the layer, which knows no per-module factor and differs
    from LyCORIS's for some layers (`factor` near a side's size) and kinds (Tucker without `use_effective_conv2d`),
    while its forward and merge only ask which factors a module has: the file's factors, placed as they are, give the
    change LyCORIS, ComfyUI and A1111 compute, for every variant LyCORIS writes."""
    from peft.tuners.lycoris_utils import LycorisLayer

    parts = components.parts()
    for part in parts_of(tensors):
        prefix = f"{part}."
        config_class = file_kind(lora_configs, part).peft_config_class()
        known = set(config_class.__dataclass_fields__) - {"peft_type", "task_type"}  # set by the class itself
        fields = {key.removeprefix(prefix): value for key, value in lora_configs.items() if key.startswith(prefix)}
        parts[part].add_adapter(
            config_class(**{key: value for key, value in fields.items() if key in known}), adapter_name=name
        )
        factors: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            if key.startswith(prefix):
                module, kind = split_adapter_key(key.removeprefix(prefix))
                factors.setdefault(module, {})[kind] = value
        for module, found in factors.items():
            layer = parts[part].get_submodule(module)
            if not isinstance(layer, LycorisLayer):
                raise DifftuneError(
                    f"adapter {path}: {part} has no place for {module}'s "
                    f"{', '.join(found)}; is this adapter for this model?"
                )
            weight = layer.get_base_layer().weight
            for kind in layer.adapter_layer_names:
                if name in getattr(layer, kind):
                    del getattr(layer, kind)[name]
            for kind, value in found.items():
                getattr(layer, kind)[name] = torch.nn.Parameter(
                    value.to(weight.device, weight.dtype), requires_grad=False
                )


def base_for_adapters(base: str, adapters: list[tuple[Path, float]]) -> ModelConfig:
    """`base` as `adapters` need it loaded: with the family options a difftune file keeps (`recorded_options`: a Wan
    2.2 expert's file onto that expert, an ACE-Step file's sounds as long as it trained them), as its config has them;
    files for different parts load together where the family has a setting that holds both (`combined_option`:
    one file per Wan 2.2 expert), else are refused by name. Other tools' files record none (the family's default)."""
    config = ModelConfig(base=base)
    family = family_of(config)
    recorded: dict[str, dict[object, Path]] = {}
    for path, _ in adapters if family.targets.recorded_options else ():
        with open_safetensors(Path(path)) as handle:
            options = _recorded_options((handle.metadata() or {}).get(CONFIG_METADATA_KEY, ""))
        for name in family.targets.recorded_options:
            if name in options:
                recorded.setdefault(name, {}).setdefault(options[name], path)
    chosen = {}
    for name, values in recorded.items():
        chosen[name] = next(iter(values)) if len(values) == 1 else family.targets.combined_option(name, set(values))
        if chosen[name] is None:
            (first, value), (second, other) = [(path, value) for value, path in values.items()][:2]
            raise DifftuneError(
                f"adapters {first} and {second} were trained with model.family_options.{name} = {value!r} and "
                f"{other!r}: they go on different parts; load them one at a time"
            )
    return config.model_copy(update={"family_options": chosen})


def _recorded_options(config_toml: str) -> dict:
    """The family options a difftune file's recorded config has (none for other tools' files)."""
    return tomllib.loads(config_toml).get("model", {}).get("family_options", {}) if config_toml else {}


def _file_placement(components: Components, config_toml: str):
    """The family options a file keeps (`recorded_options`: a Wan 2.2 expert's file onto that expert), as it records
    them, else as the components were loaded."""
    recorded = _recorded_options(config_toml)
    placed = {name: recorded[name] for name in components.family.targets.recorded_options if name in recorded}
    return components.family_options.model_copy(update=placed) if placed else components.family_options


def load_with_adapters(
    base: str, adapters: list[tuple[Path, float]], dtype: torch.dtype = torch.float32, options: dict | None = None
) -> Components:
    """A base model with scaled adapters attached, on CUDA when there is one, ready to sample (the CLI's and UI's
    `sample`; `components.denoiser.device` says where), every part loaded in `dtype` (a KL autoencoder in fp32 under
    fp16, where SD's overflow); `options`: family options over those the adapters recorded (a sound's seconds)."""
    vae = torch.float32 if dtype == torch.float16 else dtype
    config = base_for_adapters(base, adapters)
    if options:
        config = config.model_copy(update={"family_options": {**config.family_options, **options}})
    components = load_components(config, PartDtypes(denoiser=dtype, vae=vae, others=dtype))
    if adapters:
        apply_adapters(components, adapters)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for module in components.modules():
        module.to(device).eval()
    return components


def merge_into_folder(
    base: str,
    adapters: list[tuple[Path, float]],
    out_dir: Path,
    dtype: str = "fp32",
    single_file: bool = False,
    overwrite: bool = False,
) -> list[Path]:
    """Load the base, fold the adapters in and save the whole pipeline (the CLI's and UI's `merge`)."""
    components = load_components(base_for_adapters(base, adapters))
    merge_adapters(components, adapters, dtype)
    return save_merged(components, out_dir, single_file, overwrite)


def merge_adapters(components: Components, adapters: list[tuple[Path, float]], dtype: str = "fp32") -> None:
    """Fold the scaled adapters into the base weights (peft's merge: exact for LoRA and DoRA). With none, the
    base is only cast: a merge without adapters converts a model (to a single file, or another dtype)."""
    if adapters:
        apply_adapters(components, adapters)
        pipeline = components.pipeline()
        family = components.family
        parts = [  # as the pipeline names them
            *family.drawing.denoiser_pipeline_parts(components),
            *(part for part in family.targets.adapter_parts() if part != family.denoiser_name),
        ]
        pipeline.fuse_lora(components=parts, lora_scale=1.0)
        pipeline.unload_lora_weights()
    for module in components.modules():
        # torch's cast: diffusers' own `to` warns at every cast to a dtype, even of a model with no module to keep in
        # float32 (the merge printed that twice); a merged base is never quantized, the case its `to` checks.
        torch.nn.Module.to(module, DTYPES[dtype])
        _refuse_non_finite(module.state_dict(), f"the merged model in {dtype}")


def save_merged(components: Components, out_dir: Path, single_file: bool, overwrite: bool = False) -> list[Path]:
    """A complete diffusers pipeline folder (and, on request, `model.safetensors` in the family's original
    single-file layout inside it). Written to a temporary folder first and moved into place whole."""
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise DifftuneError(
            f"{out_dir}: already exists and is not empty; choose another folder, or replace it (the CLI's --overwrite, "
            'the UI\'s "Replace an existing folder")'
        )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # The single file's keys first: a family without that layout refuses before anything is written.
    ldm = (
        {key: value.contiguous() for key, value in components.family.layout.to_single_file(components).items()}
        if single_file
        else {}
    )

    def write(staging: Path) -> None:
        with quiet_loading():  # no "Writing model shards" bar per part: the merge's own line says what it does
            components.family.loading.save_pipeline(
                components.pipeline(sampling_scheduler("auto", components)), staging
            )
        if single_file:
            save_file(ldm, staging / SINGLE_FILE, metadata={"format": "pt"})

    replace_atomically(out_dir, write)
    return [out_dir, out_dir / SINGLE_FILE] if single_file else [out_dir]


def _refuse_misshapen(components: Components, tensors: dict, path: Path) -> None:
    """A LoRA whose factors do not fit the base's layers (one made for another model of the same family's names: an
    SD 1.x LoRA onto SDXL) is refused by its first such layer, before peft's "size mismatch" traceback."""
    parts, control = components.parts(), components.family.input_control
    widened = control.input_layer if control else None  # a control LoRA widens it as diffusers' loader reads it
    for key, value in tensors.items():
        part, _, rest = key.partition(".")
        module, kind = split_adapter_key(rest)
        if kind not in ("lora_A.weight", "lora_B.weight") or (
            part == components.family.denoiser_name and module == widened
        ):
            continue
        try:
            layer = parts[part].get_submodule(module)
        except AttributeError:  # a denoiser of parts (Wan 2.2's experts together): its loader places them
            continue
        side, named, size = (
            ("in", "input", value.shape[1]) if kind == "lora_A.weight" else ("out", "output", value.shape[0])
        )
        # A layer's own widths (a quantized weight's shape is its storage's, not the layer's)
        width = getattr(layer, f"{side}_features", None) or getattr(layer, f"{side}_channels", None)
        if width is not None and width != size:
            raise DifftuneError(
                f"adapter {path}: {part}.{module} takes {size} {named} features in the file and {width} in the base; "
                "the adapter was made for another model than this base"
            )


def _refuse_unloadable_parts(tensors: dict, family: Family, path: Path) -> None:
    """A part diffusers' loader of this family would drop without a word (Flux's T5) stops the load instead."""
    loadable = family.targets.adapter_parts()
    unloadable = sorted({key.partition(".")[0] for key in tensors} - set(loadable))
    if unloadable:
        raise DifftuneError(
            f"adapter {path}: has weights for {', '.join(unloadable)}, which "
            f"{family.description} pipelines do not load adapters into (they read "
            f"{', '.join(loadable)}); merge that part into the base with the tool that made it"
        )


def _refuse_non_finite(tensors: dict, what: str) -> None:
    bad = [key for key, value in tensors.items() if value.is_floating_point() and not torch.isfinite(value).all()]
    if bad:
        raise DifftuneError(f"{what}: NaN or inf in {len(bad)} tensors (first: {bad[0]}); nothing was written")
