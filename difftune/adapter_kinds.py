"""What each adapter kind is and what it allows of the rest of a config: LoRA, DoRA, LoHa, LoKr, a full fine-tune
(`adapter.kind = "none"`), a textual-inversion embedding and a ControlNet.

One object per kind (`KINDS`, by `adapter.kind`'s value), of a type that says what it trains: `PeftAdapter`s (a
small adapter through peft on frozen weights), `FullFineTune` (every weight of the trained parts), `TokenEmbedding`
(new tokens and nothing else) and `ControlNet` (a new network beside the frozen denoiser). Each kind names its own
config problems, which `Config` checks as it loads (before a model, or torch, is loaded: this module imports peft
only when it builds a peft config), and a peft kind builds its peft config and says how its files hold alpha. What a
kind does to a model and to files is the adapters package's, written once per type (`functools.singledispatch` over
these types: adapters/trained.py, adapters/export.py), so no code compares kind names.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

from difftune.errors import DifftuneError


# What a kind reads of a run's settings, named as `Config` names them (config.py's schema is one; it imports this
# module for `KINDS`, so this one describes what it reads instead of importing the schema).
class AdapterSettings(Protocol):
    """`adapter.*`: what a peft config is built from and what a kind refuses of it."""

    rank: int
    alpha: float
    dropout: float
    init: str
    rank_stabilized: bool
    text_encoder: bool

    @property
    def rewrites_base(self) -> bool: ...


class _Optim(Protocol):
    loraplus_ratio: float


class _Model(Protocol):
    quantize: str


class _Prior(Protocol):
    enabled: bool


class _Validation(Protocol):
    path: str


class _Export(Protocol):
    format: str
    average_last: int


class Settings(Protocol):
    """The sections a kind's `problems` read, and the phrase for frozen weights kept apart (`Config`'s)."""

    adapter: AdapterSettings
    optim: _Optim
    model: _Model
    prior: _Prior
    validation: _Validation
    export: _Export

    @property
    def frozen_weights_kept_apart(self) -> str: ...


class AdapterKind:
    name: ClassVar[str]  # `adapter.kind`'s value
    label: ClassVar[str]  # as trainers and tools call it (the family table)
    # Whether its change is B A scaled by alpha / rank, the scale rsLoRA changes, LoRA+ speeds up (B) and the
    # diffusers layout folds into B; LyCORIS's products have other factors.
    scaled_product: ClassVar[bool] = False
    starts_from_the_base: ClassVar[bool] = False  # adapter.init's PiSSA / OLoRA: factors taken out of the base
    trains_whole_parts: ClassVar[bool] = False  # its trained parts train every weight, in fp32 (never cast or stored)
    result_label: ClassVar[str] = ""  # what `where_files_go` calls its result, where it is not an adapter's layouts

    def problems(self, config: Settings) -> Iterator[str]:
        """What this kind does not allow of the rest of `config`, each as the message the user reads."""
        adapter = config.adapter
        if adapter.rewrites_base and not self.starts_from_the_base:
            yield (
                f'adapter.init = "{adapter.init}" starts a LoRA; adapter.kind = "{self.name}" needs init = "gaussian"'
            )
        if adapter.rank_stabilized and not self.scaled_product:
            yield (
                f'adapter.rank_stabilized scales a LoRA or DoRA; adapter.kind = "{self.name}" has no such scale in '
                "peft: turn it off"
            )
        if config.optim.loraplus_ratio and not self.scaled_product:
            yield (
                "optim.loraplus_ratio speeds up adapters' B matrices; "
                f'adapter.kind = "{self.name}" has none: set it to 0'
            )

    def __repr__(self) -> str:
        return f"<adapter kind {self.name}>"


class PeftAdapter(AdapterKind):
    """A small adapter injected by peft into the frozen base's layers; what is saved is the adapter alone."""

    peft_type: ClassVar[str]  # peft's name for it, which an adapter file's configs record (`<part>.peft_type`)
    alpha_key: ClassVar[str] = "alpha"  # where peft's config (and so the file's) holds the alpha
    on_quantized_layers: ClassVar[bool] = False  # peft has quantized layers for it (`model.quantize`)
    fusable: ClassVar[bool] = True  # a fused q, k, v layer (kohya's Flux layouts) holds it as one adapter

    def problems(self, config: Settings) -> Iterator[str]:
        yield from super().problems(config)
        if config.adapter.rewrites_base and config.model.quantize != "none":
            yield (
                f'adapter.init = "{config.adapter.init}" rewrites the base weights it factors, which model.quantize '
                "keeps quantized: use one or the other"
            )
        if config.model.quantize != "none" and not self.on_quantized_layers:
            yield (
                f'model.quantize keeps LoRA/DoRA\'s base layers quantized; adapter.kind = "{self.name}" has no '
                'quantized layers in peft: use lora or dora, or model.quantize = "none"'
            )

    def peft_config(self, adapter: AdapterSettings, targets: list[str]) -> Any:
        """peft's config for an adapter of this kind on the modules `targets`."""
        raise NotImplementedError

    def kohya_network_args(self) -> dict[str, str]:
        """kohya's `ss_network_args` for a file of this kind: none for a plain LoRA."""
        return {}


class LoRA(PeftAdapter):
    name, label, peft_type = "lora", "LoRA", "LORA"
    alpha_key = "lora_alpha"
    scaled_product = starts_from_the_base = on_quantized_layers = True
    magnitudes: ClassVar[bool] = False  # DoRA's learned magnitude per output (peft's `use_dora`)

    def peft_config(self, adapter: AdapterSettings, targets: list[str]) -> Any:
        from peft import LoraConfig

        return LoraConfig(
            r=adapter.rank,
            lora_alpha=adapter.alpha,
            lora_dropout=adapter.dropout,
            target_modules=targets,
            use_dora=self.magnitudes,
            use_rslora=adapter.rank_stabilized,
            # gaussian: A ~ N(0, 1/r), B = 0, so the adapter starts as the identity, as in diffusers' LoRA scripts.
            init_lora_weights=adapter.init,
        )


class DoRA(LoRA):
    """A LoRA with a learned magnitude per output (peft's `use_dora`); its files are LoRA files with magnitudes."""

    name, label = "dora", "DoRA"
    magnitudes = True
    starts_from_the_base = False

    def kohya_network_args(self) -> dict[str, str]:
        return {"algo": "lora", "dora_wd": "True"}  # LyCORIS's LoRA with weight decomposition


class LyCORIS(PeftAdapter):
    """LyCORIS's products (LoHa, LoKr) as peft implements them; `name` is also LyCORIS's `algo`."""

    fusable = False  # separate factors per q, k and v have no fused form

    def peft_config(self, adapter: AdapterSettings, targets: list[str]) -> Any:
        # LyCORIS's defaults, as peft has them: no Tucker decomposition of convolutions (ComfyUI and A1111 read it,
        # but the plain form is what every loader reads), LoKr's factor chosen from the layer's shape.
        return self.peft_config_class()(
            r=adapter.rank, alpha=adapter.alpha, rank_dropout=adapter.dropout, target_modules=targets
        )

    def kohya_network_args(self) -> dict[str, str]:
        return {"algo": self.name}  # LyCORIS's `algo` names its kinds as adapter.kind does

    def peft_config_class(self) -> type:
        import peft

        return getattr(peft, f"{self.label}Config")


class LoHa(LyCORIS):
    name, label, peft_type = "loha", "LoHa", "LOHA"


class LoKr(LyCORIS):
    name, label, peft_type = "lokr", "LoKr", "LOKR"


class FullFineTune(AdapterKind):
    """Every weight of the trained parts; the result is a whole pipeline folder."""

    name, label = "none", "full"
    trains_whole_parts = True
    result_label = "model"

    def problems(self, config: Settings) -> Iterator[str]:
        yield from super().problems(config)
        if config.model.quantize != "none":
            yield (
                f'model.quantize = "{config.model.quantize}" needs an adapter (adapter.kind lora or dora): a full '
                "fine-tune cannot train quantized weights"
            )
        if config.frozen_weights_kept_apart:
            yield (
                f"{config.frozen_weights_kept_apart}, and a full fine-tune has none (its weights train): leave "
                'weight_dtype "auto", offload_blocks 0 and offload_budget empty'
            )


class TokenEmbedding(AdapterKind):
    """Textual inversion: new tokens' embedding vectors, and no model weight changed."""

    name, label = "embedding", "textual inversion"
    result_label = "embedding"

    def problems(self, config: Settings) -> Iterator[str]:
        yield from super().problems(config)
        if config.prior.enabled:
            yield (
                "prior preservation (prior.class_path / num_class_images) keeps a fine-tuned model's "
                'class; an embedding (adapter.kind = "embedding") changes no model weights: turn it off'
            )
        if config.validation.path:
            yield 'validation.path is not supported with adapter.kind = "embedding" yet; leave it empty'
        if config.export.average_last:
            yield 'export.average_last averages adapters, not embeddings: set it to 0 with adapter.kind = "embedding"'


class ControlNet(AdapterKind):
    """A ControlNet (Zhang et al. 2023): a trainable copy of the frozen denoiser's encoder that reads a control image
    and adds its outputs to the denoiser's, started from the denoiser's weights with zero convolutions out (diffusers'
    `from_unet` / `from_transformer`). Trained whole; the result is the ControlNet's diffusers folder, which the
    family's ControlNet pipeline loads. The family says whether it has one (`Family.controlnet`)."""

    name, label = "controlnet", "ControlNet"
    trains_whole_parts = True
    result_label = "controlnet"

    def problems(self, config: Settings) -> Iterator[str]:
        yield from super().problems(config)
        refused = {
            "model.quantize": config.model.quantize != "none",  # the ControlNet starts as a copy of the weights
            "adapter.text_encoder": config.adapter.text_encoder,
            "prior preservation": config.prior.enabled,
            "validation.path": bool(config.validation.path),
            "export.average_last": bool(config.export.average_last),
            'export.format = "kohya"': config.export.format == "kohya",  # a ControlNet folder is diffusers' alone
        }
        named = [setting for setting, is_set in refused.items() if is_set]
        if named:
            yield (
                f'adapter.kind = "controlnet" trains a ControlNet beside the frozen base; leave out {", ".join(named)}'
            )


KINDS: dict[str, AdapterKind] = {
    kind.name: kind for kind in (LoRA(), DoRA(), LoHa(), LoKr(), FullFineTune(), TokenEmbedding(), ControlNet())
}
PEFT_KINDS = {kind.name: kind for kind in KINDS.values() if isinstance(kind, PeftAdapter)}


def file_kind(lora_configs: dict, part: str) -> PeftAdapter:
    """The kind of a part's adapter in an adapter file's configs (peft's `peft_type` and `use_dora`; LoRA when a
    file records neither)."""
    peft_type = str(lora_configs.get(f"{part}.peft_type", "LORA")).rsplit(".", 1)[-1].upper()
    if peft_type == "LORA" and lora_configs.get(f"{part}.use_dora"):
        return KINDS["dora"]
    for kind in PEFT_KINDS.values():
        if kind.peft_type == peft_type:
            return kind
    raise DifftuneError(
        f"{part}: a peft {peft_type} adapter, which difftune does not read (it reads LoRA, DoRA, LoHa and LoKr)"
    )
