"""Training-speed benchmark: the real `train()` on a generated model and synthetic images.

Model specs have random weights (a weight's value does not change speed): `tiny`, `tiny-sdxl` and `tiny-flux`
are the test models, `sd15` has Stable Diffusion 1.5's shapes (UNet 860M, VAE 84M, CLIP ViT-L/14 text encoder 123M),
`sdxl` SDXL base 1.0's (UNet 2.6B, the same VAE, CLIP ViT-L/14 and OpenCLIP ViT-bigG/14 text encoders 123M
and 695M). `flux` has FLUX.1-dev's widths with fewer blocks, so that a CPU can step it: 1 double- and 2
single-stream blocks of its 19 and 38 (width 3072, 24 heads, guidance embedding; 0.64B of its 11.9B), its
16-channel VAE, CLIP ViT-L/14 and T5-XXL's widths in 2 of its 24 layers, 512 T5 tokens. A step's transformer
time grows about linearly in the blocks: the full model is about (19 x double + 38 x single) / (1 x double +
2 x single) times slower per step. `qwen_image` has Qwen-Image's widths with 1 of its 60 blocks (width 3072, 24
heads, 3584-wide text states; 0.34B of its 20.4B), its autoencoder (Wan 2.1's) whole, and Qwen2.5-VL-7B's widths in
2 of its 28 language-model layers (over the byte-level tokenizer built here, so a small vocabulary); the full
transformer is about 60 times slower per step. `tiny-qwen_image` is its test model.
`blocks` gives the flow transformers their own block counts (`19,38` is a whole FLUX.1, `60` a whole Qwen-Image:
what block offloading is measured on); those are saved in bf16 and their MFU is not counted.
Seconds per step are the median over the steps after warm-up, read from the run's metrics.jsonl.
Peak memory is the measured run's peak RSS on CPU (the cache is filled in another process), and
`torch.cuda.max_memory_allocated` on GPU. On GPU the
model FLOPs utilisation (MFU) is the denoiser's training FLOPs per step (counted by
`torch.utils.flop_counter` on one step's forward and backward) over the step time and the device's
dense peak for the precision.
"""

from __future__ import annotations

import multiprocessing
import resource
import statistics
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from difftune.adapters.trained import add_adapters
from difftune.config import FAMILY_NAMES, load_config
from difftune.families import load_components
from difftune.models.autoencoders import downsampling, latent_channels
from difftune.toy import micro, tiny
from difftune.training.metrics import read_metrics
from difftune.training.train import train

# Dense tensor-core peaks (FLOP/s) by device name and precision, from the vendors' data sheets.
PEAK_FLOPS = {
    "H100": {"fp8": 1979e12, "bf16": 989e12, "fp16": 989e12, "fp32": 494e12},  # SXM; fp32 = TF32
    "H200": {"fp8": 1979e12, "bf16": 989e12, "fp16": 989e12, "fp32": 494e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 156e12},
    "L40S": {"fp8": 733e12, "bf16": 362e12, "fp16": 362e12, "fp32": 183e12},
    "RTX 4090": {"fp8": 330e12, "bf16": 165e12, "fp16": 165e12, "fp32": 83e12},
}


@dataclass
class BenchOptions:
    model: str = "tiny"  # tiny | tiny-sdxl | tiny-flux | tiny-qwen_image | sd15 | sdxl | flux | qwen_image
    resolution: int = 32
    batch: int = 1
    steps: int = 3
    warmup: int = 1
    adapter: str = "lora"
    rank: int = 4
    precision: str = "fp32"  # fp32 | bf16 | fp16 | fp8
    optimizer: str = "adamw"
    quantize: str = "none"  # none | int8 | nf4
    weight_dtype: str = "auto"  # model.weight_dtype: fp8 stores the frozen weights in fp8
    offload_blocks: int = 0  # model.offload_blocks: blocks whose frozen weights stay in host memory
    blocks: str = ""  # flux: "double,single" (FLUX.1's own: "19,38"); qwen_image: "60"; empty: the few above
    cache: bool = False
    channels_last: bool = torch.cuda.is_available()  # the trainer's `auto`
    gradient_checkpointing: bool = False
    compile: bool = False
    attention: str = "sdpa"
    num_workers: int = 2 if torch.cuda.is_available() else 0  # the trainer's 2 where a GPU waits for the data
    profile: str = ""  # a path: torch.profiler's table of the measured run's operators, by device time
    workdir: str = ""
    dry_run: bool = False  # the same job shrunk to run on a CPU in seconds (dry_run_of): plumbing, not numbers

    def dry_run_of(self) -> BenchOptions:
        """This job as a CPU checks its plumbing (gpu_suite.sh --dry-run): the spec's tiny test model at 64 px,
        batch 2 at most, 1 warm-up and 2 measured steps, one offloaded block where any were, and what a CPU refuses
        as it allows: FP8 compute as bf16, a quantized denoiser in fp32, compile off, AdamW's state where it is."""
        precision = "fp32" if self.quantize != "none" else "bf16" if self.precision == "fp8" else self.precision
        return replace(
            self,
            model=f"tiny-{real_width_models()[self.model]}" if self.model in real_width_models() else self.model,
            resolution=64,
            batch=min(self.batch, 2),
            steps=2,
            warmup=1,
            blocks="",
            offload_blocks=min(self.offload_blocks, 1),
            precision=precision,
            compile=False,
            optimizer="adamw" if self.optimizer == "adamw_cpu_offload" else self.optimizer,
        )


# The test models: each family's micro pipeline, for the families with real-width models here (`tiny` is SD's).
TINY_MODELS = {"tiny": "tiny-sd"}


def real_width_models() -> dict[str, str]:
    """{model spec: family}: the families whose micro module builds their real model's widths (`REAL_WIDTH_MODEL`)."""
    return {
        micro.builder(family).REAL_WIDTH_MODEL: family
        for family in FAMILY_NAMES
        if hasattr(micro.builder(family), "REAL_WIDTH_MODEL")
    }


def build_pipeline(model: str, blocks: tuple[int, ...] = ()):
    """The model spec's pipeline: `tiny-<family>` a family's micro pipeline, a real-width spec its family's
    `real_width_pipeline(blocks)` (`blocks` sets the flow transformers' block counts, Flux: double, single)."""
    torch.manual_seed(0)
    model = TINY_MODELS.get(model, model)
    real_width = real_width_models()
    if model.removeprefix("tiny-") in real_width.values():
        return micro.build_pipeline(family=model.removeprefix("tiny-"))
    if model in real_width:
        return micro.builder(real_width[model]).real_width_pipeline(blocks)
    known = [*TINY_MODELS, *(f"tiny-{family}" for family in real_width.values()), *real_width]
    raise ValueError(f"unknown model spec {model!r}; known: {', '.join(known)}")


def prepare_workspace(options: BenchOptions) -> tuple[Path, Path, Path]:
    """The generated model (saved once per spec) and synthetic images, under the workdir."""
    root = Path(options.workdir or Path(tempfile.gettempdir()) / "difftune-bench")
    blocks = tuple(int(count) for count in options.blocks.split(",")) if options.blocks else ()
    model_dir = root / "-".join(["model", options.model, *map(str, blocks)])
    if not (model_dir / "model_index.json").exists():
        pipeline = build_pipeline(options.model, blocks)
        if blocks:  # a whole FLUX.1 is 48 GB in fp32: saved in bf16 (loaded as fp32 all the same)
            pipeline.to(torch.bfloat16)
        pipeline.save_pretrained(model_dir, safe_serialization=True)
    data_dir = root / f"data-{options.resolution}-{options.batch * (options.steps + options.warmup)}"
    if not data_dir.exists():
        count = options.batch * (options.steps + options.warmup)
        images = [
            (image.resize((options.resolution,) * 2), caption) for image, caption in tiny.shape_images(count, seed=0)
        ]
        tiny.write_caption_folder(data_dir, images)
    return root, model_dir, data_dir


def _config(options: BenchOptions, model_dir: Path, data_dir: Path, output_dir: Path, cache_dir: Path, steps: int):
    overrides = {
        "model.base": model_dir,
        "data.path": data_dir,
        "data.resolution": options.resolution,
        "data.num_workers": options.num_workers,
        "adapter.kind": options.adapter,
        "adapter.rank": options.rank,
        "train.output_dir": output_dir,
        "train.max_steps": steps,
        "train.batch_size": options.batch,
        "train.overwrite": "true",
        "train.mixed_precision": {"fp32": "no"}.get(options.precision, options.precision),
        "train.channels_last": str(options.channels_last).lower(),
        "train.attention": options.attention,
        "train.gradient_checkpointing": str(options.gradient_checkpointing).lower(),
        "train.compile": str(options.compile).lower(),
        "optim.optimizer": options.optimizer,
        "model.quantize": options.quantize,
        "model.weight_dtype": options.weight_dtype,
        "model.offload_blocks": options.offload_blocks,
        "cache.latents": str(options.cache).lower(),
        "cache.text": str(options.cache).lower(),
        "cache.dir": cache_dir,
        "log.progress_bar": "false",
        "log.tensorboard": "false",
        "guard.enabled": "false",
    }
    return load_config(None, [f"{key}={value}" for key, value in overrides.items()])


def denoiser_training_flops(options: BenchOptions, model_dir: Path, device: torch.device) -> float:
    """FLOPs of one training step of the denoiser (forward and backward, adapters attached), counted by torch."""
    from torch.utils.flop_counter import FlopCounterMode

    config = _config(options, model_dir, model_dir, model_dir, model_dir, 1)
    components = load_components(config.model)
    add_adapters(components, config.adapter)
    for module in components.modules():
        module.to(device)
    family, batch = components.family, options.batch
    size = options.resolution // downsampling(components.vae)
    latents = torch.randn(batch, latent_channels(components.vae), size, size, device=device)
    token_ids = family.conditioning.tokenizer(components)(["a red circle"] * batch)
    with torch.no_grad():
        conditioning = family.conditioning.encode_prompts(
            components, {name: ids.to(device) for name, ids in token_ids.items()}
        )
    geometry = torch.tensor(
        [[options.resolution, options.resolution, 0, 0, options.resolution, options.resolution]] * batch
    )
    timesteps = torch.full((batch,), 500, device=device)
    with FlopCounterMode(display=False) as counter:
        family.denoise(components, latents, timesteps, conditioning, geometry).square().mean().backward()
    return float(counter.get_total_flops())


@contextmanager
def _profiled(path: str, device: torch.device):
    """torch.profiler around the measured run when `path` is set: operators by host time and, on a GPU, by device
    time, with the device's busy time to set beside the run's wall time (how long the device waits for the host)."""
    if not path:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        yield
    events = profiler.key_averages()
    tables = [events.table(sort_by="self_cpu_time_total", row_limit=50)]
    if device.type == "cuda":
        # Kernels' own rows; the operators that launched them carry the same time again.
        busy = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
        by_device = events.table(sort_by="self_cuda_time_total", row_limit=50)
        tables = [f"device busy: {busy:.3f} s over the whole run", by_device, *tables]
    Path(path).write_text("\n".join(tables))


def measure(options: BenchOptions) -> dict:
    """One benchmark run in this process: JSON-ready results (with the options as run: a dry run's shrunk ones)."""
    if options.dry_run:
        options = options.dry_run_of()
    root, model_dir, data_dir = prepare_workspace(options)
    cache_dir = root / "cache"
    if options.cache:  # a warm cache, as a second run over the same data sees it, filled in a process of its own
        # so that the peak RSS is the measured run's alone (memory freed by one run is not all returned to the OS)
        prefill = multiprocessing.get_context("spawn").Process(
            target=train, args=(_config(options, model_dir, data_dir, root / "prefill", cache_dir, 1),)
        )
        prefill.start()
        prefill.join()
        if prefill.exitcode:
            raise RuntimeError(f"filling the cache failed (exit code {prefill.exitcode})")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    output_dir = root / "run"
    with _profiled(options.profile, device):
        train(_config(options, model_dir, data_dir, output_dir, cache_dir, options.warmup + options.steps))
    seconds = statistics.median(row["seconds"] for row in read_metrics(output_dir)[options.warmup :])
    result = {
        **asdict(options),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "seconds_per_step": seconds,
        "samples_per_second": options.batch / seconds,
        "peak_host_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    if device.type == "cuda":
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
        # Counting FLOPs places the whole denoiser on the device in fp32: not for the offloaded ones' sizes.
        flops = None if options.blocks else denoiser_training_flops(options, model_dir, device)
        peak = next((p.get(options.precision) for name, p in PEAK_FLOPS.items() if name in result["device"]), None)
        result["denoiser_tflops_per_step"] = flops / 1e12 if flops else None
        result["mfu"] = flops / seconds / peak if peak and flops else None
    else:
        result["peak_memory_bytes"] = result["peak_host_memory_bytes"]
        result["mfu"] = None  # no meaningful dense peak for a CPU
    return result
