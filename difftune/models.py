"""The parts of a base model, its autoencoder, and latents: what every family shares.

Latent scaling, for every autoencoder kind: `latents = (encoded - shift_factor) * scaling_factor`,
with both factors read from the autoencoder's own config (shift 0 where it has none).
- `AutoencoderKL` (SD's VAE): `encoded` is a sample of the posterior; SD 1.x/2.x's config says
  `scaling_factor = 0.18215` (SDXL's 0.13025), chosen so that latents have unit variance.
- `AutoencoderTiny` (TAESD): its encoder was distilled to output SD's *already scaled* latents, so its
  config says `scaling_factor = 1.0` and `encoded` is the encoder's output as it is.
The same factors, inverted, decode: `decoded = vae.decode(latents / scaling_factor + shift_factor)`.
"""

from __future__ import annotations

import importlib.util
import socket
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import torch
from diffusers import AutoencoderKL, AutoencoderTiny
from diffusers.utils.torch_utils import randn_tensor

from difftune.errors import DifftuneError
from difftune.storage import store_frozen_layers

if TYPE_CHECKING:
    from difftune.config import Config
    from difftune.families.family import Family

VAE_CLASSES = {"AutoencoderKL": AutoencoderKL, "AutoencoderTiny": AutoencoderTiny}
PICKLED_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
SINGLE_FILE_SUFFIXES = (".safetensors", *PICKLED_SUFFIXES)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Components:
    """A base model's parts. Parts are named as in its diffusers pipeline (and in diffusers' LoRA files)."""

    family: Family
    denoiser: torch.nn.Module  # the UNet (SD, SDXL) or transformer (Flux)
    vae: AutoencoderKL | AutoencoderTiny | None  # None while released (its latents are cached)
    text_encoders: dict[str, torch.nn.Module | None]  # "text_encoder"[, "text_encoder_2"]; None while released
    tokenizers: dict[str, Any]  # "tokenizer"[, "tokenizer_2"]
    noise_scheduler: Any  # the schedule training follows (the family's `training_scheduler`)
    pipeline_options: dict = field(default_factory=dict)  # the family's `pipeline_options` values
    latent_scaling: tuple[float, float] = (1.0, 0.0)  # the VAE's (scaling_factor, shift_factor)
    conditioning_options: dict = field(default_factory=dict)  # `model` settings the family's `denoise` reads

    def parts(self) -> dict[str, torch.nn.Module | None]:
        """The denoiser and the text encoders by part name: what adapters attach to."""
        return {self.family.denoiser_name: self.denoiser, **self.text_encoders}

    def modules(self) -> list[torch.nn.Module]:
        """Every loaded model (released encoders left out)."""
        return [m for m in (self.denoiser, self.vae, *self.text_encoders.values()) if m is not None]

    def encoders_loaded(self) -> bool:
        return self.vae is not None and all(m is not None for m in self.text_encoders.values())

    def pipeline(self, scheduler=None):
        """A text-to-image pipeline of the family over these components."""
        return self.family.assemble_pipeline(self, scheduler)


def load_vae(name: str) -> AutoencoderKL | AutoencoderTiny:
    """An `AutoencoderKL` or `AutoencoderTiny` from a folder (or a pipeline folder's `vae/`) or hub id."""
    subfolder = "vae" if (Path(name) / "vae" / "config.json").is_file() else None
    class_name = AutoencoderKL.load_config(name, subfolder=subfolder).get("_class_name")
    if class_name not in VAE_CLASSES:
        raise DifftuneError(f"model.vae {name}: is a {class_name}; allowed kinds: {', '.join(VAE_CLASSES)}")
    return VAE_CLASSES[class_name].from_pretrained(name, subfolder=subfolder, dtype=torch.float32)


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


def hub_unavailable(name: str) -> str | None:
    """Why `name`, not a local path, cannot come from the Hugging Face hub now (offline mode on, or the hub
    unreachable), or None. Asked once, at once: the hub client would otherwise retry for about 30 s before
    failing. A copy already in the local hub cache needs no hub."""
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        if any(isinstance(try_to_load_from_cache(name, f), str) for f in ("model_index.json", "config.json")):
            return None
    except HFValidationError:
        return None  # not a hub id at all: the loader's own error says so
    if constants.HF_HUB_OFFLINE:
        return "offline mode is on (HF_HUB_OFFLINE)"
    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=5).close()
    except OSError as err:
        return f"{constants.ENDPOINT} is unreachable ({err})"
    return None


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
        raise DifftuneError(
            f"{key} {name}: not a local folder or file (looked at {Path(name).resolve()}), and it could not be "
            f"fetched from the Hugging Face hub (offline, or no such id). Pass a local diffusers folder or a "
            f".safetensors file. Cause: {cause}"
        ) from error


def place_frozen(
    components: Components, device: torch.device, dtype: torch.dtype, trained_whole=(), stored: torch.dtype | None = None
) -> None:
    """Every loaded model on `device` in `dtype` (released encoders stay away). A KL VAE whose config asks for
    `force_upcast` (SD's and SDXL's own: they overflow to NaN in fp16 on some images) stays fp32 under fp16;
    an fp16-safe one (`force_upcast = false`, e.g. the SDXL fp16 fix, or TAESD) follows `dtype`. Modules in
    `trained_whole` (a full fine-tune's) stay fp32: a round trip through `dtype` would round the base's weights.
    `stored`: the denoiser's frozen layers are kept in this 16-bit dtype and computed in `dtype` (storage.py);
    converted before the move, so a GPU receives half the bytes."""
    if stored is not None:
        store_frozen_layers(components.denoiser, stored)
    vae = components.vae
    upcast_vae = vae is not None and getattr(vae.config, "force_upcast", True)
    vae_dtype = torch.float32 if dtype == torch.float16 and upcast_vae else dtype
    for module in components.modules():
        module.to(device)
        if any(module is trained for trained in trained_whole):
            continue
        module_dtype = vae_dtype if module is vae else dtype
        if module_dtype != torch.float32:  # loaded as fp32; diffusers warns on every dtype cast
            module.to(dtype=module_dtype)


@contextmanager
def eval_mode(*modules: torch.nn.Module):
    """Run without dropout (adapter dropout included), then put the modules' training modes back."""
    modes = [module.training for module in modules]
    for module in modules:
        module.eval()
    try:
        yield
    finally:
        for module, mode in zip(modules, modes):
            module.train(mode)


def weight_dtype(config: Config) -> torch.dtype:
    """The dtype frozen weights compute in (fp32 where `stored_dtype` stores them)."""
    if config.stores_frozen_in_16_bits:
        return torch.float32
    if config.model.weight_dtype != "auto":
        return DTYPES[config.model.weight_dtype]
    # FP8 training keeps bf16 weights: torchao casts them to FP8 per matmul, with fresh scales.
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}.get(config.train.mixed_precision, torch.float32)


def stored_dtype(config: Config) -> torch.dtype | None:
    """The 16-bit dtype the denoiser's frozen layers are stored in while computing in fp32 (storage.py), or None."""
    return DTYPES[config.model.weight_dtype] if config.stores_frozen_in_16_bits else None


def encode_posterior(vae, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 3, H, W) in [-1, 1] -> the posterior's mean and std (B, C, H/f, W/f), unscaled. TAESD is
    deterministic: its std is 0. This is what the latent cache stores."""
    weight = next(vae.parameters())  # not vae.device / vae.dtype: each walks every module, 1.6 ms a step
    pixels = pixels.to(weight.device, weight.dtype)
    if isinstance(vae, AutoencoderTiny):
        mean = vae.encode(pixels).latents
        return mean, torch.zeros_like(mean)
    posterior = vae.encode(pixels).latent_dist
    return posterior.mean, posterior.std


def sample_latents(
    mean: torch.Tensor, std: torch.Tensor, generators: list[torch.Generator], scaling_factor: float, shift_factor: float
) -> torch.Tensor:
    """One posterior sample per image, each from its own generator (so a sample's latents do not depend on the
    rest of its batch), scaled for the UNet: `(sample - shift_factor) * scaling_factor`."""
    eps = randn_tensor(mean.shape, generator=generators, device=mean.device, dtype=mean.dtype)
    return (mean + std * eps - shift_factor) * scaling_factor


def latent_scaling(vae_config) -> tuple[float, float]:
    """(scaling_factor, shift_factor) from an autoencoder's config (shift 0 where it has none)."""
    return vae_config.scaling_factor, getattr(vae_config, "shift_factor", None) or 0.0


def encode_latents(vae, pixels: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> scaled latents (B, C, H/f, W/f), one posterior sample per image."""
    mean, std = encode_posterior(vae, pixels)
    return sample_latents(mean, std, generators, *latent_scaling(vae.config))


def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Inverse of `encode_latents` (up to the autoencoder's loss): scaled latents -> pixels in [-1, 1]."""
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor + shift).sample


def tokenize(tokenizer, captions: list[str]) -> torch.Tensor:
    """Captions -> token ids (B, tokenizer.model_max_length), padded and truncated as training reads them."""
    return tokenizer(
        captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
    ).input_ids


def set_attention(denoiser: torch.nn.Module, kind: str) -> None:
    """`sdpa` is diffusers' default processor (PyTorch scaled-dot-product attention); `xformers` swaps it."""
    if kind == "xformers":
        if importlib.util.find_spec("xformers") is None:
            raise DifftuneError(
                "train.attention = \"xformers\" but xformers is not installed; `pip install difftune[xformers]` "
                "(CUDA only) or use \"sdpa\""
            )
        denoiser.enable_xformers_memory_efficient_attention()
