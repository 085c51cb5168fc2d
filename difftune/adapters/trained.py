"""What a run trains, by the type of its adapter kind (adapter_kinds.py): adapters injected by peft (LoRA, DoRA,
LoHa, LoKr), all weights of its parts (a full fine-tune), or new token embeddings (embeddings.py). Each job a kind
does differently is one `functools.singledispatch` function with one implementation per type: the kinds' types sit
below the config, which checks their problems before torch is loaded, and what they do to a model sits here.

Parts are the family's: its denoiser and, with `adapter.text_encoder`, each text encoder, named as diffusers names
them (`unet`, `text_encoder`, `text_encoder_2`), or a ControlNet (`controlnet`) built beside the denoiser. A trained
parameter's name is `<part>.<name in part>`.

PiSSA and OLoRA start each adapter from the base weight's principal (SVD) or QR factors and take them out of the
base, so the base in memory is no longer the base users have. What is saved is therefore the change from the
start, B A - B0 A0, as a LoRA of twice the rank on the untouched base ([B, -B0] and [A; A0]; peft's
`path_initial_model_for_weight_conversion` does the same): every loader reads it as a plain LoRA.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import singledispatch

import torch
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict

from difftune.adapter_kinds import AdapterKind, ControlNet, FullFineTune, PeftAdapter, TokenEmbedding, file_kind
from difftune.adapters.embeddings import add_tokens
from difftune.adapters.targets import layer_suffixes, missing_targets, unmatched_targets
from difftune.config import AdapterConfig
from difftune.errors import DifftuneError
from difftune.memory.storage import casts_reused
from difftune.models.components import Components

DORA_MAGNITUDE = "lora_magnitude_vector"
# LoHa's and LoKr's tensors: the same names in peft's state dicts and in LyCORIS files.
LYCORIS_TENSORS = (
    "hada_w1_a",
    "hada_w1_b",
    "hada_w2_a",
    "hada_w2_b",
    "hada_t1",
    "hada_t2",
    "lokr_w1",
    "lokr_w1_a",
    "lokr_w1_b",
    "lokr_w2",
    "lokr_w2_a",
    "lokr_w2_b",
    "lokr_t2",
)
INITIAL_ADAPTER = "_difftune_initial_adapter"  # a part's adapter tensors as initialized, where it rewrote the base


def trained_parts(components: Components, config: AdapterConfig) -> dict[str, torch.nn.Module]:
    """The parts `config` trains, by name: the denoiser, and with `adapter.text_encoder` the family's adapted text
    encoders (its fine-tuned ones in a full fine-tune); an embedding's text encoders alone."""
    parts = components.parts()
    return {name: parts[name] for name in trained_part_names(config.kind_type, components.family, config)}


@singledispatch
def trained_part_names(kind: AdapterKind, family, config: AdapterConfig) -> tuple[str, ...]:
    raise NotImplementedError(f"{kind}: which parts it trains")


@trained_part_names.register
def _(kind: PeftAdapter, family, config: AdapterConfig) -> tuple[str, ...]:
    return family.targets.adapter_parts() if config.text_encoder else (family.denoiser_name,)


@trained_part_names.register
def _(kind: FullFineTune, family, config: AdapterConfig) -> tuple[str, ...]:
    return (family.denoiser_name, *(family.targets.fine_tuned_text_encoders() if config.text_encoder else ()))


@trained_part_names.register
def _(kind: TokenEmbedding, family, config: AdapterConfig) -> tuple[str, ...]:
    return tuple(family.text_encoder_names)


@trained_part_names.register
def _(kind: ControlNet, family, config: AdapterConfig) -> tuple[str, ...]:
    return ("controlnet",)


def target_modules(components: Components, config: AdapterConfig) -> dict[str, list[str]]:
    """Each trained part's adapter targets: the config's list (`target_modules` for the denoiser,
    `text_encoder_targets` by part for the text encoders), or the family's default where there is none."""
    family = components.family
    configured = {family.denoiser_name: config.target_modules, **config.text_encoder_targets}
    targets = {
        part: configured.get(part) or family.targets.adapter_targets(components, part)
        for part in trained_parts(components, config)
    }
    input_layer = family.input_control.input_layer if config.control_input else None
    if input_layer and input_layer not in targets[family.denoiser_name]:  # the widened layer learns the control
        targets[family.denoiser_name] = [*targets[family.denoiser_name], input_layer]
    return targets


def _targets_key(components: Components, part: str) -> str:
    if part == components.family.denoiser_name:
        return "adapter.target_modules"
    return f"adapter.text_encoder_targets.{part}"


def check_targets(components: Components, config: AdapterConfig) -> None:
    """Every configured target names modules of its part (as peft matches them: the name or its `.`-suffix);
    otherwise stop naming the setting and the names its part has."""
    if not config.is_adapter:
        return
    parts, family = components.parts(), components.family
    for part in config.text_encoder_targets:
        if part not in family.targets.adapted_text_encoders():
            adapted = ", ".join(family.targets.adapted_text_encoders()) or "none: its adapters are the denoiser's alone"
            raise DifftuneError(
                f"adapter.text_encoder_targets.{part}: not a text encoder "
                f"{family.description} adapters train; theirs: {adapted}"
            )
    for part, targets in target_modules(components, config).items():
        missing = missing_targets(targets, (name for name, _ in parts[part].named_modules()))
        if missing:
            layers = (
                name
                for name, module in parts[part].named_modules()
                if isinstance(module, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d))
            )
            raise unmatched_targets(_targets_key(components, part), part, missing, layer_suffixes(layers))


def add_adapters(components: Components, config: AdapterConfig) -> None:
    """Freeze the base and attach what `config` trains."""
    for module in components.modules():  # an encoder may be released (its outputs cached)
        module.requires_grad_(False)
    attach(config.kind_type, components, config)


@singledispatch
def attach(kind: AdapterKind, components: Components, config: AdapterConfig) -> None:
    raise NotImplementedError(f"{kind}: how it attaches")


@attach.register
def _(kind: PeftAdapter, components: Components, config: AdapterConfig) -> None:
    if config.control_input:  # a control LoRA's input layer reads the control's latents too
        components.family.input_control.widen(components.denoiser)
    check_targets(components, config)
    trained = trained_parts(components, config)
    for part, targets in target_modules(components, config).items():
        with casts_reused():  # the denoiser's layers may be stored in fewer bits already (storage.py)
            trained[part].add_adapter(kind.peft_config(config, targets))
        if config.rewrites_base:  # see the module's docstring
            setattr(trained[part], INITIAL_ADAPTER, _peft_state(trained[part]))


@attach.register
def _(kind: FullFineTune, components: Components, config: AdapterConfig) -> None:
    for module in trained_parts(components, config).values():
        module.requires_grad_(True)


@attach.register
def _(kind: TokenEmbedding, components: Components, config: AdapterConfig) -> None:
    add_tokens(components, config)


@attach.register
def _(kind: ControlNet, components: Components, config: AdapterConfig) -> None:
    # Built from the denoiser before its frozen weights are cast, stored or offloaded (`place_frozen`), so it starts
    # from the base's own fp32 (or as-loaded) weights.
    components.controlnet = components.family.controlnet.build(components).requires_grad_(True)


def _peft_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    # save_embedding_layers=False: embeddings are never adapted here, and `auto` probes the hub for a config.
    state = get_peft_model_state_dict(module, save_embedding_layers=False)
    # copy=True: on CPU in fp32 `.to` would return the live parameter, which later steps change.
    return {key: value.detach().to("cpu", torch.float32, copy=True).contiguous() for key, value in state.items()}


def _change_from_initial(state: dict[str, torch.Tensor], initial: dict[str, torch.Tensor], configs: dict) -> None:
    """Turn a PiSSA/OLoRA adapter (B A on a base with B0 A0 taken out) into the plain LoRA of its change on the
    untouched base, in place: rank 2r, alpha chosen so the scale stays alpha / r (or alpha / sqrt(r) with rsLoRA)."""
    for key, value in state.items():
        if key.endswith("lora_A.weight"):
            state[key] = torch.cat([value, initial[key]], dim=0)
        elif key.endswith("lora_B.weight"):
            state[key] = torch.cat([value, -initial[key]], dim=1)
    configs["lora_alpha"] *= 2**0.5 if configs.get("use_rslora") else 2
    configs["r"] *= 2
    configs["init_lora_weights"] = True  # a loader must not run PiSSA on the untouched base again


def trainable_parameters(components: Components, config: AdapterConfig) -> dict[str, torch.nn.Parameter]:
    """Every trained parameter under a stable name (`<part>.` + its name in the part)."""
    return {
        f"{part}.{name}": param
        for part, module in trained_parts(components, config).items()
        for name, param in module.named_parameters()
        if param.requires_grad
    }


def adapter_state_dict(components: Components, config: AdapterConfig) -> tuple[dict[str, torch.Tensor], dict]:
    """The trained adapter weights with diffusers' prefixes, and each part's peft config."""
    tensors, lora_configs = {}, {}
    for part, module in trained_parts(components, config).items():
        state = _peft_state(module)
        part_configs = {
            field: sorted(value) if isinstance(value, set) else value
            for field, value in module.peft_config["default"].to_dict().items()
        }
        if hasattr(module, INITIAL_ADAPTER):
            _change_from_initial(state, getattr(module, INITIAL_ADAPTER), part_configs)
        for key, value in state.items():
            if key.endswith(DORA_MAGNITUDE):
                # transformers 5's adapter loader (diffusers' text-encoder path) maps only keys ending in
                # `.weight` and silently drops the bare magnitude key; peft reads both forms.
                key += ".weight"
            tensors[f"{part}.{key}"] = value
        lora_configs |= {f"{part}.{field}": value for field, value in part_configs.items()}
    return tensors, lora_configs


def config_alpha(lora_configs: dict, part: str, module: str | None = None) -> float:
    """A part's alpha (a module's, given one): peft calls it `lora_alpha` in a LoRA's config, `alpha` in LyCORIS's."""
    key = file_kind(lora_configs, part).alpha_key
    pattern = lora_configs.get(f"{part}.alpha_pattern") or {}
    return pattern.get(module, lora_configs[f"{part}.{key}"])


def adapter_scale(lora_configs: dict, part: str, module: str, rank: int) -> float:
    """A module's adapter scale: alpha / rank, or alpha / sqrt(rank) with rsLoRA. kohya files know only the first,
    so an rsLoRA module is written there with the alpha that gives its scale."""
    alpha = config_alpha(lora_configs, part, module)
    return alpha / (rank**0.5 if lora_configs.get(f"{part}.use_rslora") else rank)


def derived_lora_configs(
    ranks: dict[str, dict[str, int]],
    alphas: dict[str, dict[str, float]],
    dora: dict[str, bool],
    lycoris: dict[str, str] | None = None,
    decompose_both: set[str] = frozenset(),
) -> dict:
    """Each part's peft config from what a file without one shows: its modules' ranks, the alphas it stores
    (a module without one gets alpha = rank, diffusers' rule) and whether it has DoRA magnitudes, or which LyCORIS
    kind it is (`lycoris`: part -> peft type; `decompose_both`: LoKr parts with low-rank first factors). The most
    common rank and alpha become `r` and `lora_alpha` (LyCORIS: `alpha`); the others go to `rank_pattern` /
    `alpha_pattern`."""
    lora_configs = {}
    for part, part_ranks in ranks.items():
        rank = max(set(part_ranks.values()), key=list(part_ranks.values()).count)
        part_alphas = {m: alphas.get(part, {}).get(m, float(r)) for m, r in part_ranks.items()}
        alpha = max(set(part_alphas.values()), key=list(part_alphas.values()).count)
        config = {
            "r": rank,
            "target_modules": sorted(part_ranks),
            "rank_pattern": {m: r for m, r in part_ranks.items() if r != rank},
            "alpha_pattern": {m: a for m, a in part_alphas.items() if a != alpha},
        }
        kind = (lycoris or {}).get(part)
        if kind:
            config |= {"peft_type": kind, "alpha": alpha}
            if kind == "LOKR":
                config["decompose_both"] = part in decompose_both
        else:
            config |= {"lora_alpha": alpha, "use_dora": dora.get(part, False)}
        lora_configs.update({f"{part}.{field}": value for field, value in config.items()})
    return lora_configs


@contextmanager
def adapters_switched_off(module: torch.nn.Module) -> Iterator[None]:
    """`module` computes as its base within the block: every adapter layer in it off, each parameter's `requires_grad`
    as it was afterwards (peft's switch sets it)."""
    layers = [layer for layer in module.modules() if isinstance(layer, BaseTunerLayer)]
    trained = {parameter: parameter.requires_grad for layer in layers for parameter in layer.parameters()}
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for parameter, requires_grad in trained.items():
            parameter.requires_grad_(requires_grad)


@contextmanager
def lora_scaled(module: torch.nn.Module, factor: float) -> Iterator[None]:
    """`module`'s LoRA layers at `factor` times their scale within the block (peft's `scale_layer`)."""
    layers = [layer for layer in module.modules() if isinstance(layer, LoraLayer)]
    for layer in layers:
        layer.scale_layer(factor)
    try:
        yield
    finally:
        for layer in layers:
            layer.unscale_layer(factor)
