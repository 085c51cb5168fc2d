"""What is trained: LoRA / DoRA adapters injected by peft, all weights (`kind = "none"`), or new token
embeddings (`kind = "embedding"`, embeddings.py).

Parts are the family's: its denoiser and, with `adapter.text_encoder`, each text encoder, named as diffusers
names them (`unet`, `text_encoder`, `text_encoder_2`). A trained parameter's name is `<part>.<name in part>`.
"""

from __future__ import annotations

import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from difftune.config import AdapterConfig
from difftune.embeddings import add_tokens
from difftune.models import Components

DORA_MAGNITUDE = "lora_magnitude_vector"


def trained_parts(components: Components, config: AdapterConfig) -> dict[str, torch.nn.Module]:
    """The parts `config` trains, by name: the denoiser, and the family's adapted text encoders with
    `adapter.text_encoder`; an embedding's text encoders alone."""
    parts, family = components.parts(), components.family
    if config.kind == "embedding":
        names = family.text_encoder_names
    else:
        names = family.adapter_parts() if config.text_encoder else (family.denoiser_name,)
    return {name: parts[name] for name in names}


def target_modules(components: Components, config: AdapterConfig) -> dict[str, list[str]]:
    """Each trained part's adapter targets: the config's list, or the family's default where it is empty."""
    family = components.family
    configured = {
        family.denoiser_name: config.target_modules,
        "text_encoder": config.text_encoder_target_modules,
        "text_encoder_2": config.text_encoder_2_target_modules,
    }
    return {part: configured.get(part) or family.default_targets[part] for part in trained_parts(components, config)}


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
    for part, targets in target_modules(components, config).items():
        trained[part].add_adapter(_lora_config(config, targets))


def _lora_config(config: AdapterConfig, targets: list[str]) -> LoraConfig:
    return LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=targets,
        use_dora=config.kind == "dora",
        # A ~ N(0, 1/r), B = 0: the adapter starts as the identity, as in diffusers' LoRA scripts.
        init_lora_weights="gaussian",
    )


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
        # save_embedding_layers=False: embeddings are never adapted here, and `auto` probes the hub for a config.
        for key, value in get_peft_model_state_dict(module, save_embedding_layers=False).items():
            if key.endswith(DORA_MAGNITUDE):
                # transformers 5's adapter loader (diffusers' text-encoder path) maps only keys ending in
                # `.weight` and silently drops the bare magnitude key; peft reads both forms.
                key += ".weight"
            # copy=True: on CPU in fp32 `.to` would return the live parameter, which later steps change.
            tensors[f"{part}.{key}"] = value.detach().to("cpu", torch.float32, copy=True).contiguous()
        for field, value in module.peft_config["default"].to_dict().items():
            lora_configs[f"{part}.{field}"] = sorted(value) if isinstance(value, set) else value
    return tensors, lora_configs


def derived_lora_configs(ranks: dict[str, dict[str, int]], alphas: dict[str, dict[str, float]], dora: dict[str, bool]) -> dict:
    """Each part's peft config from what a file without one shows: its modules' ranks, the alphas it stores
    (a module without one gets alpha = rank, diffusers' rule) and whether it has DoRA magnitudes. The most
    common rank and alpha become `r` and `lora_alpha`; the others go to `rank_pattern` / `alpha_pattern`."""
    lora_configs = {}
    for part, part_ranks in ranks.items():
        rank = max(set(part_ranks.values()), key=list(part_ranks.values()).count)
        part_alphas = {m: alphas.get(part, {}).get(m, float(r)) for m, r in part_ranks.items()}
        alpha = max(set(part_alphas.values()), key=list(part_alphas.values()).count)
        config = {
            "r": rank,
            "lora_alpha": alpha,
            "target_modules": sorted(part_ranks),
            "use_dora": dora.get(part, False),
            "rank_pattern": {m: r for m, r in part_ranks.items() if r != rank},
            "alpha_pattern": {m: a for m, a in part_alphas.items() if a != alpha},
        }
        lora_configs.update({f"{part}.{field}": value for field, value in config.items()})
    return lora_configs
