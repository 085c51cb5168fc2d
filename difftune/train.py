"""The training recipe: setup -> loop -> save -> sample.

Features: LoRA / DoRA (peft) or full UNet fine-tuning, optionally the text encoder too; epsilon or
v-prediction with Min-SNR-gamma weighting; accelerate for devices, DDP/FSDP/DeepSpeed, mixed
precision and gradient accumulation; global-norm clipping; AdamW with warmup then constant or
cosine; channels-last UNet; SDPA or xformers attention; gradient checkpointing; a JSONL metrics
line per optimizer step (and TensorBoard when installed); samples at the end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import is_tensorboard_available, set_seed
from diffusers.optimization import get_scheduler
from diffusers.training_utils import cast_training_params
from tqdm.auto import tqdm

from difftune.adapters import add_adapters, trainable_parameters
from difftune.config import Config
from difftune.data import CaptionedImages, TrainingOrder, build_dataloader, scan_examples
from difftune.errors import DifftuneError
from difftune.export import save_trained
from difftune.loss import diffusion_loss, draw_timesteps_and_noise
from difftune.metrics import METRICS_FILE, MetricsLog
from difftune.models import Components, encode_latents, encode_prompts, load_components, set_attention, weight_dtype
from difftune.sample import generate_images, save_images

RESOLVED_CONFIG_FILE = "config.toml"


@dataclass
class TrainResult:
    components: Components  # unwrapped, adapters attached
    trained_path: Path | None  # the adapter file or the full-model folder; None on non-main processes
    losses: list[float]  # one per optimizer step, averaged over processes


def train(config: Config) -> TrainResult:
    output_dir = _check_output_dir(config)
    if config.train.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise DifftuneError('train.mixed_precision = "fp16" needs a CUDA device; use "bf16" or "no" here')
    accelerator = Accelerator(
        mixed_precision=config.train.mixed_precision,
        gradient_accumulation_steps=config.train.gradient_accumulation_steps,
        log_with="tensorboard" if config.log.tensorboard and is_tensorboard_available() else None,
        project_dir=output_dir / "logs",
    )
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / RESOLVED_CONFIG_FILE).write_text(config.to_toml(), encoding="utf-8")
    set_seed(config.train.seed)  # the adapters' random init

    components = load_components(config.model)
    examples = scan_examples(config.data)
    _configure_unet(components.unet, config)
    trained = add_adapters(components, config.adapter)
    _place_models(components, config, accelerator)
    order = TrainingOrder(
        len(examples), config.train.batch_size, config.train.seed, accelerator.process_index, accelerator.num_processes
    )
    dataset = CaptionedImages(examples, config.data, components.tokenizer, config.train.seed)
    batches = iter(build_dataloader(dataset, order, config.data.num_workers, pin_memory=accelerator.device.type == "cuda"))

    optim = config.optim
    parameters = trainable_parameters(trained)
    optimizer = torch.optim.AdamW(
        parameters, lr=optim.learning_rate, betas=optim.betas, weight_decay=optim.weight_decay, eps=optim.eps
    )
    # accelerate steps a prepared scheduler once per process each optimizer step.
    lr_scheduler = get_scheduler(
        optim.lr_schedule,
        optimizer,
        num_warmup_steps=optim.warmup_steps * accelerator.num_processes,
        num_training_steps=config.train.max_steps * accelerator.num_processes,
    )
    # Only trained modules are prepared: DDP refuses a module with nothing to train.
    if config.adapter.text_encoder:
        components.unet, components.text_encoder, optimizer, lr_scheduler = accelerator.prepare(
            components.unet, components.text_encoder, optimizer, lr_scheduler
        )
    else:
        components.unet, optimizer, lr_scheduler = accelerator.prepare(components.unet, optimizer, lr_scheduler)
    accelerator.init_trackers("difftune", config=_flat_hparams(config))
    accelerator.print(
        f"difftune: {len(examples)} images, {sum(p.numel() for p in parameters):,} trained parameters "
        f"({config.adapter.kind}), {accelerator.num_processes} process(es) on {accelerator.device}"
    )

    metrics = MetricsLog(output_dir, accelerator)
    max_norm = optim.max_grad_norm or float("inf")  # inf: measure the norm, clip nothing
    global_batch = config.train.batch_size * accelerator.num_processes * config.train.gradient_accumulation_steps
    losses = []
    progress = tqdm(
        range(1, config.train.max_steps + 1),
        disable=not (accelerator.is_main_process and config.log.progress_bar),
        desc="train",
    )
    for global_step in progress:
        started = time.perf_counter()
        step_loss = torch.zeros((), device=accelerator.device)
        for _ in range(config.train.gradient_accumulation_steps):
            batch = next(batches)
            with accelerator.accumulate(components.unet, components.text_encoder):
                loss = _training_loss(components, batch, config, accelerator.device).mean()
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    grad_norm = accelerator.clip_grad_norm_(parameters, max_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            step_loss += loss.detach() / config.train.gradient_accumulation_steps
        step_loss = accelerator.reduce(step_loss, reduction="mean").item()
        seconds = time.perf_counter() - started
        lr = lr_scheduler.get_last_lr()[0]
        losses.append(step_loss)
        metrics.write(
            global_step,
            {
                "epoch": batch["epoch"][-1].item(),
                "loss": step_loss,
                "grad_norm": float(grad_norm),
                "lr": lr,
                "seconds": seconds,
                "samples_per_second": global_batch / seconds,
            },
        )
        progress.set_postfix(loss=f"{step_loss:.4f}", lr=f"{lr:.2e}")
    metrics.close()

    accelerator.wait_for_everyone()
    components.unet = accelerator.unwrap_model(components.unet).eval()
    components.text_encoder = accelerator.unwrap_model(components.text_encoder).eval()
    trained_path = None
    if accelerator.is_main_process:
        trained_path = save_trained(components, config, output_dir)
        if config.sample.prompts:
            with accelerator.autocast():
                samples = generate_images(components, config.sample, accelerator.device)
            save_images(samples, config.sample, output_dir / "samples")
    accelerator.end_training()
    return TrainResult(components, trained_path, losses)


def _training_loss(components: Components, batch: dict, config: Config, device: torch.device) -> torch.Tensor:
    """Per-sample loss (B,) for one micro-batch; all randomness from the samples' own seeds."""
    generators = [torch.Generator().manual_seed(int(seed)) for seed in batch["seed"]]
    with torch.no_grad():
        latents = encode_latents(components.vae, batch["pixel_values"].to(device), generators).float()
    with torch.set_grad_enabled(config.adapter.text_encoder):
        encoder_hidden_states = encode_prompts(components.text_encoder, batch["input_ids"].to(device))
    timesteps, noise = draw_timesteps_and_noise(generators, latents, components.noise_scheduler.config.num_train_timesteps)
    return diffusion_loss(
        components.unet, components.noise_scheduler, latents, encoder_hidden_states, timesteps, noise, config.loss
    )


def _place_models(components: Components, config: Config, accelerator: Accelerator) -> None:
    """Frozen weights in the configured dtype, trained ones in fp32, all on the device."""
    dtype = weight_dtype(config.model.weight_dtype, config.train.mixed_precision)
    # SD's KL VAE overflows to NaN in fp16 on some images: keep it fp32 unless bf16 was asked for.
    vae_dtype = torch.float32 if dtype == torch.float16 else dtype
    for module, module_dtype in ((components.vae, vae_dtype), (components.text_encoder, dtype), (components.unet, dtype)):
        module.to(accelerator.device)
        if module_dtype != torch.float32:  # loaded as fp32; diffusers warns on every dtype cast
            module.to(dtype=module_dtype)
    components.vae.eval()
    components.text_encoder.train(config.adapter.text_encoder)
    components.unet.train()
    cast_training_params([components.unet, components.text_encoder], dtype=torch.float32)
    if config.train.gradient_checkpointing and config.adapter.text_encoder:
        components.text_encoder.gradient_checkpointing_enable()


def _configure_unet(unet, config: Config) -> None:
    """Memory format, attention kernel and checkpointing: set before adapters are injected, so that the
    adapters' own small weights stay contiguous (peft's DoRA on convolutions `view`s them)."""
    if config.train.channels_last:
        unet.to(memory_format=torch.channels_last)
    set_attention(unet, config.train.attention)
    if config.train.gradient_checkpointing:
        unet.enable_gradient_checkpointing()


def _check_output_dir(config: Config) -> Path:
    output_dir = Path(config.train.output_dir)
    if (output_dir / METRICS_FILE).exists() and not config.train.overwrite:
        raise DifftuneError(
            f"train.output_dir {output_dir} already holds a run ({METRICS_FILE}); choose another folder or set "
            f"train.overwrite=true to replace it"
        )
    return output_dir


def _flat_hparams(config: Config) -> dict:
    """The config as flat scalars, the only values TensorBoard's hparams accept."""
    flat = {}
    for section, values in config.model_dump(mode="json").items():
        for key, value in values.items():
            flat[f"{section}.{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat
