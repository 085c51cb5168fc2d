"""Autoencoders: images to the latents a denoiser trains on, and back. One piece every family shares, because the
kind of autoencoder decides this, not the family (Wan's autoencoder serves Qwen-Image and Wan alike).

Latent normalisation, for every kind: `latents = (encoded - shift) * scale`, per channel or for all channels
alike, read from the autoencoder's own config; `decoded = decode(latents / scale + shift)` inverts it.
- `AutoencoderKL` (SD, SDXL, Flux): `encoded` is a sample of the posterior; one `scaling_factor` (SD 1.x/2.x
  0.18215, SDXL 0.13025, chosen so that latents have unit variance) and one `shift_factor` (Flux; 0 where none).
- `AutoencoderTiny` (TAESD): its encoder was distilled to output already scaled latents: its config says
  `scaling_factor = 1.0`, and `encoded` is the encoder's output as it is (a posterior of std 0).
- `AutoencoderKLQwenImage` (Qwen-Image) and `AutoencoderKLWan` (Wan 2.1; the same autoencoder): a causal video
autoencoder whose latents
  have a time axis (B, C, T, h, w), T = 1 for an image, and per-channel statistics: shift = `latents_mean`,
  scale = 1 / `latents_std`, as `QwenImagePipeline` inverts them. Images pass as one-frame clips; everything
  outside this module sees an image's latents as (B, C, h, w), and a clip's (video bases) as (B, C, t, h, w), t =
  (T - 1) / `frames_per_latent` + 1.
- `AutoencoderKLHunyuanVideo` (Kandinsky 5's video models): a causal video autoencoder of the same shape (4x in
  time, 8x in space), normalised by one `scaling_factor` (0.476986) as `AutoencoderKL`.
- `AutoencoderKLHunyuanVideo15` (HunyuanVideo 1.5): a causal video autoencoder at 16x in space, 4x in time, with 32
  channels, normalised by one `scaling_factor` (1.03682) as `AutoencoderKL`.
- `AutoencoderKLQwenImage21` (Qwen-Image 2.1): the same kind at 16x with 64 channels, of RGBA images: an RGB image
  is encoded opaque (alpha 1, as its training script converts images to RGBA), and decoding keeps the RGB the rest
  of difftune reads (its pipeline returns the alpha too). Qwen-Image-Layered's is Qwen-Image's kind with
  `input_channels` 4: it reads RGBA, and with `data.keep_alpha` the images' own alpha (`reads_rgba`).
- `AutoencoderKLHunyuanImage` (HunyuanImage 2.1): a KL autoencoder of images at 32x with 64 channels, normalised as
  `AutoencoderKL` (one `scaling_factor`, no shift).
- `AutoencoderKLLTX2Video` (LTX-2): a causal video autoencoder at 32x in space, 8x in time, with 128 channels, its
  per-channel statistics buffers of the model (`latents_mean`, `latents_std`, not config): shift = `latents_mean`,
  scale = `scaling_factor` / `latents_std`, as `LTX2Pipeline._normalize_latents`.
- `AutoencoderKLFlux2` (FLUX.2): 32-channel latents at 8x, which the denoiser reads patched 2x2 into 128 channels
  (`patched`, as `Flux2Pipeline._patchify_latents`), normalised per patched channel by the autoencoder's own batch
  norm statistics (shift = `bn.running_mean`, scale = 1 / sqrt(`bn.running_var` + eps)). Everything outside this
  module sees the patched (B, 128, h/2, w/2): the posterior, the caches, the noise.
- `AutoencoderDC` (Sana's deep-compression autoencoder): deterministic (its encoder returns the latents themselves, a
  posterior of std 0, as TAESD's), 32 channels at 32x, normalised by one `scaling_factor` (0.41407) as
  `AutoencoderKL`, as `SanaPipeline` and diffusers' Sana script scale them.
- `AutoencoderOobleck` (ACE-Step's, Stable Audio's kind): a sound's waveform (B, 2, samples) into 64 channels of
  latent frames at its hop (`downsampling_ratios`' product: 1920 samples at 48 kHz, 25 a second), not normalised (its
  config has no scale; `AceStepPipeline` decodes the latents as they are). Everything outside this module sees a
  sound as an image one row high: its waveform (B, 2, 1, samples), its latents (B, C, 1, frames).
- `AutoencoderKLMiniMaxH3` (MiniMax-H3): a causal 3D encoder at 16x in space with a ViT decoder, 24 channels,
  per-channel statistics as Wan's. It reads ImageNet-normalised RGB over [0, 1] (`(pixel - mean) / std`, what its
  pipeline gives it), not [-1, 1], and encodes clips in chunks of 17 frames, dropping 3 latent frames of each: clips
  take 17n + 5 frames (5n + 2 latent frames), an image is one latent frame (`clip_lengths`, `latent_frames`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import (
    AutoencoderDC,
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLHunyuanImage,
    AutoencoderKLHunyuanVideo,
    AutoencoderKLHunyuanVideo15,
    AutoencoderKLLTX2Video,
    AutoencoderKLMiniMaxH3,
    AutoencoderKLQwenImage,
    AutoencoderKLQwenImage21,
    AutoencoderKLWan,
    AutoencoderOobleck,
    AutoencoderTiny,
)

from difftune.errors import DifftuneError
from difftune.memory.transfer import host_randn

VAE_CLASSES = {
    "AutoencoderKL": AutoencoderKL,
    "AutoencoderTiny": AutoencoderTiny,
    "AutoencoderKLQwenImage": AutoencoderKLQwenImage,
    "AutoencoderKLFlux2": AutoencoderKLFlux2,
    "AutoencoderKLWan": AutoencoderKLWan,
    "AutoencoderKLQwenImage21": AutoencoderKLQwenImage21,
    "AutoencoderKLHunyuanVideo": AutoencoderKLHunyuanVideo,
    "AutoencoderKLHunyuanImage": AutoencoderKLHunyuanImage,
    "AutoencoderKLHunyuanVideo15": AutoencoderKLHunyuanVideo15,
    "AutoencoderDC": AutoencoderDC,
    "AutoencoderOobleck": AutoencoderOobleck,
    "AutoencoderKLMiniMaxH3": AutoencoderKLMiniMaxH3,
}
# Encoders that return their latents, not a posterior (a std of 0).
DETERMINISTIC_AUTOENCODERS = (AutoencoderTiny, AutoencoderDC)
# Latents with a time axis.
VIDEO_AUTOENCODERS = (
    AutoencoderKLQwenImage,
    AutoencoderKLWan,
    AutoencoderKLQwenImage21,
    AutoencoderKLHunyuanVideo,
    AutoencoderKLHunyuanVideo15,
    AutoencoderKLLTX2Video,
    AutoencoderKLMiniMaxH3,
)
# Pixels read ImageNet-normalised over [0, 1] (mean, std per channel), as their pipelines give them.
IMAGENET_PIXELS = (AutoencoderKLMiniMaxH3,)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
PATCHED_AUTOENCODERS = (AutoencoderKLFlux2,)  # latents read patched 2x2 into channels
SOUND_AUTOENCODERS = (AutoencoderOobleck,)  # waveforms, seen as images one row high


@dataclass(frozen=True)
class LatentNormalization:
    """`latents = (encoded - shift) * scale`: floats (every channel alike) or per-channel tuples."""

    scale: float | tuple[float, ...] = 1.0
    shift: float | tuple[float, ...] = 0.0

    def apply(self, encoded: torch.Tensor) -> torch.Tensor:
        return (encoded - _per_channel(self.shift, encoded)) * _per_channel(self.scale, encoded)

    def invert(self, latents: torch.Tensor) -> torch.Tensor:
        return latents / _per_channel(self.scale, latents) + _per_channel(self.shift, latents)


def _per_channel(value: float | tuple[float, ...], like: torch.Tensor) -> float | torch.Tensor:
    if isinstance(value, float):
        return value
    return torch.tensor(value, device=like.device, dtype=like.dtype).view(1, -1, *([1] * (like.dim() - 2)))


def latent_normalization(vae, batch_norm_eps: float | None = None) -> LatentNormalization:
    """The normalisation an autoencoder asks for, in its config or its batch norm (see the module's docstring);
    `batch_norm_eps`: the epsilon a family's pipeline un-normalises with where it is not the config's."""
    if isinstance(vae, PATCHED_AUTOENCODERS):
        eps = vae.config.batch_norm_eps if batch_norm_eps is None else batch_norm_eps
        std = torch.sqrt(vae.bn.running_var.float() + eps)
        return LatentNormalization(tuple((1.0 / std).tolist()), tuple(vae.bn.running_mean.float().tolist()))
    if isinstance(vae, AutoencoderKLLTX2Video):
        scale = float(vae.config.scaling_factor) / vae.latents_std.float()
        return LatentNormalization(tuple(scale.tolist()), tuple(vae.latents_mean.float().tolist()))
    vae_config = vae.config
    if getattr(vae_config, "latents_std", None) is not None:
        scale = (1.0 / torch.tensor(vae_config.latents_std)).tolist()  # fp32, as the pipelines compute it
        return LatentNormalization(tuple(scale), tuple(float(m) for m in vae_config.latents_mean))
    if isinstance(vae, SOUND_AUTOENCODERS):
        return LatentNormalization()
    return LatentNormalization(
        float(vae_config.scaling_factor), float(getattr(vae_config, "shift_factor", None) or 0.0)
    )


def latent_channels(vae) -> int:
    """Channels of the latents `vae` makes (`z_dim` in the video autoencoders' configs)."""
    config = vae.config
    if isinstance(vae, PATCHED_AUTOENCODERS):
        return config.latent_channels * 4
    if isinstance(vae, SOUND_AUTOENCODERS):
        return config.decoder_input_channels
    return config.latent_channels if "latent_channels" in config else config.z_dim


def downsampling(vae) -> int:
    """Image pixels per latent pixel, along each side (a sound's samples per latent frame)."""
    if isinstance(vae, SOUND_AUTOENCODERS):
        return vae.hop_length
    if isinstance(vae, VIDEO_AUTOENCODERS):  # Wan 2.2's states 16: 8x by its blocks, 2x by its own patching
        config = vae.config
        return (
            config.get("scale_factor_spatial")
            or config.get("spatial_compression_ratio")  # HunyuanVideo's
            or getattr(vae, "spatial_compression_ratio", None)  # LTX-2's, from its blocks
            or 2 ** len(config.temperal_downsample)
        )
    blocks = (
        vae.config.encoder_block_out_channels
        if isinstance(vae, DETERMINISTIC_AUTOENCODERS)
        else vae.config.block_out_channels
    )
    return 2 ** (len(blocks) - 1) * (2 if isinstance(vae, PATCHED_AUTOENCODERS) else 1)


def sampling_rate(vae) -> int:
    """A sound autoencoder's samples a second; 0 for a picture autoencoder (or none)."""
    return int(vae.config.sampling_rate) if isinstance(vae, SOUND_AUTOENCODERS) else 0


def frames_per_latent(vae) -> int:
    """Clip frames per latent frame after the first (a causal video autoencoder's temporal factor: Wan's 4), so clips
    take 4k + 1 frames; 1 for an image autoencoder."""
    if not isinstance(vae, VIDEO_AUTOENCODERS):
        return 1
    config = vae.config
    return (
        config.get("scale_factor_temporal")
        or config.get("temporal_compression_ratio")  # HunyuanVideo's
        or getattr(vae, "temporal_compression_ratio", None)  # LTX-2's, from its blocks
        or 2 ** sum(config.temperal_downsample)
    )


def clip_lengths(vae) -> tuple[int, int]:
    """(step, shortest): the clip lengths the autoencoder takes are shortest + k x step frames; a causal video
    autoencoder's are k x its temporal factor + 1 (Wan's 4k + 1), MiniMax-H3's 17n + 5 (its chunks of 17 frames)."""
    if isinstance(vae, AutoencoderKLMiniMaxH3):
        return vae.config.clip_length, vae.tokens_chunk_size
    return frames_per_latent(vae), 1


def latent_frames(vae, frames: int) -> int:
    """Latent frames of a clip of `frames` frames (a length `clip_lengths` allows; 1: an image)."""
    if isinstance(vae, AutoencoderKLMiniMaxH3) and frames > 1:
        step, shortest = clip_lengths(vae)
        return (frames - shortest) // step * vae.tokens_chunk_size + shortest - vae.config.token_drop
    return (frames - 1) // frames_per_latent(vae) + 1


def load_vae(name: str):
    """An autoencoder of a kind above from a folder (or a pipeline folder's `vae/`) or hub id."""
    subfolder = "vae" if (Path(name) / "vae" / "config.json").is_file() else None
    class_name = AutoencoderKL.load_config(name, subfolder=subfolder).get("_class_name")
    if class_name not in VAE_CLASSES:
        raise DifftuneError(f"model.vae {name}: is a {class_name}; allowed kinds: {', '.join(VAE_CLASSES)}")
    return VAE_CLASSES[class_name].from_pretrained(name, subfolder=subfolder, dtype=torch.float32)


def encode_posterior(vae, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 3, H, W) in [-1, 1] -> the posterior's mean and std (B, C, H/f, W/f), not normalised; a video
    autoencoder's clips (B, 3, T, H, W) -> (B, C, t, H/f, W/f). An RGBA autoencoder reads RGB as opaque, or
    (B, 4, ...) with `data.keep_alpha`. TAESD and DC-AE are deterministic: their std is 0. This is what the latent
    cache stores."""
    weight = next(vae.parameters())  # not vae.device / vae.dtype: each walks every module, 1.6 ms a step
    if isinstance(vae, SOUND_AUTOENCODERS):  # (B, 2, 1, samples) -> (B, C, 1, frames)
        posterior = vae.encode(pixels[:, :, 0].to(weight.device, weight.dtype)).latent_dist
        return posterior.mean[:, :, None], posterior.std[:, :, None]
    pixels = as_read_by(vae, pixels.to(weight.device, weight.dtype))
    if pixels.dim() == 5:
        if not isinstance(vae, VIDEO_AUTOENCODERS):
            raise DifftuneError(f"a {type(vae).__name__} encodes images, not clips")
        posterior = vae.encode(pixels).latent_dist
        return posterior.mean, posterior.std
    if isinstance(vae, DETERMINISTIC_AUTOENCODERS):
        encoded = vae.encode(pixels)
        mean = encoded.latents if isinstance(vae, AutoencoderTiny) else encoded.latent
        return mean, torch.zeros_like(mean)
    if isinstance(vae, VIDEO_AUTOENCODERS):
        posterior = vae.encode(pixels[:, :, None]).latent_dist  # one frame
        return posterior.mean[:, :, 0], posterior.std[:, :, 0]
    posterior = vae.encode(pixels).latent_dist
    if isinstance(vae, PATCHED_AUTOENCODERS):
        return patched(posterior.mean), patched(posterior.std)
    return posterior.mean, posterior.std


def as_read_by(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Pixels (B, 3 or 4, ...) in [-1, 1] as the autoencoder reads them: RGB given an opaque alpha where it reads
    RGBA; RGBA refused where it reads RGB; ImageNet-normalised where it reads that (`IMAGENET_PIXELS`)."""
    if isinstance(vae, IMAGENET_PIXELS):
        return ((pixels + 1) / 2 - _per_channel(IMAGENET_MEAN, pixels)) / _per_channel(IMAGENET_STD, pixels)
    rgba = reads_rgba(vae)
    if pixels.shape[1] == 3 and rgba:
        return torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)
    if pixels.shape[1] == 4 and not rgba:
        raise DifftuneError(
            f"data.keep_alpha: this base's {type(vae).__name__} reads RGB images, not RGBA; set data.keep_alpha = false"
        )
    return pixels


def reads_rgba(vae) -> bool:
    """Whether an autoencoder reads RGBA images: Qwen-Image 2.1's (its config says `in_channels` 4),
    Qwen-Image-Layered's (`input_channels` 4). Wan 2.2's `in_channels` 12 is RGB patched 2x2."""
    return 4 in (vae.config.get("in_channels"), vae.config.get("input_channels"))


def patched(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, 4C, h/2, w/2), each 2x2 patch's values as channels, as `Flux2Pipeline._patchify_latents`."""
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatched(latents: torch.Tensor) -> torch.Tensor:
    """Inverse of `patched`."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)


def sample_latents(
    mean: torch.Tensor, std: torch.Tensor, generators: list[torch.Generator], normalization: LatentNormalization
) -> torch.Tensor:
    """One posterior sample per image, each from its own generator (so a sample's latents do not depend on the
    rest of its batch), normalised for the denoiser."""
    eps = host_randn(mean.shape, generators, mean.device, mean.dtype)
    return normalization.apply(mean + std * eps)


def encode_latents(vae, pixels: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> normalised latents (B, C, H/f, W/f), one posterior sample per image."""
    mean, std = encode_posterior(vae, pixels)
    return sample_latents(mean, std, generators, latent_normalization(vae))


def reference_latents(mean: torch.Tensor, normalization: LatentNormalization) -> torch.Tensor:
    """A control (reference) image's latents for an edit base: its posterior's mode, normalised, never a draw (as
    diffusers' Kontext and Qwen-Image-Edit pipelines encode the image they edit: `sample_mode="argmax"`)."""
    return normalization.apply(mean).float()


def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Inverse of `encode_latents` (up to the autoencoder's loss): normalised latents -> pixels in [-1, 1]."""
    encoded = latent_normalization(vae).invert(latents.to(vae.dtype))
    if isinstance(vae, SOUND_AUTOENCODERS):  # a sound's waveform, one row high
        return vae.decode(encoded[:, :, 0]).sample[:, :, None]
    if latents.dim() == 5:  # a clip's
        decoded = vae.decode(encoded).sample
    elif isinstance(vae, VIDEO_AUTOENCODERS):
        decoded = vae.decode(encoded[:, :, None]).sample[:, :, 0]
    elif isinstance(vae, PATCHED_AUTOENCODERS):
        decoded = vae.decode(unpatched(encoded)).sample
    else:
        decoded = vae.decode(encoded).sample
    if isinstance(vae, IMAGENET_PIXELS):
        decoded = (decoded * _per_channel(IMAGENET_STD, decoded) + _per_channel(IMAGENET_MEAN, decoded)) * 2 - 1
    return decoded[:, :3]  # an RGBA autoencoder's alpha left out
