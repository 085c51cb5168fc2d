"""What is trained: LoRA / DoRA / LoHa / LoKr adapters injected by peft, all weights (`kind = "none"`), or new
token embeddings (`kind = "embedding"`, embeddings.py).

Parts are the family's: its denoiser and, with `adapter.text_encoder`, each text encoder, named as diffusers
names them (`unet`, `text_encoder`, `text_encoder_2`). A trained parameter's name is `<part>.<name in part>`.

PiSSA and OLoRA start each adapter from the base weight's principal (SVD) or QR factors and take them out of the
base, so the base in memory is no longer the base users have. What is saved is therefore the change from the
start, B A - B0 A0, as a LoRA of twice the rank on the untouched base ([B, -B0] and [A; A0]; peft's
`path_initial_model_for_weight_conversion` does the same): every loader reads it as a plain LoRA.
"""

from __future__ import annotations

import torch
from peft import LoHaConfig, LoKrConfig, LoraConfig, PeftConfig
from peft.utils import get_peft_model_state_dict

from difftune.adapters.embeddings import add_tokens
from difftune.adapters.targets import layer_suffixes, missing_targets, unmatched_targets
from difftune.config import AdapterConfig
from difftune.errors import DifftuneError
from difftune.memory.storage import casts_reused
from difftune.models.parts import Components

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
LYCORIS_CONFIGS = {"loha": LoHaConfig, "lokr": LoKrConfig}  # adapter.kind (and `adapter_kind`) -> its peft config
MUTATED_BASE_INITS = ("pissa", "olora")  # adapter inits that change the base weights (see the module's docstring)
INITIAL_ADAPTER = "_difftune_initial_adapter"  # a part's adapter tensors as initialized, for those inits


def trained_parts(components: Components, config: AdapterConfig) -> dict[str, torch.nn.Module]:
    """The parts `config` trains, by name: the denoiser, and with `adapter.text_encoder` the family's adapted text
    encoders (its fine-tuned ones in a full fine-tune); an embedding's text encoders alone."""
    parts, family = components.parts(), components.family
    if config.kind == "embedding":
        names = family.text_encoder_names
    elif not config.text_encoder:
        names = (family.denoiser_name,)
    elif config.kind == "none":
        names = (family.denoiser_name, *family.fine_tuned_text_encoders())
    else:
        names = family.adapter_parts()
    return {name: parts[name] for name in names}


def target_modules(components: Components, config: AdapterConfig) -> dict[str, list[str]]:
    """Each trained part's adapter targets: the config's list (`target_modules` for the denoiser,
    `text_encoder_targets` by part for the text encoders), or the family's default where there is none."""
    family = components.family
    configured = {family.denoiser_name: config.target_modules, **config.text_encoder_targets}
    parts = components.parts()
    return {
        part: configured.get(part) or family.targets_of(part, parts[part]) for part in trained_parts(components, config)
    }


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
        if part not in family.adapted_text_encoders():
            adapted = ", ".join(family.adapted_text_encoders()) or "none: its adapters are the denoiser's alone"
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
    trained = trained_parts(components, config)
    if config.kind == "none":
        for module in trained.values():
            module.requires_grad_(True)
        return
    if config.kind == "embedding":
        add_tokens(components, config)
        return
    check_targets(components, config)
    for part, targets in target_modules(components, config).items():
        with casts_reused():  # the denoiser's layers may be stored in fewer bits already (storage.py)
            trained[part].add_adapter(_adapter_config(config, targets))
        if config.init in MUTATED_BASE_INITS:
            setattr(trained[part], INITIAL_ADAPTER, _peft_state(trained[part]))


def _adapter_config(config: AdapterConfig, targets: list[str]) -> PeftConfig:
    if config.kind in LYCORIS_CONFIGS:
        # LyCORIS's defaults, as peft has them: no Tucker decomposition of convolutions (ComfyUI and A1111 read it, but
        # the plain form is what every loader reads), LoKr's factor chosen from the layer's shape.
        return LYCORIS_CONFIGS[config.kind](
            r=config.rank, alpha=config.alpha, rank_dropout=config.dropout, target_modules=targets
        )
    return LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=targets,
        use_dora=config.kind == "dora",
        use_rslora=config.rank_stabilized,
        # gaussian: A ~ N(0, 1/r), B = 0, so the adapter starts as the identity, as in diffusers' LoRA scripts.
        init_lora_weights=config.init,
    )


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


def adapter_kind(lora_configs: dict, part: str) -> str:
    """A part's adapter kind in an adapter file's configs: "lora" (DoRA included), "loha" or "lokr"."""
    return str(lora_configs.get(f"{part}.peft_type", "LORA")).rsplit(".", 1)[-1].lower()


def config_alpha(lora_configs: dict, part: str, module: str | None = None) -> float:
    """A part's alpha (a module's, given one): peft calls it `lora_alpha` in a LoRA's config, `alpha` in LyCORIS's."""
    key = "lora_alpha" if adapter_kind(lora_configs, part) == "lora" else "alpha"
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
