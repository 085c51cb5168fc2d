"""Building the bundled tiny bases: a KL autoencoder, a TAESD distilled to its latent space, then the denoiser
and text encoder(s) trained by difftune's own trainer (full fine-tune) on synthetic shapes. tiny-sdxl
reuses tiny-sd's autoencoders (SDXL keeps SD's VAE architecture; a new latent space would teach nothing new)
and trains an SDXL-conditioned UNet and two text encoders the same way. tiny-flux trains its own 16-channel
autoencoders (Flux.1's latent space is a different one, with a shift factor) and a flow-matching transformer
with CLIP and T5; tiny-qwen_image its own Wan-style video autoencoder (per-channel statistics), an MMDiT and a
Qwen2.5-VL language model.

The autoencoders are trained here with a plain reconstruction loop: difftune's trainer is for the
diffusion model, and an autoencoder needs none of its machinery. One color (`HELD_OUT_COLOR`) is never
shown to the UNet and text encoder, so fine-tuning can be judged on a concept the base does not know;
the autoencoders see every color, as SD's VAE saw every kind of image.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import random
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import (
    AutoencoderKL,
    AutoencoderKLQwenImage,
    AutoencoderTiny,
    AutoModel,
    DiffusionPipeline,
)
from tqdm.auto import tqdm

from difftune.config import FAMILY_NAMES, ModelConfig, load_config
from difftune.data.dataset import image_to_tensor
from difftune.families import FAMILIES, load_components
from difftune.models.autoencoders import (
    PATCHED_AUTOENCODERS,
    VIDEO_AUTOENCODERS,
    as_read_by,
    decode_latents,
    downsampling,
    encode_posterior,
    latent_normalization,
    unpatched,
)
from difftune.toy.micro import assemble_tiny_pipeline, builder, tiny_base_of
from difftune.toy.tiny import (
    CLIP_FRAMES,
    COLORS,
    DIRECTIONS,
    SHAPES,
    build_flux2_vae,
    build_qwen_image21_vae,
    build_qwen_vae,
    build_taesd,
    build_vae,
    build_wan_vae,
    moving_shape_clips,
    recolor_pairs,
    render_shape,
    render_tensors,
    set_batch_norm_statistics,
    set_latent_scaling,
    set_latent_statistics,
    shape_images,
    write_caption_folder,
    write_clip_folder,
    write_pair_folder,
)
from difftune.training.metrics import read_metrics

HELD_OUT_COLOR = "purple"
# Each family's recipe, autoencoder and lender are its micro module's (`TINY_BASE`: toy/micro/__init__.py's TinyBase).
TINY_BASES = {family: spec for family in FAMILY_NAMES if (spec := tiny_base_of(family))}
SEEN_COLORS = tuple(color for color in COLORS if color != HELD_OUT_COLOR)


def clip_tensors(count: int, seed: int, colors=tuple(COLORS)) -> torch.Tensor:
    """(count, 3, 5, 32, 32) moving-shape clips in [-1, 1]."""
    return torch.stack(
        [
            torch.stack([image_to_tensor(frame) for frame in frames], dim=1)
            for frames, _ in moving_shape_clips(count, seed, colors=colors)
        ]
    )


def psnr(reconstructed: torch.Tensor, reference: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB of images in [-1, 1], measured on the [0, 1] scale."""
    mse = F.mse_loss((reconstructed.clamp(-1, 1) + 1) / 2, (reference + 1) / 2).item()
    return 10 * math.log10(1 / mse)


def _batches(tensors: tuple[torch.Tensor, ...], batch_size: int, steps: int, seed: int):
    """`steps` random batches, the same rows of each tensor (images with their latents)."""
    rng = random.Random(seed)
    for _ in range(steps):
        rows = rng.sample(range(len(tensors[0])), batch_size)
        yield [tensor[rows] for tensor in tensors]


def cosine_lr(optimizer, peak: float, step: int, steps: int, warmup: int = 50) -> None:
    """The learning rate at `step`: a linear warmup over `warmup` steps (1: none), then a cosine from `peak` to 0."""
    lr = peak * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
    for group in optimizer.param_groups:
        group["lr"] = lr


def _fit(
    parameters,
    batch_loss,
    tensors: tuple[torch.Tensor, ...],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    desc: str,
) -> None:
    """AdamW (no weight decay) with warmup + cosine on random batches: the loop every autoencoder stage shares."""
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    for step, batch in enumerate(tqdm(_batches(tensors, batch_size, steps, seed), total=steps, desc=desc)):
        cosine_lr(optimizer, lr, step, steps)
        loss = batch_loss(*batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def _posterior(vae, images: torch.Tensor):
    """The posterior of (B, 3 or 4, H, W) images, to train on; Wan's video autoencoder reads them as one-frame clips
    (its latents keep the time axis, which `_decode` takes back)."""
    return vae.encode(images[:, :, None] if isinstance(vae, VIDEO_AUTOENCODERS) else images).latent_dist


def _decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """Unnormalised latents (with the time axis for Wan's autoencoder; patched or not for FLUX.2's) -> (B, 3, H, W), or
    RGBA (B, 4, H, W) from an autoencoder of RGBA images."""
    if isinstance(vae, VIDEO_AUTOENCODERS) and latents.dim() == 4:
        latents = latents[:, :, None]
    if isinstance(vae, PATCHED_AUTOENCODERS) and latents.shape[1] != vae.config.latent_channels:
        latents = unpatched(latents)
    decoded = vae.decode(latents).sample
    return decoded[:, :, 0] if decoded.dim() == 5 and decoded.shape[2] == 1 else decoded  # a still's frame; a clip


def train_vae(
    images: torch.Tensor,
    steps: int,
    batch_size: int = 64,
    lr: float = 2e-3,
    kl_weight: float = 1e-6,
    seed: int = 0,
    latent_channels: int = 4,
    kind: str = "kl",
    shift: bool = False,
    color_weight: float = 0.0,
    base_dim: int = 8,
    dim_mult: tuple[int, ...] = (1, 1, 1, 1, 1),
):
    """The KL autoencoder (`kind` "kl": SD's and Flux's AutoencoderKL; "causal_video": Wan's video autoencoder,
    Qwen-Image's; "rgba_16x": Qwen-Image 2.1's of RGBA images at 16x, learning the shapes' renders as opaque images;
    "batch_norm": FLUX.2's, whose batch norm then holds its patched latents' statistics, as training it leaves them):
    MSE on reconstructions of posterior samples plus a small KL term (SD's VAE recipe without its perceptual and GAN
    losses, which 32 px flat shapes do not need). Its normalisation is set from the latents afterwards: SD's kind
    gets scaling factor 1/std, the way SD's 0.18215 was chosen, and with `shift` a shift factor (their mean, as
    Flux.1's autoencoder has); Wan's kind gets per-channel `latents_mean` / `latents_std`, as Wan's has.

    `color_weight`: the posterior means' first three channels also learn the image's colors at the latents'
    resolution (MSE to the average-pooled pixels), as a real autoencoder's latents hold colors near linearly (the
    latent-to-RGB factors previews decode with): with reconstruction alone, Wan's kind put purple and blue squares
    0.079 apart in its normalised latents (red and blue: 1.08), under its own posterior's noise."""
    torch.manual_seed(seed)
    builders = {
        "causal_video": build_qwen_vae,
        "rgba_16x": lambda: build_qwen_image21_vae(latent_channels, base_dim, dim_mult),
        "batch_norm": lambda: build_flux2_vae(latent_channels),
    }
    vae = builders.get(kind, lambda: build_vae(latent_channels=latent_channels))()
    with torch.no_grad():  # start with a narrow posterior (log-variance -6): +1 dB at 300 steps, measured
        vae.quant_conv.bias[vae.quant_conv.out_channels // 2 :].fill_(-6.0)
    images = as_read_by(vae, images)

    def loss(batch):
        posterior = _posterior(vae, batch)
        loss = F.mse_loss(_decode(vae, posterior.sample()), batch) + kl_weight * posterior.kl().mean()
        if color_weight:
            means = posterior.mean[:, :3, 0] if posterior.mean.dim() == 5 else posterior.mean[:, :3]
            colors = F.avg_pool2d(batch[:, :3], batch.shape[-1] // means.shape[-1])  # an RGBA batch's alpha left out
            loss = loss + color_weight * F.mse_loss(means, colors)
        return loss

    _fit(vae.parameters(), loss, (images,), steps, batch_size, lr, seed, "vae")
    vae.eval()
    latents = posterior_means(vae, images[:512])
    if kind in ("causal_video", "rgba_16x"):
        set_latent_statistics(vae, latents)
    elif kind == "batch_norm":
        set_batch_norm_statistics(vae, latents)
    else:
        set_latent_scaling(vae, latents, shift)
    return vae


@torch.no_grad()
def posterior_means(vae, images: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    """The encoder's latents (unnormalised, (B, C, h, w)), in batches."""
    return torch.cat([encode_posterior(vae, batch)[0] for batch in images.split(batch_size)])


def finetune_decoder(
    vae, images: torch.Tensor, latents: torch.Tensor, steps: int, batch_size: int = 32, lr: float = 1e-3, seed: int = 0
):
    """Train the decoder alone on the posterior means (`latents`, computed once: the encoder is frozen), as SD's
    ft-MSE VAE was made: the latent space the UNet learns stays as it is, while decoding gets sharper
    (on one encoder, 1150 steps: +3.6 dB at lr 5e-4, +4.9 dB at lr 1e-3, measured)."""

    def loss(batch, batch_latents):
        return F.mse_loss(_decode(vae, batch_latents), batch)

    post_quant_conv = getattr(vae, "post_quant_conv", None)  # LTX-2's video autoencoder has none
    decoder_params = [*vae.decoder.parameters(), *(post_quant_conv.parameters() if post_quant_conv else ())]
    _fit(decoder_params, loss, (as_read_by(vae, images), latents), steps, batch_size, lr, seed + 2, "vae decoder")
    return vae.eval()


def distill_taesd(
    images: torch.Tensor,
    scaled_latents: torch.Tensor,
    steps: int,
    batch_size: int = 64,
    lr: float = 2e-3,
    seed: int = 0,
    downsampling: int = 4,
) -> AutoencoderTiny:
    """A TAESD whose encoder outputs the KL VAE's normalised latents (of the posterior mean) and whose
    decoder reconstructs the image from them, as TAESD does for SD: either autoencoder can encode for
    training and either can decode a sample."""
    torch.manual_seed(seed)
    taesd = build_taesd(scaled_latents.shape[1], downsampling)

    def loss(batch, target):
        latent_loss = F.mse_loss(taesd.encode(batch).latents, target)
        image_loss = F.mse_loss(taesd.decode(target).sample, batch)  # decoder from the true latents
        return latent_loss + image_loss

    _fit(taesd.parameters(), loss, (images, scaled_latents), steps, batch_size, lr, seed + 1, "taesd")
    return taesd.eval()


@torch.no_grad()
def autoencoder_scores(vae, taesd: AutoencoderTiny, images: torch.Tensor) -> dict:
    """Held-out reconstruction PSNR of both autoencoders, and TAESD's latent error relative to the KL latents."""
    normalization = latent_normalization(vae)
    kl_latents = normalization.apply(posterior_means(vae, images))
    taesd_latents = taesd.encode(images).latents
    return {
        "vae_psnr_db": psnr(decode_latents(vae, kl_latents), images),
        "taesd_psnr_db": psnr(taesd.decode(taesd_latents).sample, images),
        "taesd_decoder_psnr_db": psnr(taesd.decode(kl_latents).sample, images),
        "taesd_latent_rmse": F.mse_loss(taesd_latents, kl_latents).sqrt().item(),
        "latent_std": kl_latents.std().item(),
        "color_distances": color_distances(vae),
    }


@torch.no_grad()
def color_distances(vae, layouts: int = 12, seed: int = 0) -> dict[str, float]:
    """How far apart each pair of colors lies in the normalised latents the denoiser learns: the RMS distance between
    the posterior means of the same render (shape, size, place, background) in the two colors, averaged over
    `layouts` renders. A pair much closer than the others is one the denoiser can barely tell apart."""
    normalization = latent_normalization(vae)
    by_color = {}
    for color in COLORS:
        rng = np.random.default_rng(seed)  # the same layouts for every color
        renders = [render_shape(SHAPES[i % len(SHAPES)], color, rng) for i in range(layouts)]
        by_color[color] = normalization.apply(posterior_means(vae, torch.stack([image_to_tensor(r) for r in renders])))
    return {
        f"{a}-{b}": (by_color[a] - by_color[b]).pow(2).mean(dim=(1, 2, 3)).sqrt().mean().item()
        for a, b in itertools.combinations(COLORS, 2)
    }


@contextmanager
def timed(seconds: dict, stage: str):
    """Add a stage's wall time to `seconds[stage]`, for the model card."""
    started = time.perf_counter()
    yield
    seconds[stage] = round(seconds.get(stage, 0) + time.perf_counter() - started, 1)  # stages run again add up


@dataclass
class Recipe:
    """How the base is made; the defaults are what `scripts/make_tiny_base.py` commits."""

    family: str  # whose micro pipeline, at these sizes; its `TINY_BASE` says whose autoencoders
    seed: int = 0
    autoencoder_images: int = 4000
    vae_steps: int = 1000
    vae_decoder_steps: int = 1000
    vae_decoder_lr: float = 1e-3
    vae_color_weight: float = 0.0  # Qwen-Image's: its latents' first three channels learn the colors (train_vae)
    taesd_steps: int = 450
    autoencoder_batch: int = 32
    unet_block_out_channels: tuple[int, ...] = (32, 64, 64)
    train_images_per_prompt: int = 200
    validation_images_per_prompt: int = 8
    steps: int = 1300
    batch_size: int = 128
    learning_rate: float = 1e-3
    weighting: str = "min_snr"  # or "uniform"
    noise_offset: float = 0.1  # see base_training_overrides
    ema_decay: float = 0.999
    flux_layers: tuple[int, int] = (2, 4)  # double- and single-stream blocks
    flux_heads: int = 6  # of 16 dimensions each
    dit_layers: int = 3  # Qwen-Image's and SD3's MMDiT blocks, Z-Image's single-stream ones
    dit_heads: int = 6  # of 16 dimensions each
    language_model_width: int = 64  # the Qwen2.5-VL / Qwen3 language model's width
    train_text_encoder: bool = True  # trained with the denoiser; else kept at its random init (its states cached)
    text_tokens: int | None = None  # FLUX.2 [klein], LTX-2: the caption length its tokenizer states
    caption_words: bool = False  # Qwen-Image: a token for each caption word (tiny.build_qwen_tokenizer), not bytes
    timestep_sampling: str = "uniform"
    flow_shift_by_resolution: bool = False  # flow matching: draw noise levels with the sampler's own shift


def write_renders(folder: Path, images_per_prompt: int, seed: int, colors=SEEN_COLORS) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    write_caption_folder(folder, shape_images(images_per_prompt * len(colors) * 3, seed, colors=colors))
    return folder


def write_clips(folder: Path, clips_per_prompt: int, seed: int, colors=SEEN_COLORS) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    write_clip_folder(
        folder, moving_shape_clips(clips_per_prompt * len(colors) * len(SHAPES) * len(DIRECTIONS), seed, colors=colors)
    )
    return folder


def base_training_overrides(
    recipe: Recipe, init_dir: Path, data_dir: Path, validation_dir: Path, output_dir: Path, cache_dir: Path
) -> list[str]:
    """The difftune job that trains the UNet and text encoder from scratch (full fine-tune of a random init).

    Offset noise: an 8x8 latent's per-channel noise mean varies by 1/8, more than the signal SD's schedule leaves
    at its last step, so without it the UNet reads the image's color from the initial noise's mean (one eval seed
    turned 5 of 12 prompts red or purple); with 0.1 seen-prompt color went 0.93 -> 1.00, shape 0.92 -> 0.96."""
    values = {
        "model.base": init_dir,
        "data.path": data_dir,
        "data.resolution": 32,
        "data.random_flip": "false",
        "data.caption_dropout": 0.1,
        "data.num_workers": 0,
        "adapter.kind": "none",
        "adapter.text_encoder": str(recipe.train_text_encoder).lower(),
        "cache.text": str(not recipe.train_text_encoder).lower(),
        "loss.weighting": recipe.weighting,
        "loss.noise_offset": recipe.noise_offset,
        "loss.timestep_sampling": recipe.timestep_sampling,
        "loss.flow_shift_by_resolution": str(recipe.flow_shift_by_resolution).lower(),
        "optim.learning_rate": recipe.learning_rate,
        "optim.lr_schedule": "cosine",
        "optim.warmup_steps": 50,
        "optim.weight_decay": 0.0,
        "train.output_dir": output_dir,
        "train.overwrite": "true",
        "train.max_steps": recipe.steps,
        "train.batch_size": recipe.batch_size,
        "train.seed": recipe.seed,
        "ema.enabled": "true",
        "ema.decay": recipe.ema_decay,
        "validation.path": validation_dir,
        "validation.every_steps": 100,
        "cache.latents": "true",
        "cache.dir": cache_dir,
        "checkpoint.every_steps": 0,
        "log.tensorboard": "false",
    }
    return [f"{key}={value}" for key, value in values.items()]


def train_clip_vae(lender: Path | None, recipe: Recipe) -> torch.nn.Module:
    """A video autoencoder trained on moving-shape clips of every color as `train_vae` trains (MSE on reconstructions
    of posterior samples plus a small KL term), then its decoder alone on the clips' posterior means for
    `recipe.vae_decoder_steps` (`finetune_decoder`), its per-channel statistics set from clips' latents. It starts
    from `lender`'s (Wan's: an `AutoencoderKLQwenImage` of the same shape, trained on stills), or without one from the
    family's own (`TinyBase.clip_autoencoder`) at its random init."""
    torch.manual_seed(recipe.seed)
    if lender is None:
        vae = TINY_BASES[recipe.family].clip_autoencoder()
    else:
        stills = AutoencoderKLQwenImage.from_pretrained(lender / "vae", dtype=torch.float32)
        vae = build_wan_vae()
        vae.load_state_dict(stills.state_dict())
    clips = clip_tensors(recipe.autoencoder_images // 2, recipe.seed + 100)

    def loss(batch):
        posterior = vae.encode(batch).latent_dist
        return F.mse_loss(vae.decode(posterior.sample()).sample, batch) + 1e-6 * posterior.kl().mean()

    _fit(
        vae.parameters(), loss, (clips,), recipe.vae_steps, recipe.autoencoder_batch // 2, 1e-3, recipe.seed, "clip vae"
    )
    vae.eval()
    vae = finetune_clip_decoder(vae, recipe, clips)
    set_latent_statistics(vae, posterior_means(vae, clips[:256], batch_size=64))
    return vae


def finetune_clip_decoder(vae, recipe: Recipe, clips: torch.Tensor | None = None) -> torch.nn.Module:
    """A video autoencoder's decoder trained alone on clips' posterior means (`finetune_decoder`): the encoder and so
    the latent space stay, so a built base's transformer keeps what it learned while its clips decode sharper (LTX-2's
    squares through the autoencoder alone: 0.875 before, 1.000 after, docs/benchmarks.md)."""
    if not recipe.vae_decoder_steps:
        return vae
    clips = clip_tensors(recipe.autoencoder_images // 2, recipe.seed + 100) if clips is None else clips
    latents = posterior_means(vae, clips, batch_size=64)
    return finetune_decoder(
        vae, clips, latents, recipe.vae_decoder_steps, recipe.autoencoder_batch // 2, recipe.vae_decoder_lr, recipe.seed
    )


@torch.no_grad()
def clip_autoencoder_scores(vae, clips: torch.Tensor) -> dict:
    """Held-out reconstruction PSNR of a video autoencoder: the whole clip, its first frame, and its later frames."""
    reconstructed = decode_latents(vae, latent_normalization(vae).apply(posterior_means(vae, clips, batch_size=64)))
    return {
        "vae_psnr_db": psnr(reconstructed, clips),
        "first_frame_psnr_db": psnr(reconstructed[:, :, 0], clips[:, :, 0]),
        "later_frames_psnr_db": psnr(reconstructed[:, :, 1:], clips[:, :, 1:]),
    }


def train_autoencoders(recipe: Recipe) -> tuple[AutoencoderKL | AutoencoderKLQwenImage, AutoencoderTiny]:
    torch.manual_seed(recipe.seed)
    images = render_tensors(recipe.autoencoder_images, recipe.seed + 100)
    vae = train_vae(
        images,
        recipe.vae_steps,
        recipe.autoencoder_batch,
        seed=recipe.seed,
        color_weight=recipe.vae_color_weight,
        **TINY_BASES[recipe.family].autoencoder,
    )
    latents = posterior_means(vae, images)
    vae = finetune_decoder(
        vae, images, latents, recipe.vae_decoder_steps, recipe.autoencoder_batch, recipe.vae_decoder_lr, recipe.seed
    )
    taesd = distill_taesd(
        images,
        latent_normalization(vae).apply(latents),
        recipe.taesd_steps,
        recipe.autoencoder_batch,
        seed=recipe.seed,
        downsampling=downsampling(vae),
    )
    return vae, taesd


def build_base(out_dir: Path, work_dir: Path, recipe: Recipe, autoencoders_from: Path | None = None) -> dict:
    """Train everything (the autoencoders: unless `autoencoders_from`, a built base folder, lends its `vae/` and
    `taesd/`) and write the pipeline folder (fp16) with `taesd/` beside `vae/`; returns the facts for the model
    card (scores of the autoencoders, seconds per stage, the recipe)."""
    seconds: dict[str, float] = {}
    work_dir.mkdir(parents=True, exist_ok=True)
    clips = FAMILIES[recipe.family].reads_clips  # a video base: its autoencoder learns time, its transformer motion
    with timed(seconds, "autoencoders"):
        if clips:  # no TAESD: AutoencoderTiny reads images alone
            vae, taesd = train_clip_vae(autoencoders_from, recipe), None
            scores = clip_autoencoder_scores(vae, clip_tensors(100, recipe.seed + 999))
        else:
            if autoencoders_from:
                vae = AutoModel.from_pretrained(
                    str(autoencoders_from / "vae"), dtype=torch.float32
                )  # the lender's class
                taesd = AutoencoderTiny.from_pretrained(autoencoders_from / "taesd", dtype=torch.float32)
            else:
                vae, taesd = train_autoencoders(recipe)
            scores = autoencoder_scores(vae, taesd, render_tensors(300, recipe.seed + 999))
    init_dir = work_dir / "init"
    init = write_untrained_control(vae, recipe, init_dir)
    with timed(seconds, "unet_and_text_encoder"):  # the training schedule, the micro pipeline's
        pipeline, validation = _train_denoiser(recipe, init_dir, work_dir, init.scheduler)
    shutil.rmtree(out_dir, ignore_errors=True)
    FAMILIES[recipe.family].loading.save_pipeline(pipeline.to(torch.float16), out_dir)
    if taesd is not None:
        taesd.to(torch.float16).save_pretrained(out_dir / "taesd", safe_serialization=True)
    return {"recipe": asdict(recipe), "seconds": seconds, "autoencoders": scores, "validation_loss": validation}


def _train_denoiser(recipe: Recipe, start: Path, work_dir: Path, scheduler) -> tuple[object, list[dict]]:
    """`recipe.steps` of the base's training job from the pipeline folder `start`, on the recipe's renders (or clips);
    returns the pipeline of its EMA weights with `scheduler` (samplers are chosen at sampling) and its validation
    losses."""
    from difftune.training.train import train

    clips = FAMILIES[recipe.family].reads_clips
    write = write_clips if clips else write_renders
    data_dir = write(work_dir / "train", recipe.train_images_per_prompt, recipe.seed + 1)
    validation_dir = write(work_dir / "validation", recipe.validation_images_per_prompt, recipe.seed + 2)
    run_dir = work_dir / "run"
    overrides = base_training_overrides(recipe, start, data_dir, validation_dir, run_dir, work_dir / "cache")
    train(load_config(None, overrides + ([f"data.target_frames=[{CLIP_FRAMES}]"] if clips else [])))
    pipeline = load_components(ModelConfig(base=str(run_dir / "model_ema"))).pipeline(scheduler)
    validation = [
        {key: row[key] for key in ("step", "val_loss", "val_loss_ema")}
        for row in read_metrics(run_dir)
        if "val_loss" in row
    ]
    return pipeline, validation


def continue_denoiser(model_dir: Path, work_dir: Path, recipe: Recipe, steps: int) -> dict:
    """A built base's denoiser trained `steps` more by the base's own job, from its saved (EMA) weights at half the
    recipe's peak learning rate (the weights sit near a minimum already; the full peak would first undo some of it),
    its autoencoders and text encoders kept. Writes the new denoiser over the old one and the untrained control;
    returns the earlier build's facts with the continuation added (its steps, rate, time and validation losses, numbered
    on from the build's)."""
    facts = json.loads((model_dir / "scores.json").read_text())
    base = load_components(ModelConfig(base=str(model_dir)))
    write_untrained_control(base.vae.to(torch.float32), recipe, work_dir / "init")
    more = replace(recipe, steps=steps, learning_rate=recipe.learning_rate / 2)
    with timed(facts["seconds"], "denoiser_continued"):
        pipeline, validation = _train_denoiser(more, model_dir, work_dir, base.pipeline().scheduler)
    staged = work_dir / "continued"
    shutil.rmtree(staged, ignore_errors=True)
    FAMILIES[recipe.family].loading.save_pipeline(pipeline.to(torch.float16), staged)
    for part in staged.iterdir():  # over the old pipeline's parts; taesd/, the card and scores.json stay
        target = model_dir / part.name
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
        shutil.move(part, target)
    done = facts["validation_loss"][-1]["step"] if facts["validation_loss"] else 0
    return facts | {
        "recipe": asdict(recipe),
        "continued": [*facts.get("continued", []), {"steps": steps, "learning_rate": more.learning_rate}],
        "validation_loss": facts["validation_loss"] + [row | {"step": row["step"] + done} for row in validation],
    }


def write_untrained_control(vae, recipe: Recipe, init_dir: Path):
    """The micro pipeline around `vae` at its random init (seeded by the recipe: the same every time), written to
    `init_dir`: what the denoiser's training starts from, and the untrained control the base is scored against."""
    torch.manual_seed(recipe.seed)
    init = assemble_tiny_pipeline(
        vae,
        recipe.family,
        unet_block_out_channels=recipe.unet_block_out_channels,
        flux_layers=recipe.flux_layers,
        flux_heads=recipe.flux_heads,
        dit_layers=recipe.dit_layers,
        dit_heads=recipe.dit_heads,
        language_model_width=recipe.language_model_width,
        text_tokens=recipe.text_tokens,
        caption_words=recipe.caption_words,
    )
    FAMILIES[recipe.family].loading.save_pipeline(init, init_dir)
    return init


def refresh_clip_decoder(model_dir: Path, work_dir: Path, recipe: Recipe) -> dict:
    """A built video base's autoencoder decoder trained again alone (`finetune_clip_decoder`), its encoder, latent
    statistics, transformer and text encoder kept: the base's latent space does not move, so its transformer needs
    no retraining. Writes `vae/` (fp16) and the untrained control; returns the earlier build's facts with the recipe,
    the autoencoder's scores and the decoder's time replaced."""
    facts = json.loads((model_dir / "scores.json").read_text())
    vae = AutoModel.from_pretrained(str(model_dir / "vae"), dtype=torch.float32)
    with timed(facts["seconds"], "autoencoder_decoder"):
        vae = finetune_clip_decoder(vae, recipe)
    vae.to(torch.float16).save_pretrained(model_dir / "vae", safe_serialization=True)
    vae.to(torch.float32)  # scored and used for the control as saved: rounded to fp16
    write_untrained_control(vae, recipe, work_dir / "init")
    return facts | {
        "recipe": asdict(recipe),
        "autoencoders": clip_autoencoder_scores(vae, clip_tensors(100, recipe.seed + 999)),
    }


# The edit bases: a text-to-image base's transformer taught to edit by a full fine-tune on recolor pairs of the seen
# colors, its autoencoders kept; each recipe is its text-to-image base's (`TinyBase.edit_recipe`).


def build_edit_base(out_dir: Path, work_dir: Path, source: Path, recipe: dict, seed: int = 0) -> dict:
    """An edit pipeline folder (its family's micro `edit_pipeline_of`) from the text-to-image base `source`, its
    transformer (and with `recipe["text_encoder"]` its language model) trained by `difftune train` on "make it
    <color>" pairs of the seen colors; returns the facts for the model card."""
    torch.manual_seed(seed)  # new embedding rows are drawn
    pipeline = DiffusionPipeline.from_pretrained(source, dtype=torch.float32)
    edit = builder(_family_of(pipeline)).edit_pipeline_of(pipeline)
    count = recipe["pairs_per_prompt"] * len(SEEN_COLORS) * 3
    for folder, pairs, pair_seed in (("train", count, seed + 1), ("validation", len(SEEN_COLORS) * 3 * 2, seed + 2)):
        shutil.rmtree(work_dir / folder, ignore_errors=True)
        write_pair_folder(work_dir / folder, recolor_pairs(pairs, pair_seed, SEEN_COLORS, SEEN_COLORS))
    settings = {"adapter.text_encoder": str(recipe["text_encoder"]).lower(), "loss.flow_shift_by_resolution": "true"}
    return _fully_fine_tuned(edit, out_dir, work_dir, source, recipe, seed, settings)


def build_inpaint_base(out_dir: Path, work_dir: Path, source: Path, recipe: dict, seed: int = 0) -> dict:
    """An inpainting pipeline folder (its family's inpainting micro `inpaint_pipeline_of`: the denoiser's input widened
    to the mask and the masked image, zero at first) from the text-to-image base `source`, its denoiser trained by
    `difftune train` on the seen colors' shapes, each view with its random mask; returns the facts for the card."""
    pipeline = DiffusionPipeline.from_pretrained(source, dtype=torch.float32)
    inpaint = builder(f"{_family_of(pipeline)}_inpaint").inpaint_pipeline_of(pipeline)
    count = recipe["images_per_prompt"] * len(SEEN_COLORS) * 3
    for folder, images, image_seed in (("train", count, seed + 1), ("validation", len(SEEN_COLORS) * 3 * 8, seed + 2)):
        shutil.rmtree(work_dir / folder, ignore_errors=True)
        write_caption_folder(work_dir / folder, shape_images(images, image_seed, SEEN_COLORS))
    # As the text-to-image base was trained: min-SNR weighting, an offset noise, both views
    settings = {
        "adapter.text_encoder": "false",
        "loss.weighting": "min_snr",
        "loss.noise_offset": 0.1,
        "data.random_flip": "true",
    }
    return _fully_fine_tuned(inpaint, out_dir, work_dir, source, recipe, seed, settings)


def scored_build(model_dir: Path, work_dir: Path, facts: dict, score, before_key: str, card: str, **fields) -> dict:
    """A built edit or inpainting base scored by `score` (a judge's `edit_score` or `inpaint_score`), and the model
    it was trained from (work_dir's `init`), written with the build's `facts` to its scores.json, and its model card
    (`card` filled with `fields`, the recipe's and the scores'); returns the facts."""
    from difftune.toy.judge import EvalSettings

    settings = EvalSettings()
    built = load_components(ModelConfig(base=str(model_dir)))
    scores = score(built, SEEN_COLORS, HELD_OUT_COLOR, settings)
    before = score(load_components(ModelConfig(base=str(work_dir / "init"))), SEEN_COLORS, HELD_OUT_COLOR, settings)
    facts = facts | {"base": scores, before_key: before, "eval_settings": vars(settings)}
    (model_dir / "scores.json").write_text(json.dumps(facts, indent=2) + "\n")
    recipe = facts["recipe"]
    text = card.format(
        **fields,
        name=model_dir.name,
        seen=", ".join(SEEN_COLORS),
        held_out=HELD_OUT_COLOR,
        params=sum(p.numel() for p in built.denoiser.parameters()),
        seconds=facts["seconds"]["denoiser"],
        n=settings.samples_per_prompt,
        **{key: recipe[key] for key in ("seed", "steps", "batch_size", "learning_rate", "ema_decay")},
        **scores["seen"],
        **{f"before_{key}": value for key, value in before["seen"].items()},
        before_concept=before["concept"]["both"],
        concept=scores["concept"]["both"],
    )
    (model_dir / "README.md").write_text(text)
    return facts


def _family_of(pipeline: DiffusionPipeline) -> str:
    [family] = [name for name, family in FAMILIES.items() if type(pipeline).__name__ in family.pipeline_classes]
    return family


def _fully_fine_tuned(
    pipeline: DiffusionPipeline, out_dir: Path, work_dir: Path, source: Path, recipe: dict, seed: int, settings: dict
) -> dict:
    """`pipeline`'s denoiser fully fine-tuned by `difftune train` on work_dir's `train` folder (validated on its
    `validation` folder) with `settings` beside the recipe's, its EMA saved to `out_dir` in fp16 with `source`'s
    TAESD; returns the facts for the model card."""
    from difftune.training.train import train

    seconds: dict[str, float] = {}
    init_dir = work_dir / "init"
    pipeline.save_pretrained(init_dir, safe_serialization=True)
    values = {
        "model.base": init_dir,
        "data.path": work_dir / "train",
        "data.resolution": 32,
        "data.num_workers": 0,
        "data.caption_dropout": 0.1,
        "adapter.kind": "none",
        "optim.learning_rate": recipe["learning_rate"],
        "optim.lr_schedule": "cosine",
        "optim.warmup_steps": 50,
        "optim.weight_decay": 0.0,
        "train.output_dir": work_dir / "run",
        "train.overwrite": "true",
        "train.max_steps": recipe["steps"],
        "train.batch_size": recipe["batch_size"],
        "train.seed": seed,
        "ema.enabled": "true",
        "ema.decay": recipe["ema_decay"],
        "validation.path": work_dir / "validation",
        "validation.every_steps": 100,
        "cache.latents": "true",
        "cache.dir": work_dir / "cache",
        "checkpoint.every_steps": 0,
        "log.tensorboard": "false",
        "sample.prompts": "[]",
    }
    with timed(seconds, "denoiser"):
        train(load_config(None, [f"{key}={value}" for key, value in (values | settings).items()]))
    trained = type(pipeline).from_pretrained(work_dir / "run" / "model_ema", dtype=torch.float32)
    trained.scheduler = pipeline.scheduler  # the sampler's, not the training run's
    shutil.rmtree(out_dir, ignore_errors=True)
    trained.to(torch.float16).save_pretrained(out_dir, safe_serialization=True)
    shutil.copytree(source / "taesd", out_dir / "taesd")
    validation = [
        {key: row[key] for key in ("step", "val_loss", "val_loss_ema")}
        for row in read_metrics(work_dir / "run")
        if "val_loss" in row
    ]
    return {"recipe": recipe | {"seed": seed, "source": str(source)}, "seconds": seconds, "validation_loss": validation}


# A Qwen-VL processor's video processor, which transformers builds and loads beside its image processor wherever
# torchvision is installed: the bundled bases are built without one (`load_without_video_processor`), so their
# processor files get its settings as a full save writes them (nested in processor_config.json, transformers 5).
VIDEO_PROCESSORS = {
    "Qwen2VLProcessor": "Qwen2VLVideoProcessor",
    "Qwen2_5_VLProcessor": "Qwen2VLVideoProcessor",
    "Qwen3VLProcessor": "Qwen3VLVideoProcessor",
}
SHARED_WITH_IMAGES = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")


def as_published(model_dir: Path) -> None:
    """A built base's files as published folders hold them, so that its pipeline's own `from_pretrained` reads it:
    no `_name_or_path` in any JSON (diffusers and transformers record the build's scratch folder there on saving,
    `output/tiny-wan-3000/run/model_ema`, and a reader that follows it looks for that folder on the hub), and each
    Qwen-VL processor with its video processor's settings (those it shares with its image processor)."""
    for path in sorted(model_dir.glob("**/*.json")):
        text = path.read_text()
        if path.is_symlink() or '"_name_or_path"' not in text:
            continue
        kept = re.sub(r'^\s*"_name_or_path": "[^"]*",\n', "", text, flags=re.MULTILINE)  # the rest as written
        data = json.loads(text)
        del data["_name_or_path"]
        path.write_text(kept if json.loads(kept) == data else json.dumps(data, indent=2, sort_keys=True) + "\n")
    for path in sorted(model_dir.glob("*/processor_config.json")):
        data = json.loads(path.read_text())
        video = VIDEO_PROCESSORS.get(data.get("processor_class"))
        if video and "video_processor" not in data and not path.is_symlink():
            images = data["image_processor"]
            settings = {key: images[key] for key in SHARED_WITH_IMAGES if key in images}
            data["video_processor"] = settings | {"video_processor_type": video}
            path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def link_borrowed_files(model_dir: Path, models_root: Path = Path("models")) -> None:
    """Replace each file of model_dir that another bundled base already holds byte for byte (a lent autoencoder,
    TAESD, a shared text encoder) with a relative symbolic link to that copy: a GPU call carries the whole tracked tree
    in 64 MiB, and the duplicates were 14 MB of it."""

    def digest(path: Path) -> str:
        return hashlib.sha256(path.read_bytes()).hexdigest()

    others = {}
    for other in sorted(models_root.glob("*/**/*.safetensors")):
        if not other.is_symlink() and model_dir.resolve() not in other.resolve().parents:
            others.setdefault((other.stat().st_size, digest(other)), other)
    for path in sorted(model_dir.glob("**/*.safetensors")):
        if path.is_symlink():
            continue
        original = others.get((path.stat().st_size, digest(path)))
        if original is not None:
            path.unlink()
            path.symlink_to(os.path.relpath(original.resolve(), path.parent.resolve()))


def copy_into_borrowers(model_dir: Path, models_root: Path = Path("models")) -> None:
    """Before model_dir is rebuilt, give every base whose links point into it its own copy of those files: they were
    trained with the old ones."""
    for link in sorted(models_root.glob("*/**/*.safetensors")):
        if link.is_symlink() and model_dir.resolve() in link.resolve().parents:
            target = link.resolve()
            link.unlink()
            shutil.copyfile(target, link)
