"""The parts of a base model and how they are loaded and placed: what every family shares (the autoencoder's
latents: autoencoders.py)."""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.nn.utils import parametrize

from difftune.config import Config
from difftune.errors import DifftuneError
from difftune.files import hub_unavailable, part_weight_files, unreachable_base
from difftune.memory.offload import Offloader, offload_blocks
from difftune.memory.storage import store_frozen_layers
from difftune.memory.turns import taking_turns
from difftune.models.autoencoders import LatentNormalization
from difftune.models.dtypes import RunDtypes

PICKLED_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
SINGLE_FILE_SUFFIXES = (".safetensors", ".gguf", *PICKLED_SUFFIXES)


class PartsLoading(Protocol):
    @property
    def reads_denoiser_files(self) -> bool: ...  # its single files hold the denoiser alone


class PartsConditioning(Protocol):
    def tokenize(
        self, tokenizers: dict, captions: list[str], controls: list | None = None
    ) -> dict[str, torch.Tensor]: ...

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def cached_conditioning(self, conditioning: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...

    def text_kept(self, components: Components) -> str: ...


class PartsDrawing(Protocol):
    def assemble_pipeline(self, components: Components, scheduler=None): ...


class PartsFamily(Protocol):
    """What the layers below the families (these parts, the data and its caches) ask of the family whose parts
    `Components` holds, and of its roles; the families' `Family` (families/common/family.py) is one, and the rest of
    it is asked by the layers above."""

    denoiser_name: str  # its pipeline argument and its prefix in diffusers' LoRA files
    loading: PartsLoading
    conditioning: PartsConditioning
    drawing: PartsDrawing

    def blocks_to_offload(self, denoiser: torch.nn.Module, count: int) -> list[torch.nn.Module]: ...


@dataclass
class Components:
    """A base model's parts. Parts are named as in its diffusers pipeline (and in diffusers' LoRA files)."""

    family: PartsFamily  # its `Family` (families/common/family.py), of which the layers below ask only this
    denoiser: torch.nn.Module  # the UNet (SD, SDXL) or transformer (Flux)
    vae: torch.nn.Module | None  # an autoencoder of a kind autoencoders.py reads; None while released (latents cached)
    text_encoders: dict[str, torch.nn.Module | None]  # "text_encoder"[, "text_encoder_2"]; None while released
    tokenizers: dict[str, Any]  # "tokenizer"[, "tokenizer_2"]
    noise_scheduler: Any  # the schedule training follows (the family's `training_scheduler`)
    pipeline_options: dict = field(default_factory=dict)  # the family's `pipeline_options` values
    latent_normalization: LatentNormalization = LatentNormalization()  # the autoencoder's (autoencoders.py)
    family_options: Any = None  # `model.family_options`, checked by the family (its `options_model`)
    merged_changes: dict = field(default_factory=dict)  # a merged training adapter's, by layer (training_adapter.py)
    # Frozen parts only the family's pipeline draws with (Ideogram 4's unconditional transformer), by their pipeline
    # names; None while released. Training never runs them: they wait in host memory for previews, or are released.
    drawing_parts: dict[str, torch.nn.Module | None] = field(default_factory=dict)
    # Frozen parts that encode a sample's own pixels beside the autoencoder, for the family's `pixel_conditioning`
    # (Wan 2.1 image-to-video's CLIP image encoder), by their pipeline names: loaded, placed, cached with and released
    # as the autoencoder is (`encoder_placement`'s "vae").
    pixel_encoders: dict[str, torch.nn.Module | None] = field(default_factory=dict)
    # Image pixels per latent pixel along each side (the autoencoder's `downsampling`), known while it is released
    pixels_per_latent: int = 8
    # A sound base's autoencoder's samples a second (0: a picture base's), known while it is released
    samples_per_second: int = 0
    # A ControlNet beside the frozen denoiser (`adapter.kind = "controlnet"`, the family's `controlnet` role): trained,
    # or read from its folder for drawing; drawn through the family's ControlNet pipeline
    controlnet: torch.nn.Module | None = None

    def parts(self) -> dict[str, torch.nn.Module | None]:
        """The denoiser, the text encoders and a ControlNet by part name: what adapters attach to and runs train."""
        return {
            self.family.denoiser_name: self.denoiser,
            **self.text_encoders,
            **({"controlnet": self.controlnet} if self.controlnet is not None else {}),
        }

    def replace_part(self, name: str, module: torch.nn.Module) -> None:
        """Put `module` where part `name` was (a prepared, wrapped trained part)."""
        if name == self.family.denoiser_name:
            self.denoiser = module
        elif name == "controlnet":
            self.controlnet = module
        else:
            self.text_encoders[name] = module

    def modules(self) -> list[torch.nn.Module]:
        """Every loaded model (released encoders and drawing parts left out)."""
        return [
            m
            for m in (
                self.denoiser,
                self.controlnet,
                *self.autoencoders(),
                *self.text_encoders.values(),
                *self.drawing_parts.values(),
            )
            if m is not None
        ]

    def encoders_loaded(self) -> bool:
        """Whether every part a pipeline needs is loaded (none released)."""
        return self.vae is not None and all(
            m is not None
            for m in (*self.text_encoders.values(), *self.drawing_parts.values(), *self.pixel_encoders.values())
        )

    def autoencoders(self) -> list[torch.nn.Module | None]:
        """The autoencoder and the parts that encode pixels beside it (`pixel_encoders`): what the latent cache holds
        the outputs of."""
        return [self.vae, *self.pixel_encoders.values()]

    def pipeline(self, scheduler=None):
        """A text-to-image pipeline of the family over these components."""
        return self.family.drawing.assemble_pipeline(self, scheduler)


@contextmanager
def quiet_loading():
    """No per-file "Loading weights" bars from transformers and diffusers: a run's screen is difftune's own."""
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled(), diffusers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    diffusers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled[0]:
            transformers_logging.enable_progress_bar()
        if was_enabled[1]:
            diffusers_logging.enable_progress_bar()


@contextmanager
def explained_load_errors(key: str, name: str):
    """Turn a failed load into a message that says what was tried and what to pass instead."""
    try:
        if not Path(name).exists() and not name.endswith(SINGLE_FILE_SUFFIXES):
            reason = hub_unavailable(name)
            if reason:
                raise OSError(reason)
        yield
    except DifftuneError:
        raise
    except (OSError, ValueError) as error:
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        if Path(name).exists():
            raise DifftuneError(f"{key} {name}: could not be loaded as a diffusers model: {cause}") from error
        raise DifftuneError(unreachable_base(key, name, cause)) from error


def encoder_placement(config: Config) -> dict[str, str]:
    """Where a training run keeps the autoencoder ("vae"), the text encoders ("text") and the family's drawing parts
    ("drawing"): `device` where they encode every step; `released` where the cache holds all they give and nothing
    else needs them (dropped, and loaded again at the end of the run); `host` where the cache holds what training needs
    but previews or validation use them now and then (in host memory, on the device only while those run:
    `encoders_on`). Drawing parts are never needed to train: `host` for previews, else `released`."""
    previews = bool(config.sample.every_steps and config.sample.prompts)

    def where(cached: bool, needed: bool) -> str:
        return "device" if not cached else "host" if needed else "released"

    return {
        "vae": where(config.cache.latents == "on", previews or bool(config.validation.eval_concept)),
        "text": where(config.cache.text == "on", previews or bool(config.validation.path)),
        "drawing": where(True, previews),
    }


def host_kept_encoders(components: Components, config: Config) -> list[torch.nn.Module]:
    """The loaded encoders `encoder_placement` keeps in host memory."""
    placement = encoder_placement(config)
    kept = (
        (components.autoencoders() if placement["vae"] == "host" else [])
        + (list(components.text_encoders.values()) if placement["text"] == "host" else [])
        + (list(components.drawing_parts.values()) if placement["drawing"] == "host" else [])
    )
    return [module for module in kept if module is not None]


def host_kept_for_drawing(components: Components, config: Config) -> list[torch.nn.Module]:
    """The encoders `encoder_placement` keeps in host memory that drawing and validation bring to the device whole:
    all but the text encoders, which come as they read prompts (`prompts_read_by_turns`)."""
    text = list(components.text_encoders.values())
    return [module for module in host_kept_encoders(components, config) if not any(module is t for t in text)]


def prompts_read_by_turns(components: Components, device: torch.device):
    """The text encoders on `device` only while they read prompts, the models that denoise (the denoiser, a
    ControlNet, the drawing parts) leaving it meanwhile where it cannot hold both: turns.py's `taking_turns`."""
    denoising = [components.denoiser, components.controlnet, *components.drawing_parts.values()]
    return taking_turns(list(components.text_encoders.values()), denoising, device)


@contextmanager
def encoders_on(device: torch.device, encoders: list[torch.nn.Module]):
    """The encoders kept in host memory on `device` while the block runs (previews, validation), then back."""
    for module in encoders:
        module.to(device)
    try:
        yield
    finally:
        for module in encoders:
            module.to("cpu")


def place_frozen(
    components: Components,
    device: torch.device,
    dtype: torch.dtype,
    trained_whole=(),
    stored: torch.dtype | None = None,
    offloaded: int = 0,
    on_host=(),
) -> Offloader | None:
    """Every loaded model on `device` in `dtype` (released encoders stay away, those `on_host` stay in host memory:
    `host_kept_encoders`). A KL VAE whose config asks for `force_upcast` (SD's and SDXL's own: they overflow to NaN
    in fp16 on some images) stays fp32 under fp16; an fp16-safe one (`force_upcast = false`, e.g. the SDXL fp16
    fix, or TAESD) follows `dtype`. Modules in
    `trained_whole` (a full fine-tune's) stay fp32: a round trip through `dtype` would round the base's weights.
    `stored`: the denoiser's frozen layers are kept in this dtype and computed in `dtype` (storage.py). `offloaded`:
    this many of the denoiser's blocks keep their frozen layers (in `stored`, else in `dtype`) in host memory, copied
    to the device as they compute (offload.py); returns their offloader. Both are done before the move, so a GPU
    receives the stored bytes of the kept blocks alone."""
    denoiser = components.denoiser
    blocks = components.family.blocks_to_offload(denoiser, offloaded)
    if stored is not None:
        store_frozen_layers(denoiser, stored, dtype)
    for block in blocks if stored is None else ():
        store_frozen_layers(block, dtype, dtype)
    offloader = offload_blocks(blocks, device) if blocks else None
    for module in components.modules():
        if not any(module is kept for kept in on_host):
            module.to(device)
        if not any(module is trained for trained in trained_whole):
            cast_frozen(module, dtype, is_vae=module is components.vae)
    return offloader


def cast_frozen(module: torch.nn.Module, dtype: torch.dtype, is_vae: bool = False) -> None:
    """A frozen model in `dtype`, but a KL VAE that asks for `force_upcast` under fp16 (`place_frozen`)."""
    if is_vae and dtype == torch.float16 and getattr(module.config, "force_upcast", True):
        return
    tensors = (*module.parameters(), *module.buffers())
    # Parts load in fp32 or in the dtype they are kept in already (`part_dtypes`); diffusers warns on every cast.
    if dtype != torch.float32 and any(t.is_floating_point() and t.dtype != dtype for t in tensors):
        module.to(dtype=dtype)


@contextmanager
def eval_mode(*modules: torch.nn.Module):
    """Run without dropout (adapter dropout included), then put the modules' training modes back."""
    modes = [module.training for module in modules]
    for module in modules:
        module.eval()
    try:
        yield
    finally:
        for module, mode in zip(modules, modes, strict=True):
            module.train(mode)


def loads_encoders_first(config: Config, family: PartsFamily, resume: str | None = None) -> bool:
    """Whether the run loads the encoders, fills the caches with them and lets go of them before the denoiser loads
    (train.py's `setup`): the host then holds the text encoders or the denoiser, not both (T5-XXL's 9.5 GB beside
    FLUX.1's
    12 GB in fp8 outgrow a 24 GB machine). Where both caches are on, the base is a pipeline folder, a hub id or a file
    of the denoiser alone (`family`'s: not a whole pipeline's file), and nothing draws with the whole base before
    training: no "before" samples, no class images, no training adapter (merged into the whole base)."""
    draws_before = config.sample.before and config.sample.prompts and not resume
    whole_pipeline_file = config.model.base.endswith(SINGLE_FILE_SUFFIXES) and not family.loading.reads_denoiser_files
    return (
        config.cache.latents == "on"
        and config.cache.text == "on"
        and not draws_before
        and not config.prior.enabled
        and not config.model.training_adapter
        and not whole_pipeline_file
    )


def store_loaded_denoiser(components: Components, dtypes: RunDtypes) -> None:
    """Right after loading: the frozen denoiser's linear and convolution layers in the run's storage dtype, each as
    it is converted (the file's pages it was read from dropped: storage.py), and the rest of it in the compute dtype.
    Adapters attach to the stored layers as they did to 16-bit ones (peft gives them the compute dtype)."""
    stored, compute = dtypes.stored, dtypes.compute
    if stored is None or not dtypes.stored_at_load:
        return  # stored as it is placed (`place_frozen`), after the adapters are attached
    components.denoiser.requires_grad_(False)
    store_frozen_layers(components.denoiser, stored, compute)
    for module in components.denoiser.modules():  # what is not stored (norms, an fp8 layer's bias), in `compute`
        if isinstance(module, parametrize.ParametrizationList):
            continue  # a stored layer's tensor, kept as stored
        for tensors in (module._parameters, module._buffers):
            for name, tensor in tensors.items():
                if tensor is not None and tensor.is_floating_point() and tensor.dtype != compute:
                    cast = tensor.detach().to(compute)
                    tensors[name] = (
                        torch.nn.Parameter(cast, requires_grad=False) if tensors is module._parameters else cast
                    )


def store_loaded_text_encoders(components: Components, dtypes: RunDtypes) -> None:
    """Right after loading, with `model.text_encoder_dtype = "fp8"`: the text encoders' frozen linear layers stored
    in fp8 and computed in the run's dtype, as the denoiser's are (storage.py); their other weights in that dtype."""
    if dtypes.text_encoders_stored is None:
        return
    compute = dtypes.compute
    for encoder in components.text_encoders.values():
        if encoder is not None:
            # From the weights as the run holds them (in its compute dtype), whatever dtype they were loaded in: the
            # fp8 of fp32 weights and of their bf16 rounding differ at rounding boundaries (the parity check, which
            # loads fp32, drew 3 to 9 levels away from training, which loads bf16).
            store_frozen_layers(encoder.requires_grad_(False).to(compute), dtypes.text_encoders_stored, compute)


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def files_dtype(base: str, part: str, variant: str = "") -> torch.dtype | None:
    """The dtype a local pipeline folder's part is saved in (its first floating-point tensor's, from a safetensors
    header), or None where that is not on this machine to read (a hub id is not fetched to see)."""
    from safetensors import safe_open

    for file in part_weight_files(Path(base) / part, variant):
        with safe_open(file, "pt") as weights:
            for key in weights.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                dtype = SAFETENSORS_DTYPES.get(weights.get_slice(key).get_dtype())
                if dtype is not None:
                    return dtype
    return None


def tokenize(tokenizer, captions: list[str]) -> torch.Tensor:
    """Captions -> token ids (B, tokenizer.model_max_length), padded and truncated as training reads them."""
    return tokenizer(
        captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
    ).input_ids


def compile_denoiser(denoiser: torch.nn.Module) -> None:
    """torch.compile in place (a checkpoint keeps its keys). A transformer's repeated blocks one by one (diffusers'
    `compile_repeated_blocks`, the regional compilation its docs recommend): its blocks do nearly all its work, and
    one compiled graph serves every block of a kind, so compiling takes a block's time, not the model's. A UNet whole:
    its convolutions and norms outside its transformer blocks take most of its step."""
    if getattr(denoiser, "_repeated_blocks", None) and not hasattr(denoiser, "down_blocks"):
        denoiser.compile_repeated_blocks()
    else:
        denoiser.compile()


def set_attention(denoiser: torch.nn.Module, kind: str) -> None:
    """`sdpa` and `sdpa_cudnn` are diffusers' default processor (PyTorch scaled-dot-product attention; which of its
    kernels CUDA may use is set per process, train.py's `_set_device_flags`); `xformers` swaps it."""
    if kind == "xformers":
        if importlib.util.find_spec("xformers") is None:
            raise DifftuneError(
                'train.attention = "xformers" but xformers is not installed; `pip install difftune[xformers]` '
                '(CUDA only) or use "sdpa"'
            )
        denoiser.enable_xformers_memory_efficient_attention()
