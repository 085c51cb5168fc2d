"""The training recipe: setup -> loop -> save -> sample.

Features: LoRA / DoRA (peft) or full UNet fine-tuning, optionally the text encoder too (its own
learning rate); epsilon or v-prediction with Min-SNR-gamma weighting, noise offset, input
perturbation and zero-terminal-SNR; accelerate for devices, DDP/FSDP/DeepSpeed, mixed precision and
gradient accumulation; global-norm clipping; AdamW / AdamW 8-bit / Lion / Adafactor with warmup and a
constant, linear, cosine or cosine-with-restarts schedule; a guard that skips NaN/inf and spiking
steps; EMA weights; validation loss at fixed noise; preview samples; adapter snapshots and their
average; channels-last UNet; SDPA or xformers attention; gradient checkpointing; TF32; a JSONL
metrics line per optimizer step (and TensorBoard when installed); after the final save, a parity check that
the saved file, reloaded as users load it, redraws the in-training sample.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object, is_tensorboard_available, set_seed
from diffusers.training_utils import EMAModel, cast_training_params
from tqdm.auto import tqdm

from difftune import export
from difftune.adapters import add_adapters, trainable_parameters
from difftune.cache import fill_latents, fill_text, latent_entries, model_identity, text_entries
from difftune.checkpoint import (
    CHECKPOINTS_DIR,
    MARKER,
    Progress,
    StopRequest,
    find_checkpoint,
    keep_models_out_of_accelerate_state,
    load_checkpoint,
    save_checkpoint,
)
from difftune.config import Config
from difftune.data import (
    BAD_FILES_REPORT,
    CaptionedImages,
    TrainingOrder,
    build_dataloader,
    report_bad_files,
    scan_examples,
    training_sizes,
)
from difftune.ema import build_ema, ema_weights, update_ema
from difftune.errors import DifftuneError
from difftune.guard import Guard
from difftune.loss import diffusion_loss, draw_timesteps_and_noise, training_noise_scheduler
from difftune.metrics import METRICS_FILE, MetricsLog
from difftune.models import (
    Components,
    encode_posterior,
    encode_prompts,
    load_components,
    place_frozen,
    sample_latents,
    set_attention,
    weight_dtype,
)
from difftune.optim import build_lr_scheduler, build_optimizer
from difftune.parity import check_parity, write_report
from difftune.sample import generate_images, save_images
from difftune.validation import Validator

RESOLVED_CONFIG_FILE = "config.toml"
ROLLBACKS_FILE = "rollbacks.jsonl"


@dataclass
class TrainResult:
    components: Components  # unwrapped, adapters attached, raw (not EMA) weights
    trained_path: Path | None  # the adapter file or the full-model folder; None on non-main processes or after a stop
    losses: list[float]  # one per optimizer step, averaged over processes
    optimizer: torch.optim.Optimizer
    ema: EMAModel | None  # when ema.enabled


def train(config: Config, resume: str | None = None) -> TrainResult:
    """Run the job; `resume` is "auto" (the latest complete checkpoint in output_dir, if any) or a checkpoint folder."""
    output_dir = _check_output_dir(config, resume)
    if config.train.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise DifftuneError('train.mixed_precision = "fp16" needs a CUDA device; use "bf16" or "no" here')
    accelerator = Accelerator(
        mixed_precision=config.train.mixed_precision,
        gradient_accumulation_steps=config.train.gradient_accumulation_steps,
        log_with="tensorboard" if config.log.tensorboard and is_tensorboard_available() else None,
        project_dir=output_dir / "logs",
    )
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        # Sharded parameters would need a gather before every save; until that is written and tested, refuse
        # rather than write partial adapters and checkpoints.
        raise DifftuneError(
            f"{accelerator.distributed_type.value} is not supported yet: adapters and checkpoints are written from "
            f"unsharded parameters. Use DDP (configs/accelerate/ddp.yaml)."
        )
    if config.train.compile:
        _check_compile_device(accelerator.device)
    keep_models_out_of_accelerate_state(accelerator)
    main = accelerator.is_main_process
    if main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / RESOLVED_CONFIG_FILE).write_text(config.to_toml(), encoding="utf-8")
    _set_device_flags(config, accelerator)
    set_seed(config.train.seed)  # the adapters' random init

    components = load_components(config.model)
    components.noise_scheduler = training_noise_scheduler(components.noise_scheduler, config.loss)
    examples, bad_files = scan_examples(config.data)
    report_bad_files(bad_files, output_dir / BAD_FILES_REPORT if main else None, accelerator.print)
    sizes = training_sizes(examples, config.data)  # reads every image's header with buckets on: once
    latent_files, text_files = _fill_caches(components, examples, sizes, config, accelerator)
    validator = Validator(components, config, accelerator.device) if config.validation.path and main else None
    if config.sample.before and config.sample.prompts and main and not resume:
        _sample_before_training(components, config, output_dir, accelerator.device)
    _release_unneeded(components, config)
    _configure_unet(components.unet, config)
    add_adapters(components, config.adapter)
    _place_models(components, config, accelerator)
    if config.train.compile:  # after the adapters, so the compiled graph includes them
        components.unet.compile()

    named = trainable_parameters(components, config.adapter)
    parameters = list(named.values())
    unet_params = [p for name, p in named.items() if name.startswith("unet.")]
    text_params = [p for name, p in named.items() if name.startswith("text_encoder.")]
    optimizer = build_optimizer(unet_params, text_params, config.optim, accelerator.device)
    lr_scheduler = build_lr_scheduler(optimizer, config.optim, config.train.max_steps, accelerator.num_processes)
    # Only trained modules are prepared: DDP refuses a module with nothing to train.
    if config.adapter.text_encoder:
        components.unet, components.text_encoder, optimizer, lr_scheduler = accelerator.prepare(
            components.unet, components.text_encoder, optimizer, lr_scheduler
        )
        trained_modules = [components.unet, components.text_encoder]
    else:
        components.unet, optimizer, lr_scheduler = accelerator.prepare(components.unet, optimizer, lr_scheduler)
        trained_modules = [components.unet]
    ema = build_ema(parameters, config.ema)
    checkpoint = find_checkpoint(output_dir, resume) if resume else None
    progress, guard_state = load_checkpoint(accelerator, checkpoint, named, ema, config) if checkpoint else (Progress(), None)
    guard = Guard(config.guard, output_dir if main else None, resumed_at_step=progress.global_step)
    if guard_state:
        guard.load_state_dict(guard_state)
    dataset = CaptionedImages(
        examples, config.data, components.tokenizer, config.train.seed, latent_files, text_files, sizes,
        memory_bytes=config.cache.memory_mb * 2**20,
    )
    order = TrainingOrder(
        len(examples),
        config.train.batch_size,
        config.train.seed,
        accelerator.process_index,
        accelerator.num_processes,
        start_batch=progress.micro_batches,
        buckets=sizes if config.data.buckets else None,
    )
    batches = iter(build_dataloader(dataset, order, config.data.num_workers, pin_memory=accelerator.device.type == "cuda"))
    accelerator.init_trackers("difftune", config=_flat_hparams(config))
    accelerator.print(
        f"difftune: {len(examples)} images, {sum(p.numel() for p in parameters):,} trained parameters "
        f"({config.adapter.kind}), {accelerator.num_processes} process(es) on {accelerator.device}"
    )

    metrics = MetricsLog(output_dir, accelerator, resumed_at_step=progress.global_step)
    max_norm = config.optim.max_grad_norm or float("inf")  # inf: measure the norm, clip nothing
    accumulation = config.train.gradient_accumulation_steps
    global_batch = config.train.batch_size * accelerator.num_processes * accumulation
    losses = []
    bar = tqdm(
        initial=progress.global_step, total=config.train.max_steps, disable=not (main and config.log.progress_bar), desc="train"
    )
    with StopRequest() as stop:
        while progress.global_step < config.train.max_steps and not stop.agreed(accelerator):
            global_step = progress.global_step + 1
            started = time.perf_counter()
            step_loss, paths = torch.zeros((), device=accelerator.device), []
            for _ in range(accumulation):
                batch = next(batches)
                with accelerator.accumulate(*trained_modules):
                    loss = _training_loss(components, batch, config, accelerator.device).mean()
                    accelerator.backward(loss)
                step_loss += loss.detach() / accumulation
                paths += batch["path"]
            # The last micro-step synced the gradients: clip, judge, then step (or skip) on every process alike.
            grad_norm = float(accelerator.clip_grad_norm_(parameters, max_norm))
            step_loss = accelerator.reduce(step_loss, reduction="mean").item()
            skip = guard.judge(global_step, step_loss, grad_norm, grad_overflow_is_expected=accelerator.scaler is not None)
            if skip:
                guard.record(global_step, skip, step_loss, grad_norm, gather_object(paths))
            else:
                optimizer.step()
                if ema and global_step % config.ema.every_steps == 0:
                    update_ema(ema, parameters, config.ema)
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            progress = Progress(global_step, progress.micro_batches + accumulation)

            seconds = time.perf_counter() - started
            lr = lr_scheduler.get_last_lr()[0]
            losses.append(step_loss)
            values = {
                "epoch": batch["epoch"][-1].item(),
                "loss": step_loss,
                "grad_norm": grad_norm,
                "lr": lr,
                "skipped": bool(skip),
                "seconds": seconds,
                "samples_per_second": global_batch / seconds,
            }
            diverged = guard.divergence(step_loss)
            if diverged:  # before any snapshot, validation or checkpoint of this step
                metrics.write(global_step, values)
                progress = _roll_back(accelerator, output_dir, named, ema, guard, config, metrics, progress, diverged)
                bar.n = progress.global_step
                continue
            if main:
                unwrapped = _unwrapped(components, accelerator)
                values |= _periodic_work(global_step, unwrapped, parameters, ema, validator, config, output_dir, accelerator)
            metrics.write(global_step, values)
            bar.update(1)
            bar.set_postfix(loss=f"{step_loss:.4f}", lr=f"{lr:.2e}", skipped=guard.skipped)
            if config.checkpoint.every_steps and global_step % config.checkpoint.every_steps == 0:
                save_checkpoint(accelerator, output_dir, progress, named, ema, guard, config)
        bar.close()
        metrics.close()
    if not (output_dir / CHECKPOINTS_DIR / f"step-{progress.global_step:06d}" / MARKER).exists():
        save_checkpoint(accelerator, output_dir, progress, named, ema, guard, config)
    if progress.global_step < config.train.max_steps:
        accelerator.print(
            f"{StopRequest.MESSAGE} {progress.global_step} of {config.train.max_steps} on request; "
            f"checkpoint written: continue with --resume auto"
        )
        accelerator.end_training()
        return TrainResult(_unwrapped(components, accelerator), None, losses, optimizer, ema)

    accelerator.wait_for_everyone()
    components = _unwrapped(components, accelerator)
    needs_encoders = config.sample.prompts or config.adapter.kind == "none"  # a full model is saved whole
    if main and needs_encoders and (components.vae is None or components.text_encoder is None):
        _reload_released(components, config, accelerator.device)
    components.unet.eval()
    trained_path = _save_results(components, parameters, ema, config, output_dir, accelerator) if main else None
    accelerator.end_training()
    return TrainResult(components, trained_path, losses, optimizer, ema)


def _training_loss(components: Components, batch: dict, config: Config, device: torch.device) -> torch.Tensor:
    """Per-sample loss (B,) for one micro-batch; all randomness from the samples' own seeds. Cached posteriors
    and text states, when the batch carries them, stand in for the encoders."""
    generators = [torch.Generator().manual_seed(int(seed)) for seed in batch["seed"]]
    if "latent_mean" in batch:
        mean, std = batch["latent_mean"].to(device), batch["latent_std"].to(device)
    else:
        with torch.no_grad():
            mean, std = encode_posterior(components.vae, batch["pixel_values"].to(device))
    latents = sample_latents(mean, std, generators, *components.latent_scaling).float()
    if "encoder_hidden_states" in batch:
        encoder_hidden_states = batch["encoder_hidden_states"].to(device)
    else:
        with torch.set_grad_enabled(config.adapter.text_encoder):
            encoder_hidden_states = encode_prompts(components.text_encoder, batch["input_ids"].to(device))
    timesteps, noise, input_noise = draw_timesteps_and_noise(
        generators, latents, components.noise_scheduler.config.num_train_timesteps, config.loss
    )
    return diffusion_loss(
        components.unet, components.noise_scheduler, latents, encoder_hidden_states, timesteps, noise, config.loss,
        input_noise,
    )


def _fill_caches(components: Components, examples, sizes, config: Config, accelerator) -> tuple[list | None, dict | None]:
    """Cache files for the examples' latents and captions, encoding what is missing (main process first)."""
    latent_files = text_files = None
    if config.cache.latents:
        latent_files = latent_entries(examples, sizes, model_identity(components.vae), config)
    if config.cache.text:
        captions = {example.caption for example in examples} | {""}  # "" for caption dropout
        identity = model_identity(components.text_encoder)
        text_files = text_entries(captions, identity, config, components.tokenizer)
    if accelerator.is_main_process:
        device = accelerator.device
        if latent_files:
            fill_latents(examples, sizes, latent_files, components.vae.to(device), config, config.train.batch_size)
        if text_files:
            fill_text(text_files, components.text_encoder.to(device), components.tokenizer, config.train.batch_size)
    accelerator.wait_for_everyone()
    return latent_files, text_files


def _release_unneeded(components: Components, config: Config) -> None:
    """Drop the encoders whose outputs are all cached and that nothing else needs until the end of the run."""
    previews = bool(config.sample.every_steps and config.sample.prompts)
    if config.cache.latents and not previews:
        components.vae = None
    if config.cache.text and not (previews or config.validation.path):
        components.text_encoder = None


def _reload_released(components: Components, config: Config, device) -> None:
    """Bring the released encoders back for the end-of-run samples and the saved full model."""
    loaded = load_components(config.model)
    components.vae = components.vae or loaded.vae.to(device).eval()
    components.text_encoder = components.text_encoder or loaded.text_encoder.to(device).eval()


def _roll_back(accelerator, output_dir, named, ema, guard, config: Config, metrics, progress: Progress, why: str) -> Progress:
    """Reload the last complete checkpoint but keep reading the data from here on, so the batches that led to
    the divergence are skipped rather than replayed. Without `guard.rollback` (or past its limit): stop."""
    checkpoint = find_checkpoint(output_dir, "auto") if config.guard.rollback else None
    if checkpoint is None or guard.rollbacks >= config.guard.max_rollbacks:
        limit = f"; {guard.rollbacks} rollbacks already" if config.guard.rollback and checkpoint else ""
        raise guard.stop(progress.global_step, why + limit)
    restored, guard_state = load_checkpoint(accelerator, checkpoint, named, ema, config)
    rollbacks = guard.rollbacks + 1
    guard.load_state_dict(guard_state)
    guard.rollbacks = rollbacks
    metrics.rewind(restored.global_step)
    record = {
        "at_step": progress.global_step,
        "to_step": restored.global_step,
        "reason": why,
        "skipped_micro_batches": progress.micro_batches - restored.micro_batches,
    }
    if accelerator.is_main_process:
        with open(output_dir / ROLLBACKS_FILE, "a", encoding="utf-8") as file:
            file.write(json.dumps(record) + "\n")
    accelerator.print(f"difftune: rolled back from step {progress.global_step} to {restored.global_step}: {why}")
    return Progress(restored.global_step, progress.micro_batches)


def _periodic_work(step, components, parameters, ema, validator, config: Config, output_dir: Path, accelerator) -> dict:
    """Validation loss, preview samples and adapter snapshots when their step comes (main process only)."""
    values = {}
    last = step == config.train.max_steps
    if validator and (step % config.validation.every_steps == 0 or last):
        values["val_loss"] = validator.loss(components)
        if ema:
            with ema_weights(ema, parameters):
                values["val_loss_ema"] = validator.loss(components)
    if config.sample.every_steps and step % config.sample.every_steps == 0 and config.sample.prompts and not last:
        with accelerator.autocast():
            samples = generate_images(components, config.sample, accelerator.device)
        save_images(samples, config.sample, output_dir / "samples" / f"step-{step:06d}")
    if config.export.every_steps and (step % config.export.every_steps == 0 or last):
        export.save_trained(components, config, output_dir / "snapshots" / f"step-{step:06d}.safetensors", "diffusers")
    return values


def _sample_before_training(components: Components, config: Config, output_dir: Path, device: torch.device) -> None:
    """The base's own samples, with the seeds the end-of-run samples use; before any adapter exists."""
    for module in (components.unet, components.vae, components.text_encoder):
        module.to(device)
    save_images(generate_images(components, config.sample, device), config.sample, output_dir / "samples" / "before")


def _save_results(components, parameters, ema, config: Config, output_dir: Path, accelerator) -> Path:
    """The raw result, its EMA and the average of the last snapshots, then the end-of-run samples."""
    trained_path = export.save_trained(components, config, export.trained_path(config, output_dir))
    if config.export.average_last > 1:
        snapshots = sorted((output_dir / "snapshots").glob("step-*.safetensors"))[-config.export.average_last :]
        tensors, lora_configs, config_toml = export.average_adapters(snapshots, config.export.average_weights)
        export.write_adapter(export.trained_path(config, output_dir, "_avg"), tensors, lora_configs, config_toml, config.export.format)
    if config.sample.prompts:
        with accelerator.autocast():
            samples = generate_images(components, config.sample, accelerator.device)
        save_images(samples, config.sample, output_dir / "samples")
        if config.sample.parity:
            dtype = weight_dtype(config.model.weight_dtype, config.train.mixed_precision)
            report = check_parity(config, trained_path, samples[0], accelerator.device, dtype, accelerator.autocast)
            for warning in write_report(report, output_dir):
                accelerator.print(f"difftune: warning: {warning}")
    if ema:
        with ema_weights(ema, parameters):
            export.save_trained(components, config, export.trained_path(config, output_dir, "_ema"))
            if config.sample.prompts:
                with accelerator.autocast():
                    samples = generate_images(components, config.sample, accelerator.device)
                save_images(samples, config.sample, output_dir / "samples_ema")
    return trained_path


def _unwrapped(components: Components, accelerator: Accelerator) -> Components:
    text_encoder = components.text_encoder
    return replace(
        components,
        unet=accelerator.unwrap_model(components.unet),
        text_encoder=accelerator.unwrap_model(text_encoder) if text_encoder is not None else None,
    )


def _place_models(components: Components, config: Config, accelerator: Accelerator) -> None:
    """Frozen weights in the configured dtype, trained ones in fp32, all on the device."""
    place_frozen(components, accelerator.device, weight_dtype(config.model.weight_dtype, config.train.mixed_precision))
    for module in (components.unet, components.text_encoder, components.vae):
        if module is not None:
            module.train(module is components.unet or (module is components.text_encoder and config.adapter.text_encoder))
    cast_training_params([m for m in (components.unet, components.text_encoder) if m is not None], dtype=torch.float32)
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


def _check_compile_device(device: torch.device) -> None:
    # Measured here: CPU inductor (torch 2.13) trained the tiny UNet's LoRA with zero gradients in the mid
    # block and wrong ones in the down blocks, while the loss looked right. Refuse rather than mis-train.
    if device.type != "cuda":
        raise DifftuneError(
            f"train.compile = true is supported on CUDA only (this run is on {device}): on CPU, torch's inductor "
            "computed wrong adapter gradients for the UNet. Set train.compile = false"
        )


def _set_device_flags(config: Config, accelerator: Accelerator) -> None:
    """TF32 and cuDNN autotuning: `auto` turns them on with CUDA; an explicit `on` off CUDA is said to do nothing."""
    if accelerator.device.type == "cuda":
        tf32 = config.train.tf32 != "off"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cudnn.benchmark = config.train.cudnn_benchmark != "off"
    elif "on" in (config.train.tf32, config.train.cudnn_benchmark):
        accelerator.print(f"difftune: train.tf32 and train.cudnn_benchmark apply to CUDA only; no effect on {accelerator.device}")


def _check_output_dir(config: Config, resume: str | None) -> Path:
    output_dir = Path(config.train.output_dir)
    if (output_dir / METRICS_FILE).exists() and not (config.train.overwrite or resume):
        raise DifftuneError(
            f"train.output_dir {output_dir} already holds a run ({METRICS_FILE}); resume it with --resume auto, "
            f"choose another folder, or set train.overwrite=true to replace it"
        )
    return output_dir


def _flat_hparams(config: Config) -> dict:
    """The config as flat scalars, the only values TensorBoard's hparams accept."""
    flat = {}
    for section, values in config.model_dump(mode="json").items():
        for key, value in values.items():
            flat[f"{section}.{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat
