"""The training recipe: `setup` -> `loop` -> `finish`, over one `Run`.

Features: any model family (families/): LoRA / DoRA / LoHa / LoKr (peft; LoRA also with rsLoRA, PiSSA or OLoRA
init) or full fine-tuning of the denoiser, optionally the text encoders too (their own learning rate), optionally
on a quantized frozen denoiser (QLoRA); epsilon or v-prediction with Min-SNR-gamma, soft-min-SNR or debiased
weighting, noise offset, input perturbation and zero-terminal-SNR; masked loss and DreamBooth prior preservation
(per-sample weights); accelerate for devices, DDP/FSDP, mixed precision (FP8 where the GPU has it) and gradient
accumulation, or a global batch size it is derived from; learning rates optionally scaled with the global batch;
global-norm clipping; AdamW / AdamW 8-bit / Lion / Adafactor / CPU-offloaded AdamW / GaLore / Prodigy /
schedule-free AdamW (LoRA+ rates for B) with warmup and a constant, linear, cosine or cosine-with-restarts
schedule; a guard that skips NaN/inf and spiking steps and warns of growing activations; per-block activation
statistics on chosen steps; EMA weights; validation loss at fixed noise, keeping the best result and stopping
early; preview samples; adapter snapshots and their average; channels-last denoiser; SDPA or xformers attention;
gradient checkpointing; TF32; a JSONL metrics line per optimizer step (and TensorBoard when installed); after
the final save, a parity check that the saved file, reloaded as users load it, redraws the in-training sample.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import broadcast_object_list, gather_object, is_tensorboard_available, set_seed
from diffusers.training_utils import EMAModel, cast_training_params
from PIL import Image
from tqdm.auto import tqdm

from difftune.adapters import export
from difftune.adapters.embeddings import caption_with_token, check_captions
from difftune.adapters.hub import push
from difftune.adapters.model_card import write_model_card
from difftune.adapters.trained import add_adapters, check_targets, trainable_parameters, trained_parts
from difftune.config import Config
from difftune.data import sharding
from difftune.data.cache import (
    cache_root,
    control_latent_entries,
    fill_latents,
    fill_text,
    latent_entries,
    text_entries,
    text_identity,
)
from difftune.data.dataset import (
    BAD_FILES_REPORT,
    CaptionedImages,
    TrainingOrder,
    batch_groups,
    build_dataloader,
    centered_view_mask,
    check_one_control_each,
    control_sizes,
    frame_counts,
    frame_rates,
    image_size,
    possible_prompts,
    report_bad_files,
    scan_datasets,
    training_sizes,
)
from difftune.data.sources import data_source
from difftune.errors import BatchBeyondData, DifftuneError
from difftune.families import load_components, load_denoiser
from difftune.families.common.drawing import generate_images, save_images
from difftune.families.common.objective import training_noise_scheduler
from difftune.memory.checkpointing import enable_gradient_checkpointing
from difftune.memory.quantize import quantize_linear_layers
from difftune.memory.storage import computed_copies_saved_as_stored
from difftune.memory.transfer import to_device
from difftune.models.autoencoders import encode_posterior, reference_latents, sample_latents
from difftune.models.components import (
    Components,
    cast_frozen,
    compile_denoiser,
    encoder_placement,
    encoders_on,
    host_kept_encoders,
    host_kept_for_drawing,
    loads_encoders_first,
    place_frozen,
    prompts_read_by_turns,
    set_attention,
    store_loaded_denoiser,
    store_loaded_text_encoders,
)
from difftune.models.dtypes import RunDtypes
from difftune.owned_files import open_append, write_file
from difftune.progress import phase
from difftune.training.activations import BlockActivations
from difftune.training.checkpoint import (
    CHECKPOINTS_DIR,
    Checkpointer,
    Progress,
    complete_checkpoints,
    find_checkpoint,
    full_disk_said_plainly,
    keep_models_out_of_accelerate_state,
    retire_after,
    step_of,
)
from difftune.training.ema import build_ema, ema_weights, update_ema
from difftune.training.guard import SKIPPED_FILE, Guard
from difftune.training.metrics import METRICS_FILE, RUN_FOLDER, MetricsLog
from difftune.training.optim import averaged_weights, build_lr_scheduler, build_optimizer, learning_rate_scale
from difftune.training.output_lock import hold_output_dir
from difftune.training.parity import check_parity, parity_line, room_for_a_fresh_copy, write_report
from difftune.training.plan import DoesNotFit, check_fits
from difftune.training.preference import check_preference_pairs, dpo_loss
from difftune.training.preflight import check_before_start
from difftune.training.prior import class_examples, class_folder, fill_class_images
from difftune.training.resolved import resolve
from difftune.training.reward import RewardTraining, reward_batches
from difftune.training.run_requests import RunRequests
from difftune.training.slider import encoded_prompts, slider_loss
from difftune.training.training_adapter import merge_training_adapter, without_merged_changes
from difftune.training.validation import BestResults, Validator

RESOLVED_CONFIG_FILE = "config.toml"
ROLLBACKS_FILE = "rollbacks.jsonl"


@dataclass
class TrainResult:
    components: Components  # unwrapped, adapters attached, raw (not EMA) weights
    trained_path: Path | None  # the adapter file or the full-model folder; None on non-main processes or after a stop
    losses: list[float]  # one per optimizer step, averaged over processes
    optimizer: torch.optim.Optimizer
    ema: EMAModel | None  # when ema.enabled


@dataclass
class Run:
    """Everything one training run holds, from `setup` to `finish`."""

    config: Config
    dtypes: RunDtypes  # what its parts are kept in, decided once (models/dtypes.py)
    accelerator: Accelerator
    output_dir: Path
    components: Components  # trained parts wrapped by accelerate
    named: dict[str, torch.nn.Parameter]  # the trained parameters by stable name (`<part>.<name>`)
    trained_modules: list[torch.nn.Module]
    optimizer: torch.optim.Optimizer
    lr_scheduler: object
    ema: EMAModel | None
    guard: Guard
    checkpointer: Checkpointer
    progress: Progress
    batches: BatchesAhead
    validator: Validator | None
    best: BestResults | None  # with a validator
    metrics: MetricsLog
    slider_prompts: dict | None = None  # a concept slider's prompts, encoded once (`slider.encoded_prompts`)
    reward: RewardTraining | None = None  # a reward run's step (it draws its own images)
    losses: list[float] = field(default_factory=list)
    stop_reason: str | None = None  # `RunRequests.agreed`'s, when the loop ended before train.max_steps

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.named.values())

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def print_status(self) -> Callable[[str], None] | None:
        """Where phase lines go (`progress.phase`): the main process's print, above the training bar; quiet: none."""
        return None if self.config.log.quiet or not self.main else tqdm.write

    def unwrapped(self) -> Components:
        return _unwrapped(self.components, self.accelerator)


def _unwrapped(components: Components, accelerator: Accelerator) -> Components:
    unwrap = accelerator.unwrap_model
    encoders = {name: unwrap(m) if m is not None else None for name, m in components.text_encoders.items()}
    controlnet = unwrap(components.controlnet) if components.controlnet is not None else None
    return replace(components, denoiser=unwrap(components.denoiser), text_encoders=encoders, controlnet=controlnet)


def train(config: Config, resume: str | None = None) -> TrainResult:
    """Run the job; `resume` is "auto" (the latest complete checkpoint in output_dir, if any) or a checkpoint folder.
    The run holds its output folder throughout: a second run there is refused (output_lock.py)."""
    check_before_start(config)
    output_dir = Path(config.train.output_dir)
    with hold_output_dir(output_dir), full_disk_said_plainly(output_dir):
        run = setup(config, resume)
        with phase("training", run.print_status):
            loop(run)
        return finish(run)


def setup(config: Config, resume: str | None = None) -> Run:
    """Models, data, caches, adapters, optimizer and the place to start from (a checkpoint when resuming)."""
    output_dir = _check_output_dir(config, resume)
    accelerator = _accelerator(config, output_dir)
    if resume == "auto" and not complete_checkpoints(output_dir):  # a fresh start: the base's samples are drawn too
        accelerator.print(f"difftune: no checkpoint in {output_dir / CHECKPOINTS_DIR}: starting at step 0")
        resume = None
    resolved = resolve(config, accelerator.num_processes)  # every process alike: no weights read, no communication
    config, dtypes = resolved.config, resolved.dtypes
    accelerator.gradient_accumulation_steps = config.train.gradient_accumulation_steps
    if resolved.offload_budget:
        accelerator.print(
            f"model.offload_budget {resolved.offload_budget}: the memory plan offloads "
            f"{config.model.offload_blocks} blocks"
        )
    if config.train.check_memory:  # every process: each would load
        _check_memory(config, accelerator)
    print_status = None if config.log.quiet else accelerator.print
    if config.log.tensorboard and not is_tensorboard_available() and print_status:
        print_status(
            "log.tensorboard: TensorBoard is not installed, so the metrics go to metrics.jsonl only "
            "(pip install tensorboard, or set log.tensorboard = false)"
        )
    encoders_first = loads_encoders_first(config, resolved.family, resume)
    with phase(f"loading {'the encoders of ' if encoders_first else ''}the base {config.model.base}", print_status):
        components = load_training_base(config, dtypes, with_denoiser=not encoders_first)
    components.family.check_config(config)
    if not encoders_first:
        check_targets(components, config.adapter)  # before the caches are filled: add_adapters checks again, later
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        write_file(output_dir / RESOLVED_CONFIG_FILE, config.to_toml(), RUN_FOLDER, ours=False)
    _set_device_flags(config, accelerator)
    main = accelerator.is_main_process
    class_dir = class_folder(config, components) if config.prior.enabled else None  # may hash the denoiser: once
    if config.prior.num_class_images:  # drawn by the untouched base, before anything is attached to it
        if main:
            fill_class_images(config, components, accelerator.device, class_dir)
        accelerator.wait_for_everyone()
    set_seed(config.train.seed)  # the adapters' random init

    components.noise_scheduler = training_noise_scheduler(components.noise_scheduler, config.loss)
    if config.reward.enabled:  # no images: the prompts are drawn and scored
        data, media = None, f"{len(config.reward.prompts)} prompts"
    else:
        data = _scanned_and_cached(config, components, accelerator, output_dir, class_dir, print_status)
        media = data.media
    validator = Validator(components, config, accelerator.device) if config.validation.path and main else None
    slider_prompts = encoded_prompts(components, config.slider, accelerator.device) if config.slider.enabled else None
    if encoders_first:  # the encoders the caches replace go before the denoiser comes: never resident beside it
        _release_unneeded(components, config)
        # Kept off the seeded generator: a denoiser whose loading draws random numbers (LTX-2's builds some of its
        # tensors) would otherwise give the adapters another init than a run that loaded it before the seed.
        with phase(f"loading the {components.family.denoiser_name}", print_status), torch.random.fork_rng(devices=[]):
            load_training_denoiser(components, config, dtypes)
    if config.sample.before and config.sample.prompts and main and not resume:
        with phase("drawing the base's samples (before training)", print_status):
            _sample_before_training(components, config, output_dir, accelerator.device)
    with phase("preparing the model for training", print_status):
        _release_unneeded(components, config)
        _shape_for_training(components, config, dtypes, accelerator)
    if config.sample.prompts:  # the samples' pipeline arguments, refused now rather than at the end of the run
        components.family.drawing.sampling_arguments(
            components, config.sample.guidance_scale, config.sample.negative_prompt
        )
    export.check_layout(components, config)
    if config.train.compile:  # after the adapters, so the compiled graph includes them
        compile_denoiser(components.denoiser)

    named = trainable_parameters(components, config.adapter)
    global_batch = config.train.batch_size * accelerator.num_processes * config.train.gradient_accumulation_steps
    lr_scale = learning_rate_scale(config.optim.scale_lr, global_batch)
    optimizer = build_optimizer(named, tuple(components.text_encoders), config.optim, accelerator.device, lr_scale)
    lr_scheduler = build_lr_scheduler(optimizer, config.optim, config.train.max_steps, accelerator.num_processes)
    # Only trained modules are prepared: DDP refuses a module with nothing to train.
    trained = trained_parts(components, config.adapter)
    *prepared, optimizer, lr_scheduler = accelerator.prepare(*trained.values(), optimizer, lr_scheduler)
    for part, module in zip(trained, prepared, strict=True):
        components.replace_part(part, module)
    # FSDP's prepare swaps the trained parameters for sharded ones (the optimizer follows): name those.
    named = trainable_parameters(_unwrapped(components, accelerator), config.adapter)

    ema = build_ema(list(named.values()), config.ema)
    checkpointer = Checkpointer(accelerator, output_dir, config)
    # A preference loss falls towards 0 as its pairs separate, and a reward step's is an advantage-weighted sum
    # around 0: a step over 10x the mean is no outlier, so only non-finite values (and guard.max_loss) are judged.
    plain = config.preference.method == "off" and not config.reward.enabled
    guarded = config.guard if plain else config.guard.model_copy(update={"spike_factor": 0})
    guard = Guard(guarded, output_dir if main else None)
    best = BestResults(config.validation, output_dir) if validator else None
    checkpoint = _resume_point(accelerator, output_dir, resume) if resume else None
    progress = checkpointer.load(checkpoint, named, ema, guard, best) if checkpoint else Progress()
    guard.start_at(progress.global_step)
    if config.reward.enabled:  # the run draws its own images
        batches = BatchesAhead(reward_batches(config, progress.micro_batches, accelerator.process_index))
        rewarding = RewardTraining(components, config, accelerator.device, accelerator.process_index)
    else:
        batches, rewarding = BatchesAhead(_data_batches(config, data, components, accelerator, progress)), None
    _start_trackers(accelerator, config, output_dir)
    accelerator.print(
        f"difftune: {components.family.description}, {media}, "
        f"{sum(p.numel() for p in named.values()):,} trained parameters ({config.adapter.kind}), "
        f"{accelerator.num_processes} process(es) on {accelerator.device}, global batch {global_batch}"
        + (f", learning rates x {lr_scale:.4g} (optim.scale_lr = {config.optim.scale_lr})" if lr_scale != 1 else "")
    )
    metrics = MetricsLog(output_dir, accelerator, resumed_at_step=progress.global_step)
    return Run(
        config,
        dtypes,
        accelerator,
        output_dir,
        components,
        named,
        list(prepared),
        optimizer,
        lr_scheduler,
        ema,
        guard,
        checkpointer,
        progress,
        batches,
        validator,
        best,
        metrics,
        slider_prompts,
        rewarding,
    )


@dataclass
class TrainingData:
    """What a run read of its data (`_scanned_and_cached`) and the cache entries it filled, for its batches."""

    examples: list
    media: str  # what the data holds, in words (`_media_count`)
    sizes: list
    controls: list
    tokenize: Callable
    rates: list | None
    latent_files: list | None
    control_files: list | None
    text_files: list | None


def _scanned_and_cached(
    config: Config,
    components: Components,
    accelerator: Accelerator,
    output_dir: Path,
    class_dir: Path | None,
    print_status: Callable[[str], None] | None,
) -> TrainingData:
    """The datasets read (and the class images, with a prior), checked for what the run asks of them, and the
    caches filled."""
    main = accelerator.is_main_process
    # Stored records are scanned once a machine (the first process writes the scan's index, the others read it).
    datasets = config.data.each_dataset()
    paths = ", ".join(dict.fromkeys(data.path for data in datasets))
    scans_kept = any(data_source(data.path).scan_is_kept for data in datasets)
    with accelerator.local_main_process_first() if scans_kept else nullcontext():
        with phase(f"reading the data in {paths}", print_status):
            examples, bad_files = scan_datasets(
                config.data,
                windows=partial(components.family.conditioning.frame_windows, components=components),
                index_folder=cache_root(config) / "scans",
                layers=components.family.conditioning.trains_layers,
            )
    if config.prior.enabled:  # read with the first dataset's settings
        class_images, bad_class_files = class_examples(config, class_dir, len(examples))
        examples, bad_files = examples + class_images, bad_files + bad_class_files
    if config.adapter.learns_tokens:  # the captions say the new token where they said its word
        examples = [
            replace(example, caption=caption_with_token(example.caption, config.adapter)) for example in examples
        ]
        check_captions([example.caption for example in examples], config.adapter)
    report_bad_files(bad_files, output_dir / BAD_FILES_REPORT if main else None, accelerator.print)
    media = _media_count(examples)
    _check_batch_within_data(config, len(examples), accelerator.num_processes, f"{media} in {paths}")
    if config.preference.method != "off":  # the pairs' controls are their rejected images
        check_preference_pairs(examples, components.family)
    elif config.adapter.trains_controlnet or config.adapter.control_input:  # each target's control says what to draw
        reader = 'adapter.kind = "controlnet"' if config.adapter.trains_controlnet else "adapter.control_input"
        check_one_control_each(examples, "data.path", "control image", reader)
    else:
        components.family.conditioning.check_controls(examples, "data.path")
    sizes = training_sizes(examples, config.data)  # reads every image's header with buckets on: once
    controls = control_sizes(
        examples, sizes, partial(components.family.conditioning.control_size, options=components.family_options)
    )
    tokenize = components.family.conditioning.tokenizer(components)  # picklable for loader workers
    rates = frame_rates(examples) if components.family.conditioning.trains_sound(components) else None
    with phase(
        "filling the caches", print_status if config.cache.latents == "on" or config.cache.text == "on" else None
    ):
        latent_files, control_files, text_files = _fill_caches(
            components, tokenize, examples, sizes, controls, config, accelerator, rates
        )
    return TrainingData(examples, media, sizes, controls, tokenize, rates, latent_files, control_files, text_files)


def _data_batches(
    config: Config, data: TrainingData, components: Components, accelerator: Accelerator, progress: Progress
) -> Iterator[dict]:
    """The data's batches in the run's order, from `progress` on."""
    examples, sizes, controls, rates = data.examples, data.sizes, data.controls, data.rates
    bucketed = any(settings.buckets for settings in config.data.each_dataset())
    dataset = CaptionedImages(
        examples,
        config.data,
        data.tokenize,
        config.train.seed,
        data.latent_files,
        data.text_files,
        sizes,
        memory_bytes=config.cache.memory_mb * 2**20,
        uncached_conditioning=components.family.conditioning.uncached_conditioning,
        control_sizes=controls,
        control_entries=data.control_files,
        sees_controls=components.family.conditioning.prompts_see_controls,
    )
    order = TrainingOrder(
        len(examples),
        config.train.batch_size,
        config.train.seed,
        accelerator.process_index,
        accelerator.num_processes,
        start_batch=progress.micro_batches,
        buckets=batch_groups(sizes, controls, bucketed, frame_counts(examples), rates),
    )
    return iter(build_dataloader(dataset, order, config.data.num_workers, pin_memory=accelerator.device.type == "cuda"))


def loop(run: Run) -> None:
    """Optimizer steps until `train.max_steps` or a stop request; each step is judged by the guard, logged, and
    followed by whatever periodic work (validation, samples, snapshots, checkpoints) falls on it."""
    config, accelerator = run.config, run.accelerator
    max_norm = config.optim.max_grad_norm or float("inf")  # inf: measure the norm, clip nothing
    accumulation = config.train.gradient_accumulation_steps
    global_batch = config.train.batch_size * accelerator.num_processes * accumulation
    bar = tqdm(
        initial=run.progress.global_step,
        total=config.train.max_steps,
        disable=not (run.main and config.log.progress_bar) or config.log.quiet,
        desc="train",
    )
    with RunRequests(run.output_dir, run.main) as requests:
        while run.progress.global_step < config.train.max_steps:
            run.stop_reason, asked = requests.agreed(accelerator, early_stop=bool(run.best and run.best.exhausted))
            if run.stop_reason:
                break
            global_step = run.progress.global_step + 1
            started = time.perf_counter()
            watch = config.log.activations_every_steps and global_step % config.log.activations_every_steps == 0
            activations = BlockActivations(run.components.family, run.unwrapped().denoiser) if watch else nullcontext()
            with activations:
                loss, paths, batch = accumulate_gradients(run)
            # The last micro-step synced the gradients: clip, judge, then step (or skip) on every process alike. The
            # next step's batch is read while the device works; then the step's one wait for it (`step_numbers`).
            norm = accelerator.clip_grad_norm_(run.parameters, max_norm)
            if global_step < config.train.max_steps:
                run.batches.fetch_ahead()
            step_loss, grad_norm = step_numbers(loss, norm)
            skip = run.guard.judge(
                global_step, step_loss, grad_norm, grad_overflow_is_expected=accelerator.scaler is not None
            )
            if skip:
                run.guard.record(global_step, skip, step_loss, grad_norm, gather_object(paths))
            else:
                run.optimizer.step()
                if run.ema and global_step % config.ema.every_steps == 0:
                    update_ema(run.ema, run.parameters, config.ema)
            run.lr_scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
            run.progress = Progress(global_step, run.progress.micro_batches + accumulation)

            seconds = time.perf_counter() - started
            lr = run.lr_scheduler.get_last_lr()[0]
            run.losses.append(step_loss)
            values = {
                "epoch": batch["epoch"][-1].item(),
                "loss": step_loss,
                "grad_norm": grad_norm,
                "lr": lr,
                "skipped": bool(skip),
                "seconds": seconds,
                "samples_per_second": global_batch / seconds,
            } | {name: float(value) for name, value in batch.get("metrics", {}).items()}  # a reward step's scores
            if watch:
                values |= _activation_values(run, global_step, activations)
            diverged = run.guard.divergence(step_loss)
            if diverged:  # before any snapshot, validation or checkpoint of this step
                run.metrics.write(global_step, values)
                _roll_back(run, diverged)
                bar.n = run.progress.global_step
                continue
            if run.main:
                values |= _periodic_work(run, global_step, asked)
            run.metrics.write(global_step, values)
            bar.update(1)
            bar.set_postfix(loss=f"{step_loss:.4f}", lr=f"{lr:.2e}", skipped=run.guard.skipped)
            every = config.checkpoint.every_steps
            if (every and global_step % every == 0) or "save" in asked:  # "Save now": a checkpoint too
                run.checkpointer.save(run.progress, run.named, run.ema, run.guard, run.best)
        bar.close()
        run.metrics.close()


def accumulate_gradients(run: Run) -> tuple[torch.Tensor, list[str], dict]:
    """One optimizer step's micro-batches through forward and backward: the process-averaged loss (on the device, not
    yet read), the images' paths on this process and the last batch. Gradients are synced after the last micro-step."""
    config, accelerator = run.config, run.accelerator
    accumulation = config.train.gradient_accumulation_steps
    step_loss, paths = torch.zeros((), device=accelerator.device), []
    for _ in range(accumulation):
        batch = next(run.batches)
        recasting = computed_copies_saved_as_stored() if config.frozen_weights_kept_apart else nullcontext()
        with accelerator.accumulate(*run.trained_modules), recasting, _denoiser_autocast(run):
            if run.reward:  # a reward step runs its backward a denoising step at a time
                loss, batch["metrics"] = run.reward.loss(run.components, batch, accelerator.backward)
            else:
                loss = _training_loss(run.components, batch, config, accelerator.device, run.slider_prompts).mean()
                accelerator.backward(loss)
        step_loss += loss.detach() / accumulation
        paths += batch["path"]
    return accelerator.reduce(step_loss, reduction="mean"), paths, batch


def step_numbers(loss: torch.Tensor, grad_norm: torch.Tensor | float) -> tuple[float, float]:
    """A step's loss and gradient norm read from the device at once: reading a value makes the host wait until the
    device has computed it, and with the device's queue drained the device waits for the host's next launch. One read
    a step (the guard must see both before the optimizer steps), where `.item()` on each waited twice."""
    loss_and_norm = torch.stack([loss.float(), torch.as_tensor(grad_norm, device=loss.device).float()])
    step_loss, norm = loss_and_norm.tolist()
    return step_loss, norm


class BatchesAhead:
    """The run's batches, one read ahead on asking: `fetch_ahead` while the device computes a step reads, decodes and
    collates the next step's batch then, instead of after the step's wait for the device, when the device would idle
    through it (on the host in the loop's own process with `data.num_workers = 0`)."""

    def __init__(self, batches: Iterator[dict]):
        self.batches = batches
        self.ahead: dict | None = None

    def fetch_ahead(self) -> None:
        if self.ahead is None:
            self.ahead = next(self.batches)

    def __iter__(self) -> BatchesAhead:
        return self

    def __next__(self) -> dict:
        batch, self.ahead = self.ahead, None
        return batch if batch is not None else next(self.batches)


def _denoiser_autocast(run: Run):
    """Accelerate's autocast, where the denoiser runs outside it: Accelerate puts the modules it prepares (the trained
    ones) under autocast, and textual inversion trains the text encoders alone (a ControlNet run its ControlNet), so
    its frozen half-precision denoiser would meet fp32 inputs (a dtype error on every bf16 run)."""
    denoiser_trained = any(module is run.components.denoiser for module in run.trained_modules)
    return nullcontext() if denoiser_trained else run.accelerator.autocast()


def _activation_values(run: Run, step: int, activations: BlockActivations) -> dict:
    """The recorded statistics as metrics, and the guard's warnings about blocks whose outputs are growing."""
    values = activations.values()
    warnings = run.guard.watch_activations(activations.maxima())
    for warning in warnings:
        run.accelerator.print(f"difftune: warning: step {step}: {warning}")
    if warnings:
        values["activation_warnings"] = warnings
    return values


def finish(run: Run) -> TrainResult:
    """The last checkpoint; then, unless stopped early, the result files, samples and parity report."""
    config, accelerator, progress = run.config, run.accelerator, run.progress
    if not run.checkpointer.is_complete(progress.global_step):
        run.checkpointer.save(progress, run.named, run.ema, run.guard, run.best)
    if run.stop_reason == "request":
        accelerator.print(
            f"{RunRequests.MESSAGE} {progress.global_step} of {config.train.max_steps} on request; "
            f"checkpoint written: continue with --resume auto"
        )
        accelerator.end_training()
        return TrainResult(run.unwrapped(), None, run.losses, run.optimizer, run.ema)

    if progress.global_step and run.guard.skipped >= progress.global_step:  # nothing was ever applied
        accelerator.end_training()
        raise DifftuneError(
            f"every one of the run's {progress.global_step} optimizer steps was skipped (see {SKIPPED_FILE}: a "
            "non-finite or spiking loss each time), so nothing trained and no result is written; check the data and "
            "settings (a dataset's loss_weight, optim.learning_rate), then start anew"
        )
    accelerator.wait_for_everyone()
    run.optimizer.eval()  # from here on, a schedule-free optimizer's averaged weights: what the run produced
    if sharding.is_sharded(accelerator):
        components, ema, parameters = _unsharded_copy(run)
    else:
        components, ema, parameters = run.unwrapped(), run.ema, run.parameters
    needs_encoders = config.sample.prompts or config.adapter.trains_all_weights  # a full model is saved whole
    if run.main and needs_encoders and not components.encoders_loaded():
        with phase("loading the encoders again for the end of the run", run.print_status):
            _reload_released(components, config, run.dtypes, accelerator.device)
    for module in host_kept_for_drawing(components, config) if run.main else ():
        module.to(accelerator.device)
    components.denoiser.eval()
    trained_path = _save_results(run, components, ema, parameters) if run.main else None
    if run.stop_reason == "early_stop":
        accelerator.print(
            f"difftune: stopped early at step {progress.global_step}: {config.validation.early_stop_patience} "
            "validations without a lower validation loss"
        )
    for line in run.best.summary() if run.best else ():
        accelerator.print(f"difftune: {line}")
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo":
        # CPU processes take gloo's group down together: one that tore it down while the main process still wrote
        # the results aborted now and then (SIGABRT). Under NCCL the others leave at once, as accelerate's examples
        # do, so a long save never meets NCCL's collective timeout.
        accelerator.wait_for_everyone()
    accelerator.end_training()
    return TrainResult(components, trained_path, run.losses, run.optimizer, ema)


def _unsharded_copy(run: Run) -> tuple[Components, EMAModel | None, list[torch.nn.Parameter]]:
    """Under FSDP every process gathers the trained weights (and the EMA's), and the main process loads them into
    a fresh, unsharded copy of the model: the end-of-run exports and samples then run as they do after DDP."""
    config, main = run.config, run.main
    weights = sharding.gather(run.named, keep=main)
    shadows = sharding.gather(dict(zip(run.named, run.ema.shadow_params, strict=True)), keep=main) if run.ema else {}
    if not main:
        return run.unwrapped(), run.ema, run.parameters
    components = load_training_base(config, run.dtypes)
    components.noise_scheduler = training_noise_scheduler(components.noise_scheduler, config.loss)
    _shape_for_training(components, config, run.dtypes, run.accelerator)
    named = trainable_parameters(components, config.adapter)
    ema = build_ema(list(named.values()), config.ema)
    for name, param in named.items():
        sharding.load_full(param, weights[name])
    if ema:
        for name, shadow in zip(named, ema.shadow_params, strict=True):
            sharding.load_full(shadow, shadows[name])
        ema.optimization_step = run.ema.optimization_step
    return components, ema, list(named.values())


def _accelerator(config: Config, output_dir: Path) -> Accelerator:
    fp8 = config.train.mixed_precision == "fp8"  # its device and torchao are checked before start (preflight)
    # accelerate keeps one AcceleratorState per process and refuses an Accelerator of another precision after
    # the first; a second train() in one process (a notebook, find-lr then train) is a new run with its own.
    # The process group (PartialState) stays.
    AcceleratorState._reset_state()
    accelerator = Accelerator(
        mixed_precision=config.train.mixed_precision,
        kwargs_handlers=[_fp8_recipe()] if fp8 else None,
        gradient_accumulation_steps=config.train.gradient_accumulation_steps,
        log_with=_trackers(config) or None,
        project_dir=output_dir / "logs",
    )
    sharding.check_accelerator(accelerator)
    if sharding.is_sharded(accelerator):
        sharding.check_config(config)
    if config.train.compile:
        _check_compile_device(accelerator.device)
    mixed_norms = {
        # Found by gpu_suite.sh's dry run: a quantized layer's fp32 output meets bf16 norm weights, which CPU
        # autocast leaves to a group norm that refuses mixed dtypes (CUDA's autocast runs norms in fp32).
        f'model.quantize = "{config.model.quantize}"': config.model.quantize != "none",
        # The fp32 ControlNet's group norms meet the bf16 outputs of the convolutions autocast ran before them.
        'adapter.kind = "controlnet"': config.adapter.trains_controlnet,
    }
    mixed = [setting for setting, is_set in mixed_norms.items() if is_set]
    if mixed and config.train.mixed_precision == "bf16" and accelerator.device.type == "cpu":
        raise DifftuneError(
            f'{mixed[0]} with train.mixed_precision = "bf16" fails on a CPU (PyTorch\'s CPU group norm refuses the '
            'mixed dtypes): use mixed_precision "no" here, or a CUDA device'
        )
    keep_models_out_of_accelerate_state(accelerator)
    return accelerator


def _trackers(config: Config) -> list[str]:
    """The accelerate trackers the run logs to, beside metrics.jsonl."""
    asked = {"tensorboard": config.log.tensorboard and is_tensorboard_available(), "wandb": config.log.wandb}
    return [tracker for tracker, on in asked.items() if on]


def _start_trackers(accelerator: Accelerator, config: Config, output_dir: Path) -> None:
    """The trackers' runs, with the config; a W&B run that cannot start (no login, no network) is said in one line
    before the first step."""
    wandb_run = {"name": output_dir.name, "dir": str(output_dir / "logs")}
    try:
        accelerator.init_trackers("difftune", config=_flat_hparams(config), init_kwargs={"wandb": wandb_run})
    except Exception as err:
        if not config.log.wandb or not type(err).__module__.startswith("wandb"):
            raise
        reason = str(err).strip().splitlines()[0]
        raise DifftuneError(
            f"log.wandb: W&B did not start ({reason}); run `wandb login`, set WANDB_API_KEY, or set WANDB_MODE=offline"
        ) from None


def _log_grid(accelerator: Accelerator, folder: Path, step: int, name: str) -> None:
    """A sample folder's grid as an image in the trackers that take images (W&B)."""
    grid = folder / "grid.png"
    if accelerator.is_main_process and grid.is_file() and "wandb" in (tracker.name for tracker in accelerator.trackers):
        with Image.open(grid) as image:
            accelerator.get_tracker("wandb").log_images({name: [image.convert("RGB")]}, step=step)


def _training_loss(
    components: Components, batch: dict, config: Config, device: torch.device, slider_prompts: dict | None = None
) -> torch.Tensor:
    """Per-sample loss (B,) for one micro-batch; all randomness from the samples' own seeds. Cached posteriors
    and text conditioning, when the batch carries them, stand in for the encoders. `slider_prompts`: a concept
    slider's (its loss replaces the captions' objective)."""
    family = components.family
    generators = [torch.Generator().manual_seed(int(seed)) for seed in batch["seed"]]
    if "latent_mean" in batch:
        mean, std = to_device(batch["latent_mean"], device), to_device(batch["latent_std"], device)
        from_pixels = batch.get("pixel_conditioning", {})
    else:
        pixels = to_device(batch["pixel_values"], device)
        with torch.no_grad():
            mean, std = encode_posterior(components.vae, pixels)
            masks = (
                {"masks": to_device(batch["mask"], device)}
                if family.conditioning.reads_masks and "mask" in batch
                else {}
            )
            from_pixels = family.conditioning.pixel_conditioning(components, pixels, **masks)
    latents = sample_latents(mean, std, generators, components.latent_normalization).float()
    if slider_prompts:  # a slider reads its own prompts (`slider_loss`), never the captions
        conditioning = {}
    elif "conditioning" in batch:
        conditioning = {name: to_device(value, device) for name, value in batch["conditioning"].items()}
    else:
        with torch.set_grad_enabled(config.adapter.trains_text_encoders):
            conditioning = _encoded_captions(components, batch, device)
    # What the family made of the pixels (an image-to-video base's first frame)
    conditioning |= {name: to_device(value, device) for name, value in from_pixels.items()}
    if config.adapter.trains_controlnet:  # what the ControlNet reads: the control image, or its latents
        conditioning["control"] = family.controlnet.control_input(
            components, _controls(components, batch, device, family.controlnet.reads_latents)[0]
        )
        controls = []
    else:
        controls = _controls(components, batch, device, as_latents=True)
    if config.adapter.control_input:  # a control LoRA's: more input channels
        conditioning["input_control"] = controls[0]
    elif controls and config.preference.method == "off":  # an edit pair: its controls' latents join the conditioning
        conditioning["control_latents"] = controls
    latents = family.conditioning.trained_latents(latents, conditioning)  # a layered base's: the image and its layers
    timesteps, noise, input_noise = family.objective.draw_timesteps_and_noise(
        components, generators, latents, config.loss
    )
    # A clip's sound's noise, where it trains beside the latents
    conditioning |= family.objective.stream_noise(components, generators, latents, conditioning)
    mask = (
        latent_mask(to_device(batch["mask"], device), latents.shape[2:], config.data.unmasked_weight)
        if "mask" in batch
        else None
    )

    def loss_of(latents: torch.Tensor, conditioning: dict[str, torch.Tensor] = conditioning) -> torch.Tensor:
        return family.objective.loss(
            components, latents, timesteps, noise, conditioning, batch["geometry"], config.loss, input_noise, mask
        )

    if config.preference.method == "dpo":  # a pair's rejected image is its control, at the chosen one's size
        reference_loss_of, base_conditioning = None, {}
        if config.adapter.trains_text_encoders:  # the base reads the captions with its encoders' adapters off too

            def reference_loss_of(latents: torch.Tensor) -> torch.Tensor:
                if not base_conditioning:  # called in `dpo_loss`'s block with every adapter off: once for both images
                    base_conditioning.update(conditioning | _encoded_captions(components, batch, device))
                return loss_of(latents, base_conditioning)

        adapted = torch.nn.ModuleList([components.denoiser, *filter(None, components.text_encoders.values())])
        loss = dpo_loss(
            loss_of,
            adapted,
            latents,
            controls[0],
            config.preference.beta,
            config.preference.chosen_weight,
            reference_loss_of,
        )
    elif slider_prompts:
        loss = slider_loss(
            components, latents, timesteps, noise, slider_prompts, batch["geometry"], config.slider.guidance
        )
    else:
        loss = loss_of(latents)
    return loss * to_device(batch["loss_weight"], device, loss.dtype)  # prior preservation's class images' weight


def _encoded_captions(components: Components, batch: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """The batch's captions through the text encoders (as they are now: their adapters on or off)."""
    ids = {name: to_device(value, device) for name, value in batch["token_ids"].items()}
    return components.family.conditioning.encode_prompts(components, ids)


def _controls(components: Components, batch: dict, device: torch.device, as_latents: bool) -> list[torch.Tensor]:
    """A batch's control images, each (B, C, ...) on `device`: pixels in [-1, 1], or `as_latents` their posteriors'
    normalised means (cached, or encoded here)."""
    if not as_latents:
        return [to_device(pixels, device) for pixels in batch["control_pixels"]]
    means = batch.get("control_latents")
    if "control_pixels" in batch:
        with torch.no_grad():
            means = [
                encode_posterior(components.vae, to_device(pixels, device))[0] for pixels in batch["control_pixels"]
            ]
    return [reference_latents(to_device(mean, device), components.latent_normalization) for mean in means or []]


def _media_count(examples: list) -> str:
    windows = sum(1 for example in examples if example.frames)
    images = len(examples) - windows
    return ", ".join(
        [*([f"{images} images"] if images or not windows else []), *([f"{windows} clip windows"] if windows else [])]
    )


def _check_batch_within_data(config: Config, examples: int, processes: int, what: str) -> None:
    """A batch larger than the data would hold each image several times in every batch: a typo (600,000 over 16
    images trained), refused before anything is cached. Repeats (`data.repeats`, `N_name` folders) count as the data."""
    batch = config.train.batch_size * processes
    if batch > examples:
        per_process = f" ({config.train.batch_size} x {processes} processes)" if processes > 1 else ""
        raise BatchBeyondData(
            f"train.batch_size {config.train.batch_size}{per_process}: a batch of {batch} is more than the data holds "
            f"({what}); use at most {examples // processes}, or repeat the data (data.repeats, or N_name folders)",
            largest=examples // processes,
        )


def latent_mask(mask: torch.Tensor, size: tuple[int, ...], unmasked_weight: float) -> torch.Tensor:
    """Pixel masks (B, 1, H, W), or a clip's (B, 1, T, H, W) -> loss weights per latent pixel at the latents' `size`
    ((h, w), or a clip's (t, h, w)): each latent pixel's share of its patch's mask (area averaging), raised to
    `unmasked_weight` where the mask is 0. An image's mask over a clip's latents covers every frame."""
    if mask.dim() - 2 < len(size):
        mask = mask.unsqueeze(2)
    weights = torch.nn.functional.interpolate(mask.float(), size=tuple(size), mode="area")
    return unmasked_weight + (1 - unmasked_weight) * weights


def _controls_as_latents(components: Components, config: Config) -> bool:
    """Whether the run reads its control images as latents (an edit pair's, a rejected image, most ControlNets'), so
    that the latent cache holds them, or as pixels (SD's and SDXL's ControlNets)."""
    return not config.adapter.trains_controlnet or components.family.controlnet.reads_latents


def _fill_caches(
    components: Components, tokenize, examples, sizes, controls, config: Config, accelerator, rates=None
) -> tuple:
    """Cache files for the examples' latents, their controls' latents and captions (None where that cache is off),
    encoding what is missing, shared out among the processes (`_cache_shares`); `rates`: the examples' frame rates,
    where their sound is cached beside them."""
    latent_files = control_files = text_files = None
    reads_masks = components.family.conditioning.reads_masks  # its latent entries hold what it made of the masks
    if config.cache.latents == "on":
        vae_identity = components.family.conditioning.latent_identity(components)
        latent_files = latent_entries(examples, sizes, vae_identity, config, reads_masks)
        if _controls_as_latents(components, config):
            control_files = control_latent_entries(examples, controls, vae_identity, config)
    if config.cache.text == "on":
        prompts = possible_prompts(
            examples, controls, config.data, config.train.seed, components.family.conditioning.prompts_see_controls
        )
        text_files = text_entries(prompts, text_identity(components), config, tokenize)
    device = accelerator.device
    encoded_controls = [e.control_paths for e in examples] if control_files else []
    paths = [e.path for e in examples] + [c for paths in encoded_controls for c in paths]
    all_sizes = sizes + [size for example_sizes in controls[: len(encoded_controls)] for size in example_sizes]
    windows = [e.frames for e in examples] + [None] * (len(paths) - len(examples))
    all_rates = (rates or [0.0] * len(examples)) + [0.0] * (len(paths) - len(examples))
    all_files = latent_files + [views for files in control_files or [] for views in files] if latent_files else []
    prompt_files = sorted(text_files.items()) if text_files else []
    masks_of = _view_masks(examples, config) if reads_masks else None
    for share, shares in _cache_shares(accelerator):
        mine = [i for i in range(len(all_files)) if i % shares == share]
        if mine:
            for autoencoder in components.autoencoders():
                autoencoder.to(device)
            fill_latents(
                [paths[i] for i in mine],
                [all_sizes[i] for i in mine],
                [all_files[i] for i in mine],
                components.vae,
                config,
                config.train.batch_size,
                [windows[i] for i in mine],
                partial(components.family.conditioning.pixel_conditioning, components),
                partial(components.family.conditioning.sound_conditioning, components)
                if components.family.conditioning.trains_sound(components)
                else None,
                [all_rates[i] for i in mine],
                masks_of,
            )
            for autoencoder in components.autoencoders():  # off the device before the text encoders come (plan.py)
                autoencoder.to("cpu")
        my_prompts = dict(prompt_files[share::shares])
        if my_prompts:
            for encoder in components.text_encoders.values():
                encoder.to(device)
            fill_text(my_prompts, components, device, config)
        accelerator.wait_for_everyone()
    return latent_files, control_files, text_files


def _view_masks(examples: list, config: Config) -> Callable[[Path, tuple[int, int], bool], torch.Tensor] | None:
    """(image, size, flipped) -> its cached view's mask (all ones without one), for a family whose pixel conditioning
    reads the data's masks; None where no dataset gives masks."""
    datasets = config.data.each_dataset()
    masked = {e.path: datasets[e.dataset] for e in examples if datasets[e.dataset].masks != "off" and e.frames is None}
    if not masked:
        return None

    def view_mask(path: Path, size: tuple[int, int], flipped: bool) -> torch.Tensor:
        if path not in masked:
            return torch.ones(1, size[1], size[0])
        return centered_view_mask(path, masked[path], size, flipped, image_size(path))

    return view_mask


def _cache_shares(accelerator) -> list[tuple[int, int]]:
    """(this process's share, shares) of each round of cache filling. First every process encodes the missing ones
    of every n-th entry into the cache folder, which every machine may share (written once, by one process); then each
    machine's processes encode what their own folder still lacks, where each machine has its own (local disk).
    Entries are written atomically, so a folder both rounds write ends the same. One process: one round, as before."""
    rounds = [(accelerator.process_index, accelerator.num_processes)]
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if local_processes < accelerator.num_processes:  # more than one machine
        rounds.append((accelerator.local_process_index, local_processes))
    return rounds


def _check_memory(config: Config, accelerator: Accelerator) -> None:
    """The memory plan (plan.py) before any weight loads: a refusal when the host cannot hold a phase of the run, a
    warning when the device may not. A plan that fails (a base it cannot read from configs alone, such as a hub id
    offline) leaves the run to go on."""
    try:
        kept_in = Path(config.train.output_dir) if accelerator.is_main_process else None  # beside the run's peaks
        warning = check_fits(config, accelerator.device.type, kept_in)
    except DoesNotFit:
        raise
    except Exception as error:  # noqa: BLE001 - a plan that cannot be made leaves the run to go on
        warning = None
        accelerator.print(f"difftune: no memory plan ({type(error).__name__}: {error})")
    if warning:
        accelerator.print(f"difftune: warning: {warning}")


def _release_unneeded(components: Components, config: Config) -> None:
    """Drop the encoders whose outputs are all cached and that nothing else needs until the end of the run, and
    move those that previews or validation need now and then to host memory (`encoder_placement`)."""
    placement = encoder_placement(config)
    if placement["vae"] == "released":
        components.vae = None
        components.pixel_encoders = dict.fromkeys(components.pixel_encoders)
    if placement["text"] == "released":
        components.text_encoders = dict.fromkeys(components.text_encoders)
    if placement["drawing"] == "released":
        components.drawing_parts = dict.fromkeys(components.drawing_parts)
    for module in host_kept_encoders(components, config):
        module.to("cpu")


def _reload_released(components: Components, config: Config, dtypes: RunDtypes, device) -> None:
    """Bring the released encoders (and drawing parts) back for the end-of-run samples and the saved full model,
    placed as the run placed them (in its frozen weights' dtype: the parity check reloads them so too)."""
    loaded = load_components(config.model, replace(dtypes.loaded, denoiser=None, drawing_parts=True))
    store_loaded_text_encoders(loaded, dtypes)
    dtype = dtypes.compute

    def placed(module: torch.nn.Module, is_vae: bool = False, where: torch.device = device) -> torch.nn.Module:
        cast_frozen(module.to(where).eval(), dtype, is_vae)
        return module

    components.vae = components.vae or placed(loaded.vae, is_vae=True)
    for name, encoder in components.text_encoders.items():  # in host memory: they come to the device by turns
        components.text_encoders[name] = encoder or placed(loaded.text_encoders[name], where=torch.device("cpu"))
    for name, part in components.drawing_parts.items():
        components.drawing_parts[name] = part or placed(loaded.drawing_parts[name])
    for name, part in components.pixel_encoders.items():
        components.pixel_encoders[name] = part or placed(loaded.pixel_encoders[name])


def _roll_back(run: Run, why: str) -> None:
    """Reload the last complete checkpoint but keep reading the data from here on, so the batches that led to
    the divergence are skipped rather than replayed. Without `guard.rollback` (or past its limit): stop."""
    config, guard, progress = run.config, run.guard, run.progress
    checkpoint = _resume_point(run.accelerator, run.output_dir, "auto") if config.guard.rollback else None
    if checkpoint is None or guard.rollbacks >= config.guard.max_rollbacks:
        limit = f"; {guard.rollbacks} rollbacks already" if config.guard.rollback and checkpoint else ""
        raise guard.stop(progress.global_step, why + limit)
    rollbacks = guard.rollbacks + 1
    restored = run.checkpointer.load(checkpoint, run.named, run.ema, guard, run.best)
    guard.rollbacks = rollbacks
    run.metrics.rewind(restored.global_step)
    record = {
        "at_step": progress.global_step,
        "to_step": restored.global_step,
        "reason": why,
        "skipped_micro_batches": progress.micro_batches - restored.micro_batches,
    }
    if run.main:
        with open_append(run.output_dir / ROLLBACKS_FILE, RUN_FOLDER) as file:
            file.write(json.dumps(record) + "\n")
    run.accelerator.print(f"difftune: rolled back from step {progress.global_step} to {restored.global_step}: {why}")
    run.progress = Progress(restored.global_step, progress.micro_batches)


def _periodic_work(run: Run, step: int, asked: set[str] = frozenset()) -> dict:
    """Validation loss, preview samples and adapter snapshots when their step comes, or samples and a snapshot when
    `asked` (`RunRequests`: "sample", "save"; main process only)."""
    config, values = run.config, {}
    last = step == config.train.max_steps
    validate = run.validator and (step % config.validation.every_steps == 0 or last)
    due = config.sample.every_steps and step % config.sample.every_steps == 0
    preview = (due or "sample" in asked) and config.sample.prompts and not last  # the last step's come anyway
    if "sample" in asked and not config.sample.prompts and run.print_status:
        run.print_status(f"difftune: step {step}: asked to draw samples, and sample.prompts is empty: nothing to draw")
    snapshot = (config.export.every_steps and (step % config.export.every_steps == 0 or last)) or "save" in asked
    if not (validate or preview or snapshot):
        return values  # most steps: unwrapping the models costs 5 ms (a 64 px tiny-model step is 70)
    with averaged_weights(run.optimizer):
        return values | _validate_preview_snapshot(run, step, validate, preview, snapshot)


def _validate_preview_snapshot(run: Run, step: int, validate: bool, preview: bool, snapshot: bool) -> dict:
    """Validation, previews and snapshots; the autoencoders and drawing parts kept in host memory on the device
    meanwhile, the text encoders coming to it only as they compute (turns.py: the trained denoiser, its adapters and
    their optimizer state stay, unless the device cannot hold both)."""
    config, values, components, device = run.config, {}, run.unwrapped(), run.accelerator.device
    with encoders_on(device, host_kept_for_drawing(components, config)), prompts_read_by_turns(components, device):
        if validate:
            with phase(f"step {step}: validation", run.print_status):
                values |= _validate(run, components, step)
        if preview:
            drawing = _with_encoders(run, components, step)
            with (
                phase(f"step {step}: preview samples", run.print_status),
                run.accelerator.autocast(),
                previewing(drawing),
            ):
                samples = generate_images(drawing, config.sample, run.accelerator.device)
            del drawing
            save_images(samples, config.sample, run.output_dir / "samples" / f"step-{step:06d}")
            _log_grid(run.accelerator, run.output_dir / "samples" / f"step-{step:06d}", step, "samples")
    if snapshot:  # a file as the result is (an adapter's, an embedding's), or a folder (a full model's, a ControlNet's)
        suffix = export.trained_path(config, run.output_dir).suffix
        export.save_trained(components, config, run.output_dir / "snapshots" / f"step-{step:06d}{suffix}", "diffusers")
    return values


def _with_encoders(run: Run, components: Components, step: int) -> Components:
    """`components` able to draw: as they are, or (samples asked of a run that planned none, and so released its
    encoders: `encoder_placement`) a copy with the released parts loaded again for this draw alone, dropped after it."""
    if components.encoders_loaded():
        return components
    copy = replace(
        components,
        text_encoders=dict(components.text_encoders),
        drawing_parts=dict(components.drawing_parts),
        pixel_encoders=dict(components.pixel_encoders),
    )
    with phase(f"step {step}: loading the released encoders for the samples asked", run.print_status):
        _reload_released(copy, run.config, run.dtypes, run.accelerator.device)
    return copy


def _validate(run: Run, components: Components, step: int) -> dict:
    """The validation loss and scores (the EMA's loss too), kept as the best result when they are."""
    values = {"val_loss": run.validator.loss(components)}
    with run.accelerator.autocast():
        values |= run.validator.judged_scores(components)

    def save(variant: str) -> Path:
        return export.save_trained(components, run.config, export.trained_path(run.config, run.output_dir, variant))

    run.best.observe(step, values, save)
    if run.ema:
        with ema_weights(run.ema, run.parameters):
            values["val_loss_ema"] = run.validator.loss(components)
    return values


def _sample_before_training(components: Components, config: Config, output_dir: Path, device: torch.device) -> None:
    """The base's own samples, with the seeds the end-of-run samples use; before any adapter exists. A ControlNet run's
    draw through a ControlNet as it starts (its zero convolutions add nothing: the base's drawing, from the prompts'
    control images), built for them alone; a control LoRA's through the widened denoiser it trains."""
    if config.adapter.trains_controlnet:
        components.controlnet = components.family.controlnet.build(components)
    if config.adapter.control_input:  # widened with zeros: the base's drawing, from the prompts' control images
        components.family.input_control.widen(components.denoiser)
    for module in components.modules():
        module.to(device)
    with previewing(components):
        save_images(
            generate_images(components, config.sample, device, "before"),
            config.sample,
            output_dir / "samples" / "before",
        )
    components.controlnet = None


def _save_results(run: Run, components: Components, ema: EMAModel | None, parameters: list) -> Path:
    """The raw result, its EMA and the average of the last snapshots, then the end-of-run samples."""
    config, output_dir, accelerator, print_status = run.config, run.output_dir, run.accelerator, run.print_status
    with phase("saving the result", print_status):
        files = export.save_result_files(components, config, output_dir)
    trained_path = export.result_files(config, output_dir)[0]
    for suffix in components.family.targets.adapter_file_suffixes(config) if config.export.average_last > 1 else ():
        # One average per file the run writes (an expert's snapshots with its own).
        snapshots = sorted((output_dir / "snapshots").glob(f"step-[0-9]*{suffix}.safetensors"))
        tensors, lora_configs, config_toml = export.average_adapters(
            snapshots[-config.export.average_last :], config.export.average_weights
        )
        export.write_adapter(
            export.variant_of(export.trained_path(config, output_dir, "_avg"), suffix),
            tensors,
            lora_configs,
            config_toml,
            config.export.format,
            components.family,
        )
    if config.sample.prompts:
        with phase("drawing the end samples", print_status), accelerator.autocast(), previewing(components):
            samples = generate_images(components, config.sample, accelerator.device, "end samples")
        save_images(samples, config.sample, output_dir / "samples", output_dir / "samples" / "before")
        _log_grid(accelerator, output_dir / "samples", run.progress.global_step, "samples")
        if config.sample.parity and (short := room_for_a_fresh_copy(components, accelerator.device)):
            accelerator.print(f"difftune: {short}")
        elif config.sample.parity:
            with phase("checking parity: the first sample redrawn with each written file", print_status):
                report = check_parity(
                    config,
                    files,
                    samples[0],
                    accelerator.device,
                    run.dtypes,
                    accelerator.autocast,
                    outputs_in_fp32=accelerator.native_amp,
                )
            accelerator.print(f"difftune: {parity_line(report)}")
            for warning in write_report(report, output_dir):
                accelerator.print(f"difftune: warning: {warning}")
    if ema:
        with ema_weights(ema, parameters):
            export.save_result_files(components, config, output_dir, "_ema")
            if config.sample.prompts:
                with (
                    phase("drawing the EMA's end samples", print_status),
                    accelerator.autocast(),
                    previewing(components),
                ):
                    samples = generate_images(components, config.sample, accelerator.device, "EMA samples")
                save_images(samples, config.sample, output_dir / "samples_ema", output_dir / "samples" / "before")
    card = write_model_card(config, components.family, files, output_dir)
    for line in export.where_files_go(files):
        accelerator.print(f"difftune: {line}")
    accelerator.print(f"difftune: wrote {card}: the model card (`difftune push` uploads it with the files)")
    if config.export.push_to_hub:
        with phase(f"uploading {output_dir} to {config.export.push_to_hub}", print_status):
            try:
                accelerator.print(
                    f"difftune: pushed: {push(output_dir, config.export.push_to_hub, config.export.hub_private)}"
                )
            except DifftuneError as err:  # the run's files are written: a failed upload is said, not raised
                accelerator.print(f"difftune: warning: {err}; the files are kept: `difftune push` uploads them later")
    return trained_path


def load_training_base(config: Config, dtypes: RunDtypes, with_denoiser: bool = True) -> Components:
    """The base as training sees it, each part in the dtype the run keeps it in (`dtypes.loaded`): with
    `model.training_adapter` merged in (what the run saves leaves it out, and previews take off again: `previewing`),
    then the denoiser's frozen layers stored as the run stores them. Without the denoiser, `load_training_denoiser`
    brings it later."""
    model, loaded = config.model, dtypes.loaded
    components = load_components(model, loaded if with_denoiser else replace(loaded, denoiser=None))
    if model.training_adapter:
        components.merged_changes = merge_training_adapter(components, model.training_adapter)
    store_loaded_text_encoders(components, dtypes)
    if with_denoiser:
        store_loaded_denoiser(components, dtypes)
    return components


def load_training_denoiser(components: Components, config: Config, dtypes: RunDtypes) -> None:
    load_denoiser(components, config.model, dtypes.loaded)
    store_loaded_denoiser(components, dtypes)
    check_targets(components, config.adapter)


def previewing(components: Components):
    """Samples show what the saved adapter does on the base: without a merged training adapter's change."""
    return without_merged_changes(components.denoiser, components.merged_changes)


def _shape_for_training(components: Components, config: Config, dtypes: RunDtypes, accelerator: Accelerator) -> None:
    """The trained model as the config wants it: memory format, attention kernel, quantized frozen layers,
    adapters, dtypes, device."""
    _configure_denoiser(components.denoiser, config, accelerator.device)
    if config.model.quantize != "none":
        quantize_linear_layers(components.denoiser, config.model.quantize, accelerator.device, dtypes.compute)
    add_adapters(components, config.adapter)
    _place_models(components, config, dtypes, accelerator)


def _place_models(components: Components, config: Config, dtypes: RunDtypes, accelerator: Accelerator) -> None:
    """Frozen weights in the configured dtype, trained ones in fp32, all on the device."""
    trained = trained_parts(components, config.adapter)
    trained_whole = trained.values() if config.adapter.trains_whole_parts else ()
    offloader = place_frozen(
        components,
        accelerator.device,
        dtypes.compute,
        trained_whole,
        stored=dtypes.stored,
        offloaded=config.model.offload_blocks,
        on_host=host_kept_encoders(components, config),
    )
    if offloader is not None:
        accelerator.print(
            f"model.offload_blocks: {config.model.offload_blocks} blocks' frozen weights in host memory "
            f"({offloader.host_bytes / 2**20:.0f} MiB)"
        )
    for module in components.modules():
        module.train(any(module is part for part in trained.values()))
    cast_training_params(list(trained.values()), dtype=torch.float32)
    if config.train.gradient_checkpointing:
        for part, module in trained.items():
            if part != components.family.denoiser_name:  # a transformers model's switch, or a diffusers one's
                (getattr(module, "gradient_checkpointing_enable", None) or module.enable_gradient_checkpointing)()


def _configure_denoiser(denoiser, config: Config, device: torch.device) -> None:
    """Memory format, attention kernel and checkpointing: set before adapters are injected, so that the
    adapters' own small weights stay contiguous (peft's DoRA on convolutions `view`s them)."""
    if config.train.channels_last == "on" or (config.train.channels_last == "auto" and device.type == "cuda"):
        denoiser.to(memory_format=torch.channels_last)
    set_attention(denoiser, config.train.attention)
    if config.train.gradient_checkpointing:
        enable_gradient_checkpointing(denoiser)


def _fp8_recipe():
    """torchao's float8 training, through accelerate, for the frozen and trained linear layers of the prepared
    models, but not the adapters' own small matrices (a rank-16 matmul gains nothing and loses precision in FP8)
    and not layers whose sides are not multiples of 16 (FP8 matmuls need those)."""
    from accelerate.utils import AORecipeKwargs

    def convertible(module: torch.nn.Module, name: str) -> bool:
        return (
            isinstance(module, torch.nn.Linear)
            and "lora_" not in name
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )

    return AORecipeKwargs(module_filter_func=convertible)


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
        # SDPA's cuDNN kernel gave NaN gradients from the first step on the tiny Flux job in bf16 on an H100
        # (torch 2.11, cu130) while its loss was finite, and the flash, memory-efficient and math kernels trained
        # it finitely, to the same losses (docs/benchmarks.md, "GPU"): training does without it unless asked
        # (`train.attention = "sdpa_cudnn"`, which the GPU suite's side-by-side times against the peer's default).
        torch.backends.cuda.enable_cudnn_sdp(config.train.attention == "sdpa_cudnn")
    elif "on" in (config.train.tf32, config.train.cudnn_benchmark):
        accelerator.print(
            f"difftune: train.tf32 and train.cudnn_benchmark apply to CUDA only; no effect on {accelerator.device}"
        )


def _resume_point(accelerator: Accelerator, output_dir: Path, resume: str) -> Path | None:
    """The checkpoint to continue from (`checkpoint.find_checkpoint`: checked against its manifest), chosen by the
    main process, which sets apart what the run wrote after it (a new branch starts there); every process gets the
    same answer, or the same error."""
    chosen = [None, None]  # the checkpoint, or why there is none
    if accelerator.is_main_process:
        try:
            path = find_checkpoint(output_dir, resume, accelerator.print)
            if path and path.parent.resolve() == (output_dir / CHECKPOINTS_DIR).resolve():
                retire_after(output_dir, step_of(path), accelerator.print)
            chosen[0] = str(path) if path else None
        except DifftuneError as err:
            chosen[1] = str(err)
    broadcast_object_list(chosen)
    if chosen[1]:
        raise DifftuneError(chosen[1])
    return Path(chosen[0]) if chosen[0] else None


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
