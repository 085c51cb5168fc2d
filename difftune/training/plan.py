"""`difftune plan`: a job's peak device memory and host RAM, predicted from its config before any weight is read.

The model is built from its config files on PyTorch's meta device (shapes and dtypes, no data), and the run's own
code shapes it: adapters attached, frozen layers stored and blocks offloaded as the config says
(models/components.py). Then one training step's forward and backward runs on the meta device, with the text
encoders' and the autoencoder's passes before it, under a dispatch mode that adds up the bytes of every tensor
storage made and freed: the peak is what the run's code would hold, by construction, for every family. Two things
the meta device cannot say are modelled: attention (the meta device takes the math path, which keeps the L x S
weights; a fused kernel, flash, memory-efficient, cuDNN or PyTorch's own CPU one, keeps a row statistic instead) and
data-dependent sizes (a mask's count is taken as full: the longest caption, so the plan is an upper bound there).

Host RAM is this process's own (the same libraries imported) plus the weights as the run holds them: safetensors
files in the loading dtype are mapped, not read, so a part occupies RAM only once it runs or is converted.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from difftune import published
from difftune.config import Config, parse_size
from difftune.data.clips import FrameWindows
from difftune.data.sound_files import SoundWindows
from difftune.data.sources import data_source
from difftune.errors import DifftuneError
from difftune.files import pipeline_index, replace_atomically
from difftune.memory.checkpointing import enable_gradient_checkpointing
from difftune.memory.storage import own_cast_buffers, storage_key
from difftune.memory.turns import ROOM_TO_COMPUTE
from difftune.models.components import Components
from difftune.owned_files import write_file
from difftune.progress import process_status_bytes
from difftune.training.metrics import RUN_FOLDER

META = torch.device("meta")
# A CPU run's resident memory grows by about twice the bytes a training step allocates and frees again: glibc's
# heap serves a request only from a freed chunk it fits in, so freed activations between live ones leave holes and
# the heap grows past the bytes in use, and each thread's arena grows on its own. Measured on SD1.5-shaped 256 px
# jobs (fp32, fp16 and fp8 weights: 1.96 to 2.0) against malloc's own count of bytes in use (docs/benchmarks.md). A
# GPU's caching allocator is compared by the bytes it hands out, `max_memory_allocated`: no growth there.
CPU_HEAP_GROWTH = 2.0
# What a CUDA run's host memory holds once it has trained a step, beyond the process before CUDA started: the CUDA
# context and the kernels of cuBLAS, cuDNN and torch loaded as they are first called (lazily: the caching phases,
# which run the encoders' forward alone, load far fewer). Measured on an H200 (torch 2.11, CUDA 13): whole FLUX.1 in
# fp8 with checkpointing at 1024 px held 4.8 GiB while training, 0.83 GiB of it the process before (docs/benchmarks.md).
CUDA_LIBRARIES_HOST = 4 * 2**30
FEW_BLOCKS = 16  # fewer block counts to try than this: each is planned (a UNet's), else bisected (a transformer's)
# Optimizer state per trained (fp32) parameter, in bytes: two fp32 moments (AdamW, schedule-free's z and second
# moment), one (Lion), two 8-bit ones (bitsandbytes), factored rows and columns (Adafactor: about nothing), four
# (Prodigy). adamw_cpu_offload keeps AdamW's in host memory; galore's projected state is counted as AdamW's.
OPTIMIZER_STATE_BYTES = {
    "adamw": 8,
    "adamw_8bit": 2,
    "lion": 4,
    "adafactor": 0,
    "adamw_cpu_offload": 8,
    "galore_adamw": 8,
    "prodigy": 16,
    "adamw_schedule_free": 8,
}


PLAN_FILE = "plan.json"  # a run's plan, in its output folder (`check_fits`)
PROCESS_MEMORY = "python and libraries"  # what a plan's host phases hold of this process's own memory, when planned


@dataclass
class MemoryPlan:
    """Predicted peaks in bytes, each split by what holds it at that peak."""

    device_type: str  # where training runs: "cuda" or "cpu" (then device and host are the same memory)
    device: dict[str, int]
    host: dict[str, int]  # at the host's highest phase
    configs: str = ""  # where the model's configs were read: a local folder, or the published base kept in difftune
    host_phases: dict[str, dict[str, int]] = field(default_factory=dict)  # each phase's, in the run's order
    device_caching: int = 0  # the device's own peak while the caches fill (the encoders and their activations)
    # Drawing samples with the text encoders in host memory (turns.py): the device's training state, what the text
    # encoders need beside it while they read the prompts, the denoiser's bytes that wait in host memory meanwhile
    # where the device cannot hold both, and the host phases that draw.
    device_training: int = 0
    prompts_read: int = 0
    denoiser_waiting: int = 0
    drawing_phases: tuple[str, ...] = ()

    @property
    def device_peak(self) -> int:
        return sum(self.device.values())

    @property
    def host_peak(self) -> int:
        return sum(self.host.values())

    def report(self) -> str:
        lines = [f"configs: {self.configs}"] if self.configs else []
        for title, split in ((f"device ({self.device_type}) peak", self.device), ("host RAM peak", self.host)):
            lines.append(f"{title}: {_gib(sum(split.values()))}")
            lines += [f"  {holder:<28} {_gib(size)}" for holder, size in split.items() if size]
        lines.append("host RAM peak by phase:")
        lines += [f"  {phase:<28} {_gib(sum(held.values()))}" for phase, held in self.host_phases.items()]
        return "\n".join(lines)


# The plans made inside `plans_remembered()`, by config and device type; None outside it
_REMEMBERED_PLANS: ContextVar[dict[tuple[str, str], MemoryPlan] | None] = ContextVar("remembered_plans", default=None)


# Settings no plan reads, as pydantic's `exclude` takes them: how long the run is, where it writes, its seed, its logs
# and checkpoints (`_stored_plan_path`).
UNPLANNED = {"train": {"max_steps", "output_dir", "seed"}, "log": True, "checkpoint": True}
PLANS_FOLDER = "plans"  # under difftune's cache folder
PLANNED_WITH = ("torch", "diffusers", "transformers", "peft", "accelerate")


def _stored_plan_path(config: Config, device_type: str) -> Path | None:
    """Where a plan of `config` on `device_type` is kept between runs, or None where none is: tracing a step on the
    meta device takes seconds (3.3 s for SD1.5 on 2 cores; diffusers' example starts without a plan), and a run
    re-run or resumed with the same settings plans the same. The key is every setting the plan reads, the base
    folder's config files, whether each data folder may hold clips, difftune's own sources and the libraries'
    versions; a base that is not a local folder (a hub id, a single file) is planned afresh every time."""
    if os.environ.get("DIFFTUNE_PLAN_CACHE", "on") == "off" or not Path(config.model.base).is_dir():
        return None
    settings = config.model_dump(mode="json", exclude=UNPLANNED)
    digest = hashlib.sha256(json.dumps([settings, device_type], sort_keys=True).encode())
    for path in sorted(Path(config.model.base).rglob("*.json")):
        digest.update(str(path.relative_to(config.model.base)).encode() + path.read_bytes())
    digest.update(bytes(data_source(data.path).may_hold_clips() for data in config.data.each_dataset()))
    digest.update(_sources_digest())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "difftune" / PLANS_FOLDER
    return cache / f"{digest.hexdigest()[:32]}.json"


@functools.cache
def _sources_digest() -> bytes:
    """difftune's sources and the libraries' versions: a change to either may change a plan."""
    digest = hashlib.sha256(json.dumps([importlib.metadata.version(name) for name in PLANNED_WITH]).encode())
    for path in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.digest()


def _read_stored_plan(path: Path | None) -> MemoryPlan | None:
    try:
        return MemoryPlan(**json.loads(path.read_text(encoding="utf-8"))) if path else None
    except (OSError, ValueError, TypeError):  # none kept, or a file this version cannot read: plan afresh
        return None


def _store_plan(path: Path | None, plan: MemoryPlan) -> None:
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(path, lambda partial: partial.write_text(json.dumps(asdict(plan)), encoding="utf-8"))
    except OSError:  # a read-only home: the next run plans afresh
        pass


def plan_memory(config: Config, device_type: str | None = None) -> MemoryPlan:
    """The plan of `config` training on `device_type` (default: CUDA where there is one)."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    remembered, key = _REMEMBERED_PLANS.get(), (config.model_dump_json(), device_type)
    if remembered is not None and key in remembered:
        return _with_process_memory(remembered[key], process_status_bytes("VmRSS"))
    stored = _stored_plan_path(config, device_type)
    plan = _read_stored_plan(stored)
    if plan is not None:
        plan = _with_process_memory(plan, process_status_bytes("VmRSS"))
    else:
        with _errors_only(), own_cast_buffers():  # diffusers warns on each dtype cast of its models, which placing does
            plan = _plan_memory(with_offload_budget(config), device_type)
        _store_plan(stored, plan)
    if remembered is not None:
        remembered[key] = plan
    return plan


@contextmanager
def plans_remembered():
    """Inside the block a config planned once is not traced again (the fitting ladder's steps, for one budget and the
    next): its plan is remembered, and counts afresh what this process holds then. Outside it every plan is traced:
    between the calls of a long-lived process (the UI's) the base's config files may change."""
    if _REMEMBERED_PLANS.get() is not None:
        yield
        return
    token = _REMEMBERED_PLANS.set({})
    try:
        yield
    finally:
        _REMEMBERED_PLANS.reset(token)


def _with_process_memory(plan: MemoryPlan, process: int) -> MemoryPlan:
    """`plan` with every host phase holding `process` bytes, this process's own (`PROCESS_MEMORY`, first), and the
    host peak its largest phase: as a plan is made, and as a remembered one is given again."""
    phases = {
        phase: {PROCESS_MEMORY: process, **{holder: size for holder, size in held.items() if holder != PROCESS_MEMORY}}
        for phase, held in plan.host_phases.items()
    }
    return replace(plan, host=max(phases.values(), key=lambda held: sum(held.values())), host_phases=phases)


def with_offload_budget(config: Config) -> Config:
    """`config` with its `model.offload_budget` turned into `model.offload_blocks`: the fewest blocks whose planned
    device peak fits the budget (on a CPU as on a GPU: the budget is the accelerator's memory). Unchanged without
    a budget."""
    if not config.model.offload_budget:
        return config
    budget = parse_size(config.model.offload_budget)
    counted = _with(config, ['model.offload_budget=""'])
    found = _fewest_offloaded_blocks(counted, lambda plan: plan.device_peak <= budget, "cuda")
    if found is None:
        blocks = _block_count(counted)
        everything = plan_memory(_with(counted, [f"model.offload_blocks={blocks}"]), "cuda")
        raise DifftuneError(
            f'model.offload_budget = "{config.model.offload_budget}": with all {blocks} blocks '
            f"offloaded the plan's device peak is {_gib(everything.device_peak).strip()}, over the budget; "
            "`difftune plan --device-memory` with the same config says which other settings fit it"
        )
    return _with(counted, [f"model.offload_blocks={found[0]}"])


@contextmanager
def _errors_only():
    import diffusers.utils.logging as diffusers_logging

    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        yield
    finally:
        diffusers_logging.set_verbosity(verbosity)


def _plan_memory(config: Config, device_type: str) -> MemoryPlan:
    from diffusers.training_utils import cast_training_params

    from difftune.adapters.trained import add_adapters
    from difftune.memory.storage import computed_copies_saved_as_stored
    from difftune.models.components import (
        encoder_placement,
        loads_encoders_first,
        place_frozen,
        store_loaded_text_encoders,
    )
    from difftune.models.denoiser_files import gguf_tensor_bytes, is_gguf
    from difftune.models.dtypes import AS_STORED, run_dtypes

    baseline = process_status_bytes("VmRSS")
    source = config_source(config.model)  # once: a single file's keys are read to find it
    components = empty_components(config, source)
    dtypes = run_dtypes(config)  # the dtypes the run keeps its parts in, read once
    loaded = dtypes.loaded
    autoencoders = [module for module in components.autoencoders() if module is not None]
    text_encoders = [module for module in components.text_encoders.values() if module is not None]
    encoders = autoencoders + text_encoders
    drawing = [module for module in components.drawing_parts.values() if module is not None]
    # The encoders as they load: each part in the dtype the run keeps it in (`RunDtypes.loaded`); the drawing parts with
    # them where the run draws before its end (else loaded for the end samples alone).
    encoders_loaded = sum(_bytes(m, loaded.vae if m is components.vae else loaded.others) for m in encoders)
    drawing_loaded = sum(_bytes(m, loaded.others) for m in drawing)
    if loaded.drawing_parts:
        encoders_loaded += drawing_loaded
    dtype = dtypes.compute
    # Loaded in `loaded.others` (counted above), then stored as the run stores them (fp8 text encoders).
    with torch.device(META), _counting(1):
        store_loaded_text_encoders(components, dtypes)
    text_encoding, pixel_encoding = _encoding_peaks(components, config, dtype)
    encoding = max(text_encoding, pixel_encoding)

    add_adapters(components, config.adapter)
    if config.train.gradient_checkpointing:
        enable_gradient_checkpointing(components.denoiser)
    trained = [p for module in components.modules() for p in module.parameters() if p.requires_grad]
    cast_training_params(components.modules(), dtype=torch.float32)
    # On the meta device: the offloaded blocks' host buffers too (counted from the offloader); fp8 scales are 1.
    with torch.device(META), _counting(1):
        offloader = place_frozen(components, META, dtype, stored=dtypes.stored, offloaded=config.model.offload_blocks)
    placement = encoder_placement(config)
    kept_at = {
        where: [
            *(autoencoders if placement["vae"] == where else []),
            *(text_encoders if placement["text"] == where else []),
        ]
        for where in ("device", "host")
    }
    # Drawing parts (Ideogram 4's unconditional transformer) never train: in host memory for previews, else released.
    kept_at["host"] += [
        m for m in components.drawing_parts.values() if m is not None and placement["drawing"] == "host"
    ]
    frozen = _bytes(components.denoiser, frozen_only=True)
    # Stored or cast as it loads (a full fine-tune's in fp32, with its trained weights).
    denoiser_loaded = frozen if loaded.denoiser in (AS_STORED, dtype) else _bytes(components.denoiser, loaded.denoiser)
    if is_gguf(config.model.base) and Path(config.model.base).is_file():  # its blocks as the file holds them
        frozen = denoiser_loaded = gguf_tensor_bytes(config.model.base)
    # A denoiser of parts that take turns on the device (Wan 2.2's experts trained together) has one there at a time,
    # the others waiting in host memory.
    turns = components.family.drawing.denoiser_pipeline_parts(components).values()
    waiting = 0 if device_type == "cpu" else frozen - max(_bytes(part, frozen_only=True) for part in turns)
    trained_bytes = sum(p.numel() * 4 for p in trained)
    optimizer = OPTIMIZER_STATE_BYTES.get(config.optim.optimizer, 8) * sum(p.numel() for p in trained)
    with computed_copies_saved_as_stored():
        step, kept = _step_peak(components, config, dtype)

    on_device = {
        "frozen denoiser weights": frozen - waiting,
        "encoders kept on the device": sum(_bytes(m) for m in kept_at["device"]),
        "trained weights": trained_bytes,
        "optimizer state": 0 if config.optim.optimizer == "adamw_cpu_offload" else optimizer,
        # An encoder that runs every step does so before the denoiser, its activations gone when the step's come.
        "activations and gradients": max(step, encoding) if "device" in placement.values() else step,
    }
    if config.reward.enabled:  # a round's drawn states, every step's (`reward.Round`)
        on_device["drawn states (reward)"] = _reward_states(components, config)
    if device_type == "cpu":
        on_device["heap growth (CPU allocator)"] = round((step - kept) * (CPU_HEAP_GROWTH - 1))
    # Filling the caches: the autoencoders and their activations on the device for the latents, then the text
    # encoders and theirs for the captions (train.py moves the autoencoders off in between), the denoiser not yet.
    caches = set(placement.values()) != {"device"}
    filling = [
        (sum(map(_bytes, autoencoders)), pixel_encoding) if config.cache.latents == "on" else (0, 0),
        (sum(map(_bytes, text_encoders)), text_encoding) if config.cache.text == "on" else (0, 0),
    ]
    held, activations = max(filling, key=sum)
    caching = {"encoders (caching)": held, "encoding activations": activations} if caches and held else {}
    device = on_device if sum(on_device.values()) >= sum(caching.values()) else caching
    offloaded = offloader.host_bytes if offloader is not None else 0
    previews = sum(map(_bytes, kept_at["host"]))
    encoding_on_host = encoding if caches and device_type == "cpu" else 0
    # The host's phases: loading (the encoders alone, when they fill the caches and go first: `loads_encoders_first`;
    # else the whole base) and caching, then the denoiser loading beside the encoders kept for previews, then training.
    if loads_encoders_first(config, components.family):
        phases = {
            "loading and caching": {"encoders": encoders_loaded, "encoding activations": encoding_on_host},
            "loading the denoiser": {"denoiser": denoiser_loaded, "encoders kept for previews": previews},
        }
    else:
        phases = {
            "loading and caching": {
                "whole base": encoders_loaded + denoiser_loaded,
                "encoding activations": encoding_on_host,
            }
        }
    if device_type == "cpu":  # one memory: the training step's, with the encoders kept for previews
        phases["training"] = {**on_device, "offloaded blocks": offloaded, "encoders kept for previews": previews}
    else:
        phases["training"] = {
            "CUDA libraries": CUDA_LIBRARIES_HOST,
            "offloaded blocks": offloaded,
            "denoiser parts waiting": waiting,
            "encoders kept for previews": previews,
            "optimizer state (offloaded)": optimizer if config.optim.optimizer == "adamw_cpu_offload" else 0,
        }
    if config.sample.prompts:  # the end-of-run samples: the released encoders loaded again beside the trained model
        reloaded = encoders_loaded if loaded.drawing_parts else encoders_loaded + drawing_loaded
        phases["end of run samples"] = (
            {
                "CUDA libraries": CUDA_LIBRARIES_HOST,
                "encoders": reloaded,
                "offloaded blocks": offloaded,
                "denoiser parts waiting": waiting,
            }
            if device_type == "cuda"
            else {
                "denoiser": frozen,
                "trained weights": trained_bytes,
                "optimizer state": optimizer,
                "encoders": reloaded,
                "drawing activations": encoding,
            }
        )
    if device_type == "cpu":
        device = max(phases.values(), key=lambda held: sum(held.values()))
    # Samples and validation read prompts with the text encoders brought from host memory (turns.py).
    turns = {
        "device_training": sum(on_device.values()),
        "prompts_read": sum(map(_bytes, text_encoders)) + text_encoding,
        "denoiser_waiting": frozen - waiting + trained_bytes,
        "drawing_phases": tuple(
            phase
            for phase, draws in (("training", placement["text"] == "host"), ("end of run samples", True))
            if draws and phase in phases
        ),
    }
    reads_prompts_by_turns = device_type == "cuda" and placement["text"] != "device"
    plan = MemoryPlan(
        device_type,
        device,
        {},
        configs_read(config.model, source),
        phases,
        sum(caching.values()),
        **(turns if reads_prompts_by_turns else {}),
    )
    return _with_process_memory(plan, baseline)


def on_a_device_of(plan: MemoryPlan, device_memory: int | None) -> MemoryPlan:
    """`plan` on a GPU of `device_memory` bytes: where it cannot hold the text encoders beside the training state while
    they read the prompts of samples or validation, the denoiser waits in host memory meanwhile (turns.py), in the
    phases that draw; else as it is."""
    needed = plan.device_training + plan.prompts_read + ROOM_TO_COMPUTE
    if not device_memory or not plan.drawing_phases or needed <= device_memory:
        return plan
    waiting = {"denoiser (waiting while prompts are read)": plan.denoiser_waiting}
    phases = {
        phase: held | waiting if phase in plan.drawing_phases else held for phase, held in plan.host_phases.items()
    }
    return replace(plan, host=max(phases.values(), key=lambda held: sum(held.values())), host_phases=phases)


def fitting_overrides(
    config: Config,
    device_memory: int | None,
    host_memory: int | None,
    device_type: str | None = None,
    report: Callable[[str], None] | None = None,
) -> tuple[list[str], MemoryPlan] | None:
    """The first settings, in the order other trainers' users reach for them, whose plan fits the budgets:
    gradient checkpointing, then fp8 frozen weights, then (where filling the caches does not fit) fp8 text encoders,
    then offloaded blocks (the fewest that fit), then a smaller batch with accumulation keeping the global batch. A
    setting the config refuses with the job's others (fp8 or offloading in a full fine-tune...) or that changes
    nothing is skipped. Returns the overrides (empty: fits as it is) and their plan, or None when nothing fits.
    `report` is told each setting tried and its peaks, a line each, as it is planned."""

    def device_fits(plan: MemoryPlan) -> bool:
        return device_memory is None or plan.device_type == "cpu" or plan.device_peak <= device_memory

    def fits(plan: MemoryPlan) -> bool:
        return device_fits(plan) and (host_memory is None or plan.host_peak <= host_memory)

    def planned(overrides: list[str]) -> MemoryPlan:
        plan = on_a_device_of(plan_memory(_with(config, overrides), device_type), device_memory)
        if report:
            report(f"{' '.join(overrides) or 'as configured'}: {peaks(plan)}: {'fits' if fits(plan) else 'too large'}")
        return plan

    ladder: list[list[str]] = [[]]
    for setting in ("train.gradient_checkpointing=true", "model.weight_dtype=fp8"):
        if _changes(config, ladder[-1], setting):
            ladder.append(ladder[-1] + [setting])
    for overrides in ladder:
        plan = planned(overrides)
        if fits(plan):
            return overrides, plan
    # Where filling the caches does not fit either (a 7B language model on the GPU), the text encoders in fp8:
    # offloading the denoiser's blocks or a smaller batch would not change that phase.
    text_fp8 = "model.text_encoder_dtype=fp8"
    caching_fits = device_memory is None or plan.device_type == "cpu" or plan.device_caching <= device_memory
    if not caching_fits and _changes(config, ladder[-1], text_fp8):
        ladder = [overrides + [text_fp8] for overrides in ladder]  # the fewest other settings with it
        for overrides in ladder:
            plan = planned(overrides)
            if fits(plan):
                return overrides, plan
    more = config.model.offload_blocks + 1
    if _changes(config, ladder[-1], f"model.offload_blocks={more}"):
        # The fewest blocks the device holds the rest of: each block more only adds host memory, so no larger count
        # fits where that one's host peak does not (searching on both would miss the window between).
        found = _fewest_offloaded_blocks(
            _with(config, ladder[-1]), device_fits, device_type, start=more, report=report, tried=ladder[-1]
        )
        if found and fits(found[1]):
            return ladder[-1] + [f"model.offload_blocks={found[0]}"], found[1]
    batch = config.train.batch_size
    while batch > 1:
        batch //= 2
        accumulation = config.train.gradient_accumulation_steps * config.train.batch_size // batch
        overrides = (
            ladder[-1]
            + [f"train.batch_size={batch}"]
            + ([] if config.train.global_batch_size else [f"train.gradient_accumulation_steps={accumulation}"])
        )
        plan = planned(overrides)
        if fits(plan):
            return overrides, plan
    return None


def _fewest_offloaded_blocks(
    config: Config,
    fits,
    device_type: str | None,
    start: int = 0,
    report: Callable[[str], None] | None = None,
    tried: list[str] = (),
) -> tuple[int, MemoryPlan] | None:
    """The fewest offloaded blocks, from `start` on, whose plan `fits`, with that plan; None when all do not.
    Alike blocks (a transformer's) need less device memory the more are offloaded: bisected. A UNet's few blocks
    differ in size, and two large ones staged together can outweigh one kept: each count is tried in turn. `report`
    hears each count as it is planned (`tried`: the settings it is planned on)."""

    def planned(count: int) -> MemoryPlan:
        setting = f"model.offload_blocks={count}"
        plan = plan_memory(_with(config, [setting]), device_type)
        if report:
            report(f"{' '.join([*tried, setting])}: {peaks(plan)}: device {'fits' if fits(plan) else 'too large'}")
        return plan

    low, high = start, _block_count(config)
    if high - low < FEW_BLOCKS:
        return next(((count, plan) for count in range(low, high + 1) if fits(plan := planned(count))), None)
    found = None
    while low <= high:
        middle = (low + high) // 2
        if fits(plan := planned(middle)):
            found, high = (middle, plan), middle - 1
        else:
            low = middle + 1
    return found


def _block_count(config: Config) -> int:
    from difftune.families import family_of

    return len(family_of(config.model).offloadable_blocks(empty_components(config).denoiser))


def _changes(config: Config, overrides: list[str], setting: str) -> bool:
    """Whether `setting` on top of `overrides` gives a config that differs and that the config's checks accept."""
    try:
        return _with(config, overrides + [setting]) != _with(config, overrides)
    except ValueError:  # pydantic's ValidationError: the job's other settings refuse it
        return False


class DoesNotFit(DifftuneError):
    """A run the memory plan says this machine cannot hold (`check_fits`)."""


def check_fits(config: Config, device_type: str, kept_in: Path | None = None) -> str | None:
    """Before loading: refuse a run whose planned host peak outgrows the RAM available (plus what this process holds
    already, which the plan counts), naming the phase and the settings that would fit: the kernel's OOM killer would
    end it without a word, minutes into loading. A device peak over the GPU's total is a warning (returned): the
    offloading settings that fit it are for the user to weigh. `kept_in`: a folder the plan is written to
    (`PLAN_FILE`), where the UI shows it beside the run's measured peaks."""
    with plans_remembered():  # the settings tried after a refusal start from this plan
        return _check_fits(config, device_type, kept_in)


def _check_fits(config: Config, device_type: str, kept_in: Path | None) -> str | None:
    plan = plan_memory(config, device_type)
    if device_type == "cuda":
        plan = on_a_device_of(plan, torch.cuda.mem_get_info()[1])
    if kept_in is not None:
        Path(kept_in).mkdir(parents=True, exist_ok=True)
        write_file(Path(kept_in) / PLAN_FILE, json.dumps(asdict(plan), indent=2) + "\n", RUN_FOLDER, ours=False)
    host = _available_bytes()
    if host and plan.host_peak > host:
        phase, peak = max(
            ((phase, sum(held.values())) for phase, held in plan.host_phases.items()), key=lambda item: item[1]
        )
        fitting = fitting_overrides(config, None, host, device_type)
        advice = (
            f"it would fit with {' '.join(fitting[0])}"
            if fitting and fitting[0]
            else "no setting tried fits it (checkpointing, fp8 weights, fp8 text encoders, offloaded blocks, smaller "
            "batches)"
        )
        raise DoesNotFit(
            f"the memory plan needs {_gib(peak).strip()} of host RAM while {phase}, and this machine has "
            f"{_gib(host).strip()} available: {advice}; train.check_memory = false tries anyway"
        )
    if device_type == "cuda" and plan.device_peak > (total := torch.cuda.mem_get_info()[1]):
        return (
            f"the memory plan predicts a peak of device memory {_gib(plan.device_peak).strip()} of the GPU's "
            f"{_gib(total).strip()}; `difftune plan` with the same config and --device-memory says which settings fit"
        )
    return None


def empty_components(config: Config, source: tuple[Path, str] | None = None) -> Components:
    """The base's parts on the meta device, built from its config files (`source`, else `config_source`'s);
    tokenizers and scheduler loaded (small files), or, from configs alone, a tokenizer that gives the published
    length."""
    from diffusers import ModelMixin
    from transformers import AutoConfig

    from difftune.families import family_of
    from difftune.families.common.loading import part_class as index_part_class

    model = config.model
    folder, kept = source or config_source(model)
    family = family_of(model.model_copy(update={"base": str(folder), "family": model.family}) if kept else model)
    index = pipeline_index(folder)
    parts = {}
    for name, spec in index.items():
        if name.startswith("_") or not (
            isinstance(spec, list) and len(spec) == 2 and all(isinstance(x, str) for x in spec)
        ):
            continue  # a setting (Krea 2's `text_encoder_select_layers`), or a part left out
        if name in family.fixed_pipeline_arguments and family.fixed_pipeline_arguments[name] is None:
            continue  # a part the family never loads (ACE-Step's audio tokenizer)
        part_class = index_part_class(*spec)
        if not issubclass(part_class, torch.nn.Module):
            holds_text = kept and not any(
                (folder / name / file).is_file() for file in ("scheduler_config.json", "preprocessor_config.json")
            )
            parts[name] = (
                LengthOnlyTokenizer(**published.tokenizer_settings(kept, name))
                if holds_text
                else part_class.from_pretrained(folder, subfolder=name)
            )
            continue
        with torch.device(META):
            if issubclass(part_class, ModelMixin):
                parts[name] = part_class.from_config(part_class.load_config(folder / name))
            else:  # transformers builds in the config's dtype; the run loads fp32
                parts[name] = part_class._from_config(AutoConfig.from_pretrained(folder / name)).float()
    if model.vae:
        from difftune.models.autoencoders import VAE_CLASSES

        vae_folder = Path(model.vae) / "vae" if (Path(model.vae) / "vae" / "config.json").is_file() else Path(model.vae)
        vae_config = json.loads((vae_folder / "config.json").read_text())
        with torch.device(META):
            parts["vae"] = VAE_CLASSES[vae_config["_class_name"]].from_config(vae_config)
    # Named by the folder it was read from, as `from_pretrained` names a pipeline (a saved index may keep another).
    index = index | {"_name_or_path": str(folder)}
    return family.loading.components_of(SimpleNamespace(**parts, config=index), family.options(model))


def config_source(model) -> tuple[Path, str]:
    """Where the plan reads `model.base`'s configs: (a folder laid out as a pipeline's, the published base whose
    configs difftune keeps when it read those, else ""). A local pipeline folder, a single file's
    `model.single_file_config`, a hub id whose configs are kept (`difftune/published`), or else the family's
    reference base where the base is not on this machine (a single file without a config folder, a folder still
    to be made)."""
    from difftune.families import FAMILIES, family_of
    from difftune.models.components import SINGLE_FILE_SUFFIXES

    base = model.base
    single_file = base.endswith(SINGLE_FILE_SUFFIXES)
    folder = Path(model.single_file_config if single_file and model.single_file_config else base)
    if pipeline_index(folder) is not None:
        return folder, ""
    if published.is_published(base):
        return published.config_folder(base), base
    if single_file and Path(base).is_file():
        name = family_of(model).name  # by the file's keys
    elif model.family != "auto" and not Path(base).exists():
        name = model.family
    else:
        raise DifftuneError(
            f"difftune plan reads the model's config files: {base} is neither a local pipeline folder nor a base "
            f"whose configs difftune keeps ({', '.join(published.published_bases())}); set model.family to plan it "
            "as its family's reference base, or model.single_file_config to a diffusers folder"
        )
    reference = published.reference_bases()[FAMILIES[name].name]
    return published.config_folder(reference), reference


def configs_read(model, source: tuple[Path, str] | None = None) -> str:
    """What the plan says of where its configs came from (`source`: `config_source`'s answer, when known)."""
    from difftune.models.components import SINGLE_FILE_SUFFIXES

    folder, kept = source or config_source(model)
    if not kept:
        return f"the pipeline folder {folder}"
    if kept == model.base:
        return f"{kept}'s, kept in difftune (nothing downloaded)"
    family = next(name for name, base in published.reference_bases().items() if base == kept)
    why = (
        "a single file holds no configs; model.single_file_config names its own"
        if model.base.endswith(SINGLE_FILE_SUFFIXES)
        else f"model.base {model.base} is not on this machine"
    )
    return f"{kept}'s, kept in difftune: the {family} family's reference base ({why})"


class LengthOnlyTokenizer:
    """A tokenizer for a plan made from configs alone. The plan asks a tokenizer for the ids of the longest caption
    it allows (every position a token: the plan's upper bound), padded to the published tokenizer's length or the one
    the family asks for, and its pad id; this one gives exactly that, a chat template as the caption itself, and,
    unpadded (a fixed suffix), a token per 4 characters."""

    pad_token_id = eos_token_id = 0

    def __init__(self, model_max_length: int, padding_side: str = "right"):
        self.model_max_length, self.padding_side = model_max_length, padding_side
        self.tokenizer = self  # a processor's tokenizer is itself here

    def __call__(self, text=None, padding=None, max_length=None, **kwargs):
        from transformers import BatchEncoding

        texts = [text] if isinstance(text, str) else list(text)
        length = (
            (max_length or self.model_max_length)
            if padding == "max_length"
            else max(1, max(len(piece) for piece in texts) // 4)
        )
        ids = torch.ones(len(texts), length, dtype=torch.long)
        if isinstance(text, str) and kwargs.get("return_tensors") is None:  # one text's ids, as a list
            return BatchEncoding({"input_ids": ids[0].tolist(), "attention_mask": [1] * length})
        return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})

    def apply_chat_template(self, conversation, tokenize=False, return_dict=False, **kwargs):
        batched = bool(conversation) and isinstance(conversation[0], list)
        turns = conversation if batched else [conversation]
        texts = [turn[-1]["content"] if isinstance(turn[-1]["content"], str) else " " * 4 for turn in turns]
        if not tokenize:
            return texts if batched else texts[0]
        encoded = self(texts, **{key: value for key, value in kwargs.items() if key in ("padding", "max_length")})
        return encoded if return_dict else encoded["input_ids"]


def _with(config: Config, overrides: list[str]) -> Config:
    """`config` with `section.key=value` overrides (values as JSON where they parse, else strings), validated."""
    data = config.model_dump()
    for override in overrides:
        key, value = override.split("=", 1)
        section, name = key.split(".")
        try:
            data[section][name] = json.loads(value)
        except json.JSONDecodeError:
            data[section][name] = value
    return type(config).model_validate(data)


LAYOUT_NUMEL = 1 << 16  # a boolean or integer tensor this small, made of constants, is a layout: computed for real
_CONSTANT_FACTORIES = {
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.new_ones.default,
    torch.ops.aten.new_full.default,
    torch.ops.aten.zeros.default,
    torch.ops.aten.ones.default,
    torch.ops.aten.full.default,
    torch.ops.aten.scalar_tensor.default,  # a Python number in an operation with a tensor (`torch.where(mask, 4, 1)`)
    torch.ops.aten.arange.default,
    torch.ops.aten.arange.start,
    torch.ops.aten.arange.start_step,
}


_COUNTS = (torch.ops.aten.sum.default, torch.ops.aten.sum.dim_IntList)  # a mask's count is at most its size


class _PeakBytes(TorchDispatchMode):
    """The bytes of the tensor storages made inside this mode and still alive, and their peak. A storage is made
    by an operation whose result does not share an argument's (a view or an in-place result shares it: a weight's
    transpose is not a new weight). A data-dependent scalar of a meta tensor answers `full` (an integer: a mask's
    count taken as all of it, at most the mask's size) or 1.0, unless the tensor is a layout: small boolean or integer
    tensors made of constants (zeros, ones, ranges) and what is computed from them alone keep their values (`known`),
    so that a model that lays out its sequence by a mask (Qwen-Image 2.1's image slots) gets that layout's shapes."""

    def __init__(self, full: int):
        super().__init__()
        self.full, self.live, self.now, self.peak = full, WeakIdKeyDictionary(), 0, 0
        self.known = WeakIdKeyDictionary()  # meta layout tensor -> its values on the CPU
        self.counted = WeakIdKeyDictionary()  # a count of unknown values -> the most it can be: what it counted

    def _freed(self, size: int) -> None:
        self.now -= size

    def _layout(self, func, args, kwargs, tensors: list[torch.Tensor]):
        """`func`'s result with its values, where it is a layout computed from constants and layouts alone (else
        None): computed on the CPU, returned on the meta device, its values kept. `tensors`: its arguments' tensors."""
        factory = func in _CONSTANT_FACTORIES
        if not self.known and not factory:  # nothing known to compute from, or to forget (most of a model's operations)
            return None
        if func._schema.is_mutable:  # what it writes in place is no longer known (what it reads stays)
            written = [
                kwargs.get(argument.name) if argument.kwarg_only else (args[i] if i < len(args) else None)
                for i, argument in enumerate(func._schema.arguments)
                if argument.alias_info is not None and argument.alias_info.is_write
            ]
            storages = {storage_key(t) for t in tree_flatten(written)[0] if isinstance(t, torch.Tensor)}
            for tensor in [t for t in self.known if storage_key(t) in storages]:  # its views too
                del self.known[tensor]
            return None
        meta_tensors = [t for t in tensors if t.is_meta]
        if not factory and (not meta_tensors or any(t not in self.known for t in meta_tensors)):
            return None

        def on_cpu(value):
            if not isinstance(value, torch.Tensor) or not value.is_meta:
                return value
            return torch.empty(0, dtype=value.dtype) if factory else self.known[value]

        cpu_args, cpu_kwargs = tree_map(on_cpu, (args, kwargs))
        # A `new_*` factory takes its device from its tensor, which is on the CPU here.
        if "device" in cpu_kwargs or (factory and not func.__name__.startswith("new_")):
            cpu_kwargs["device"] = torch.device("cpu")
        if factory:
            size = next((a for a in cpu_args if isinstance(a, (list, tuple))), None)
            if size is not None and torch.Size(size).numel() > LAYOUT_NUMEL:
                return None
        try:
            result = func(*cpu_args, **cpu_kwargs)
        except RuntimeError:  # a view the CPU copy's strides do not allow: the meta run goes on without the values
            return None
        if not isinstance(result, torch.Tensor) or result.is_floating_point() or result.numel() > LAYOUT_NUMEL:
            return None
        is_view = bool(func._schema.returns) and func._schema.returns[0].alias_info is not None
        on_meta = func(*args, **kwargs) if is_view else result.to(META)  # a view stays a view of its base
        self.known[on_meta] = result
        return on_meta

    def _indexed_by_layout(self, func, args, kwargs, tensors: list[torch.Tensor]):
        """`func`'s meta result where a layout indexes, masks or repeats a tensor of unknown values: by the layout's
        values, where the operation takes them from the CPU (indexing does). None where no argument is a layout, or
        where the operation cannot take them (arithmetic with a meta tensor, which needs no values)."""
        if not self.known or not any(t in self.known for t in tensors):
            return None
        known_args, known_kwargs = tree_map(
            lambda t: self.known.get(t, t) if isinstance(t, torch.Tensor) else t, (args, kwargs)
        )
        try:
            result = func(*known_args, **known_kwargs)
        except RuntimeError:
            return None
        if any(isinstance(t, torch.Tensor) and not t.is_meta for t in tree_flatten(result)[0]):
            return None  # computed on the CPU from a layout and a plain value: not this meta run's
        return result

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            if args[0] in self.known:
                return self.known[args[0]].item()
            return 1.0 if args[0].is_floating_point() else min(self.full, self.counted.get(args[0], self.full))
        if func is torch.ops.aten._to_copy.default and args[0].is_meta and kwargs.get("device", META) != META:
            # A meta tensor's values read out (`tolist()`: Z-Image's and Lumina's per-caption lengths): as above.
            source = args[0]
            if source in self.known:
                return self.known[source].clone()
            return torch.full(source.shape, 1.0 if source.is_floating_point() else self.full, dtype=source.dtype)
        # The arguments' tensors, flattened once: three looks at them an operation, tens of thousands of operations.
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        layout = self._layout(func, args, kwargs, tensors)
        if layout is not None:
            return layout
        result = self._indexed_by_layout(func, args, kwargs, tensors)
        if result is None:
            result = func(*args, **kwargs)
        if func in _COUNTS and args[0].is_meta and not args[0].is_floating_point():
            self.counted[result] = args[0].numel()
        arguments = {storage_key(t) for t in tensors}
        for tensor in tree_flatten(result)[0]:
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            if storage_key(tensor) not in arguments and storage not in self.live:
                self.live[storage] = size = storage.nbytes()
                weakref.finalize(storage, self._freed, size)
                self.now += size
                self.peak = max(self.peak, self.now)
        return result


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel keeps for backward: inputs, output and a float32 statistic a query row."""

    @staticmethod
    def forward(ctx, query, key, value):
        output = query.new_empty(*query.shape[:-1], value.shape[-1])
        ctx.save_for_backward(query, key, value, output, query.new_empty(query.shape[:-1], dtype=torch.float32))
        return output

    @staticmethod
    def backward(ctx, grad):
        query, key, value, *_ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


@contextmanager
def _fused_attention():
    functional = torch.nn.functional
    plain = functional.scaled_dot_product_attention
    functional.scaled_dot_product_attention = lambda query, key, value, *args, **kwargs: _FusedAttention.apply(
        query, key, value
    )
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = plain


@contextmanager
def _counting(full: int):
    import torch.fx.experimental._config as fx_config

    assumed = fx_config.meta_nonzero_assume_all_nonzero
    fx_config.meta_nonzero_assume_all_nonzero = True  # a boolean mask selects all it could
    try:
        with _fused_attention(), _PeakBytes(full) as counter:
            yield counter
    finally:
        fx_config.meta_nonzero_assume_all_nonzero = assumed


def _inputs(components: Components, config: Config, dtype: torch.dtype, batch: int):
    """Token ids (the longest caption the tokenizers allow), pixels and latents of `batch` samples at the largest size
    training draws (`_planned_media`), and the longest caption's length."""
    ids = {
        name: value.to(META)
        for name, value in components.family.conditioning.tokenizer(components)([""] * batch).items()
    }
    pixels, latents = _planned_media(components, config, dtype, batch)
    return ids, pixels, latents, max(value.shape[1] for value in ids.values())


def _planned_media(
    components: Components, config: Config, dtype: torch.dtype, batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's pixels and latents at the largest size training draws: images at the largest resolution, a clip's of
    the longest window (`_planned_frames`), a sound's of a window (one row high: `SoundWindows`)."""
    from difftune.models.autoencoders import downsampling, latent_channels, latent_frames

    vae, channels = components.vae, latent_channels(components.vae)
    windows = components.family.conditioning.frame_windows(config.data, components)
    if isinstance(windows, SoundWindows):
        samples = windows.length
        latents = torch.zeros(batch, channels, 1, samples // downsampling(vae), device=META, dtype=dtype)
        return torch.zeros(batch, 2, 1, samples, device=META), latents
    side = config.data.largest_resolution()
    frames = _planned_frames(components, config)
    time = (latent_frames(vae, frames),) if frames else ()
    size = side // downsampling(vae)
    latents = torch.zeros(batch, channels, *time, size, size, device=META, dtype=dtype)
    return torch.zeros(batch, 3, *((frames,) if frames else ()), side, side, device=META), latents


def _planned_frames(components: Components, config: Config) -> int:
    """The frames of the longest clip window training can draw, where the family reads clips and a dataset's path holds
    any (0: images alone). Stored sources are not searched (that would read them): a video base plans for clips in
    them."""
    longest = 0
    for data in config.data.each_dataset():
        windows = components.family.conditioning.frame_windows(data, components)
        if not isinstance(windows, FrameWindows) or not data_source(data.path).may_hold_clips():
            continue
        if windows.extraction == "full":
            longest = max(longest, windows.rounded(windows.max_frames))
        else:
            longest = max(longest, *(windows.rounded(frames) for frames in windows.target_frames))
    return longest


def _encoding_peaks(components: Components, config: Config, dtype: torch.dtype) -> tuple[int, int]:
    """The activations of encoding a batch, without gradients: the text encoders' (its captions), and the
    autoencoder's with the family's pixel conditioning (its images)."""
    from difftune.models.autoencoders import encode_posterior

    ids, pixels, latents, full = _inputs(components, config, dtype, config.train.batch_size)
    with torch.no_grad(), _counting(full) as text:
        components.family.conditioning.encode_prompts(components, ids)
    with torch.no_grad(), _counting(full) as images:
        encode_posterior(components.vae, pixels)
        components.family.conditioning.pixel_conditioning(components, pixels)
    return text.peak, images.peak


def _reward_batch(config: Config) -> int:
    """The images one reward step's forward and backward hold at once: a denoising step of the round's images (twice,
    with guidance), DRaFT's last K steps of its images, or ReFL's one."""
    reward = config.reward
    guided = 2 if reward.guidance_scale > 1 else 1
    if reward.method == "draft":
        return config.train.batch_size * guided * reward.draft_last_steps
    if reward.method == "refl":
        return config.train.batch_size * guided
    return config.train.batch_size * reward.group_size * guided


def _reward_states(components: Components, config: Config) -> int:
    """A GRPO round's states in fp32 (`reward.steps` + 1 of each image's latents), kept through its updates."""
    from difftune.models.autoencoders import downsampling, latent_channels

    if config.reward.method != "grpo":
        return 0
    side = config.data.largest_resolution() // downsampling(components.vae)
    images = config.train.batch_size * config.reward.group_size
    return (config.reward.steps + 1) * images * latent_channels(components.vae) * side * side * 4


def _step_peak(components: Components, config: Config, dtype: torch.dtype) -> tuple[int, int]:
    """The peak of one training step's forward and backward (activations, gradients, temporaries), and the part
    of it still held after the step (gradients, buffers kept for the next step). Diffusion-DPO's and a concept
    slider's steps hold two batches' activations (the chosen and rejected images, or the LoRA at +1 and -1, run with
    gradients before the backward): planned as one batch of twice the size."""
    two_passes = config.preference.method == "dpo" or config.slider.enabled
    batch = config.train.batch_size * (2 if two_passes else 1)
    if config.reward.enabled:
        batch = _reward_batch(config)
    ids, pixels, latents, full = _inputs(components, config, dtype, batch)
    side = config.data.largest_resolution()
    with torch.no_grad(), _counting(full):
        conditioning = components.family.conditioning.encode_prompts(components, ids)
        conditioning |= components.family.conditioning.pixel_conditioning(
            components, pixels
        )  # an image-to-video model's first frame
    conditioning = {
        name: value.to(dtype) if value.is_floating_point() else value for name, value in conditioning.items()
    }
    planned = components.family.conditioning.planned_controls(components, latents)  # an edit pair's controls, or layers
    if components.controlnet is not None:  # the ControlNet's control image (its latents, or its pixels) instead
        controlnet = components.family.controlnet
        conditioning["control"] = controlnet.control_input(components, latents if controlnet.reads_latents else pixels)
    elif planned:
        conditioning["control_latents"] = planned
    latents = components.family.conditioning.trained_latents(latents, conditioning)
    geometry = torch.tensor([[side, side, 0, 0, side, side]] * batch, device=META)
    timesteps = torch.full((batch,), 500, device=META)
    with _counting(full) as counter, _meta_autocast_as_cpu():
        components.family.planned_prediction(
            components, latents, timesteps, conditioning, geometry
        ).float().square().mean().backward()
        return counter.peak, counter.now


@contextmanager
def _meta_autocast_as_cpu():
    """`torch.autocast` for the meta device as for the CPU: a model that turns autocast off around a computation
    names its tensors' device (Ideogram 4's rotary embedding), and autocast knows no "meta" (the CPU's, off, is a
    null context, which is what the model asks for)."""
    autocast = torch.autocast

    class MetaAsCpu(autocast):
        def __init__(self, device_type: str, *args, **kwargs):
            super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)

    torch.autocast = MetaAsCpu
    try:
        yield
    finally:
        torch.autocast = autocast


def _named_modules(components: Components) -> dict[str, torch.nn.Module]:
    named = {
        components.family.denoiser_name: components.denoiser,
        "vae": components.vae,
        **components.text_encoders,
        **components.drawing_parts,
        **components.pixel_encoders,
    }
    return {name: module for name, module in named.items() if module is not None}


def _bytes(module: torch.nn.Module, dtype: torch.dtype | None = None, frozen_only: bool = False) -> int:
    """The bytes of `module`'s parameters and buffers, its floating-point ones in `dtype` if given (with
    `frozen_only`, less its trained parameters)."""
    tensors = (*(p for p in module.parameters() if not (frozen_only and p.requires_grad)), *module.buffers())
    return sum(t.numel() * (dtype.itemsize if dtype and t.is_floating_point() else t.element_size()) for t in tensors)


def _available_bytes() -> int:
    """RAM available to this process (Linux): what the kernel could give it now, plus what it holds."""
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        return 0
    line = next((line for line in meminfo.read_text().splitlines() if line.startswith("MemAvailable:")), "")
    return int(line.split()[1]) * 1024 + process_status_bytes("VmRSS") if line else 0


def peaks(plan: MemoryPlan) -> str:
    """A plan's two peaks in a few words: `device 14.4 GiB, host 16.4 GiB`."""
    device = f"device {_gib(plan.device_peak).strip()}, " if plan.device_type != "cpu" else ""
    return f"{device}host {_gib(plan.host_peak).strip()}"


def _gib(size: int) -> str:
    return f"{size / 2**30:6.2f} GiB"
