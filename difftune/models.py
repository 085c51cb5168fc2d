"""Load a Stable Diffusion base and turn images and captions into the UNet's inputs.

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
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from diffusers import AutoencoderKL, AutoencoderTiny, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.utils.torch_utils import randn_tensor
from transformers import CLIPTextModel, CLIPTokenizer

from difftune.config import ModelConfig
from difftune.errors import DifftuneError

VAE_CLASSES = {"AutoencoderKL": AutoencoderKL, "AutoencoderTiny": AutoencoderTiny}
PICKLED_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
SINGLE_FILE_SUFFIXES = (".safetensors", *PICKLED_SUFFIXES)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Components:
    unet: UNet2DConditionModel
    vae: AutoencoderKL | AutoencoderTiny | None  # None while released (its latents are cached)
    text_encoder: CLIPTextModel | None  # None while released (its outputs are cached)
    tokenizer: CLIPTokenizer
    noise_scheduler: DDPMScheduler
    latent_scaling: tuple[float, float] = (1.0, 0.0)  # the VAE's (scaling_factor, shift_factor)


def load_components(config: ModelConfig) -> Components:
    """Everything training needs from `config.base` (and `config.vae`), in fp32 on the CPU."""
    base = config.base
    pickled = base.endswith(PICKLED_SUFFIXES)
    if pickled and not config.allow_pickled_checkpoint:
        raise DifftuneError(
            f"model.base {base}: a pickle-based checkpoint is not read by default (pickles can run code); convert it "
            f"to .safetensors or a diffusers folder, or set model.allow_pickled_checkpoint = true (read tensors-only)"
        )
    with _explained_load_errors("model.base", base), quiet_loading():
        if base.endswith(SINGLE_FILE_SUFFIXES):
            components = _load_single_file(config)
        else:
            options = {"revision": config.revision or None, "variant": config.variant or None}
            fp32 = {"dtype": torch.float32}  # not the saved dtype: placement casts later, on purpose
            components = Components(
                unet=UNet2DConditionModel.from_pretrained(base, subfolder="unet", **options, **fp32),
                vae=AutoencoderKL.from_pretrained(base, subfolder="vae", **options, **fp32),
                text_encoder=CLIPTextModel.from_pretrained(base, subfolder="text_encoder", **options, dtype=torch.float32),
                tokenizer=CLIPTokenizer.from_pretrained(base, subfolder="tokenizer", revision=options["revision"]),
                noise_scheduler=DDPMScheduler.from_pretrained(base, subfolder="scheduler", revision=options["revision"]),
            )
    if config.vae:
        with _explained_load_errors("model.vae", config.vae):
            components.vae = load_vae(config.vae)
    components.latent_scaling = latent_scaling(components.vae.config)
    latent_channels = components.vae.config.latent_channels
    if latent_channels != components.unet.config.in_channels:
        raise DifftuneError(
            f"model.vae {config.vae or base}: makes {latent_channels}-channel latents but the UNet takes "
            f"{components.unet.config.in_channels}; use an autoencoder made for this base"
        )
    return components


def _load_single_file(config: ModelConfig) -> Components:
    if not Path(config.base).is_file():
        raise DifftuneError(f"model.base {config.base}: no such file")
    pipeline = StableDiffusionPipeline.from_single_file(
        config.base,
        config=config.single_file_config or None,
        safety_checker=None,
        requires_safety_checker=False,
        dtype=torch.float32,
    )
    return Components(
        unet=pipeline.unet,
        vae=pipeline.vae,
        text_encoder=pipeline.text_encoder,
        tokenizer=pipeline.tokenizer,
        noise_scheduler=DDPMScheduler.from_config(pipeline.scheduler.config),
    )


def assemble_pipeline(components: Components, scheduler=None) -> StableDiffusionPipeline:
    """A text-to-image pipeline over the (possibly adapted) components; no safety checker."""
    return StableDiffusionPipeline(
        vae=components.vae,
        text_encoder=components.text_encoder,
        tokenizer=components.tokenizer,
        unet=components.unet,
        scheduler=scheduler or components.noise_scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


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
def _explained_load_errors(key: str, name: str):
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


def place_frozen(components: Components, device: torch.device, dtype: torch.dtype) -> None:
    """Every loaded model on `device` in `dtype` (released encoders stay away). SD's KL VAE overflows to NaN in
    fp16 on some images: it stays fp32 unless bf16 was asked for."""
    vae_dtype = torch.float32 if dtype == torch.float16 else dtype
    placed = [(components.vae, vae_dtype), (components.text_encoder, dtype), (components.unet, dtype)]
    for module, module_dtype in [(m, d) for m, d in placed if m is not None]:
        module.to(device)
        if module_dtype != torch.float32:  # loaded as fp32; diffusers warns on every dtype cast
            module.to(dtype=module_dtype)


def weight_dtype(config_dtype: str, mixed_precision: str) -> torch.dtype:
    if config_dtype != "auto":
        return DTYPES[config_dtype]
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mixed_precision, torch.float32)


def encode_posterior(vae, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 3, H, W) in [-1, 1] -> the posterior's mean and std (B, C, H/f, W/f), unscaled. TAESD is
    deterministic: its std is 0. This is what the latent cache stores."""
    pixels = pixels.to(vae.device, vae.dtype)
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


def encode_prompts(text_encoder: CLIPTextModel, input_ids: torch.Tensor) -> torch.Tensor:
    """Token ids (B, L), on the encoder's device -> the UNet's cross-attention states (B, L, D): CLIP's last
    hidden state, as SD 1.x uses it."""
    return text_encoder(input_ids, return_dict=False)[0]


def set_attention(unet: UNet2DConditionModel, kind: str) -> None:
    """`sdpa` is diffusers' default processor (PyTorch scaled-dot-product attention); `xformers` swaps it."""
    if kind == "xformers":
        if importlib.util.find_spec("xformers") is None:
            raise DifftuneError(
                "train.attention = \"xformers\" but xformers is not installed; `pip install difftune[xformers]` "
                "(CUDA only) or use \"sdpa\""
            )
        unet.enable_xformers_memory_efficient_attention()
