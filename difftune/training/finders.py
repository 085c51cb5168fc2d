"""Answers before a run: what batch size fits (`find_batch`), and what learning rate to use (`find_lr`).

Both train a throwaway copy of the job (a probe) in a scratch folder: no checkpoints, exports, samples or
validation, and nothing written to the job's own output. The batch finder runs each trial in a fresh process,
so a peak is that trial's alone and an out-of-memory failure (CUDA's error, or the kernel's kill on the CPU)
ends the trial, not the search.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import resource
import tempfile
from collections.abc import Callable
from pathlib import Path

from difftune.config import Config
from difftune.errors import BatchBeyondData, DifftuneError

LR_RANGE_FILE = "lr_range.json"
LR_PLOT_FILE = "lr_range.png"
GIB = 2**30


def probe_config(config: Config, output_dir: Path, **changes: dict) -> Config:
    """The job as a probe: trains like it, writes nothing but its scratch folder, and takes `changes` (section ->
    values, e.g. `train={"max_steps": 2}`)."""
    data = config.model_dump(mode="json")
    data["train"] |= {"output_dir": str(output_dir), "overwrite": True}
    data["validation"]["path"] = ""
    data["sample"] |= {"prompts": [], "before": False, "every_steps": 0}
    data["checkpoint"]["every_steps"] = 0
    data["export"] |= {"every_steps": 0, "average_last": 0}
    data["guard"]["rollback"] = False
    data["log"] |= {"tensorboard": False, "progress_bar": False, "activations_every_steps": 0}
    for section, values in changes.items():
        data[section] |= values
    return Config.model_validate(data)


# The batch-size finder.


def find_batch(
    config: Config,
    max_memory_gb: float | None = None,
    max_batch: int = 64,
    steps: int = 2,
    margin: float = 0.1,
    num_processes: int = 1,
    report: Callable[[str], None] = print,
) -> dict:
    """The largest per-process batch whose `steps` optimizer steps stay within the memory budget, and the
    accumulation that reaches `train.global_batch_size` (when set) with `num_processes` processes.

    Budget: `max_memory_gb` if given; else, on CUDA, the device memory free when each trial starts, and on the
    CPU the memory available now, each less `margin`. Sizes double from 1, then the gap between the last fit
    and the first failure is bisected (as Lightning's batch-size finder does). A batch larger than the data holds
    (with its repeats) is refused by the trial before any work, and the search stops at what the data holds
    (`limited_by`: "data"; else "memory", or "max_batch")."""
    import psutil

    if max_batch < 1 or steps < 1:
        raise DifftuneError(f"find-batch: --max-batch and --steps must be 1 or more, got {max_batch} and {steps}")
    budget = max_memory_gb * GIB if max_memory_gb else None
    cpu_budget = budget or psutil.virtual_memory().available * (1 - margin)
    trials: list[dict] = []
    data_holds = None  # the largest batch the data holds, once a trial has found it

    def fits(batch_size: int) -> bool:
        nonlocal data_holds
        if data_holds is not None and batch_size > data_holds:
            return False  # known without a trial
        trial = run_batch_trial(config, batch_size, steps)
        if "data_holds" in trial:
            data_holds = trial["data_holds"] // num_processes  # the trial ran one process
            report(f"difftune find-batch: batch {batch_size}: more than the data holds (at most {data_holds})")
            return False
        if "failure" in trial:
            raise DifftuneError(f"find-batch: the trial at batch size {batch_size} failed: {trial['failure']}")
        limit = budget or (trial["free_bytes"] * (1 - margin) if trial.get("free_bytes") else cpu_budget)
        trial["fits"] = "error" not in trial and trial["peak_bytes"] <= limit
        trial["budget_gb"] = round(limit / GIB, 3)
        trials.append(trial)
        peak = f"peak {trial['peak_bytes'] / GIB:.2f} GiB" if "peak_bytes" in trial else trial.get("error")
        report(
            f"difftune find-batch: batch {batch_size}: {peak} of {limit / GIB:.2f} GiB: "
            f"{'fits' if trial['fits'] else 'too large'}"
        )
        return trial["fits"]

    largest = largest_fitting(fits, max_batch)
    if largest == 0:
        failed = trials[0]
        why = failed.get("error") or f"peak {failed['peak_bytes'] / GIB:.2f} GiB"
        raise DifftuneError(
            f"find-batch: batch size 1 does not fit ({why}, "
            f"budget {failed['budget_gb']} GiB): turn on train.gradient_checkpointing, a lower data.resolution or "
            f'model.weight_dtype = "bf16", or raise --max-memory-gb'
        )
    limited_by = "data" if largest == data_holds else "max_batch" if largest == max_batch else "memory"
    if limited_by == "data":
        report(
            f"difftune find-batch: batch {largest} is all the data holds: the data, not memory, sets the limit "
            "(repeat the data, data.repeats or N_name folders, for larger batches)"
        )
    result = {
        "largest_batch_size": largest,
        "limited_by": limited_by,
        **batch_and_accumulation(largest, config.train.global_batch_size, num_processes),
    }
    # What `--write` and the UI put into the job: the global batch too when the job sets one.
    settings = {"train.batch_size": result["batch_size"]}
    if config.train.global_batch_size:
        settings["train.global_batch_size"] = result["global_batch_size"]
    return result | {"settings": settings, "device": trials[-1]["device"], "steps_per_trial": steps, "trials": trials}


def largest_fitting(fits: Callable[[int], bool], max_batch: int) -> int:
    """The largest size in [1, max_batch] that `fits` (0 if none), assuming that a size that fits means every
    smaller one does. Doubles, then bisects: about 2 log2(answer) trials."""
    low, high, size = 0, max_batch + 1, 1
    while size <= max_batch:
        if not fits(size):
            high = size
            break
        low, size = size, size * 2
    if high > max_batch and low < max_batch:  # every doubling fitted: the limit itself is the last candidate
        if fits(max_batch):
            return max_batch
        high = max_batch
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def batch_and_accumulation(largest: int, global_batch_size: int, num_processes: int) -> dict:
    """The settings to train with: without a target global batch, the largest batch; with one, the largest batch
    that divides the target's per-process share, and the accumulation steps that make up the rest."""
    if not global_batch_size:
        return {"batch_size": largest, "gradient_accumulation_steps": 1, "global_batch_size": largest * num_processes}
    if global_batch_size % num_processes:
        raise DifftuneError(
            f"train.global_batch_size {global_batch_size} is not a multiple of the {num_processes} process(es)"
        )
    share = global_batch_size // num_processes
    batch_size = max(size for size in range(1, min(largest, share) + 1) if share % size == 0)
    return {
        "batch_size": batch_size,
        "gradient_accumulation_steps": share // batch_size,
        "global_batch_size": global_batch_size,
    }


def run_batch_trial(config: Config, batch_size: int, steps: int) -> dict:
    """Train the probe at `batch_size` for `steps` steps in a fresh process; its peak memory, or why it failed."""
    with tempfile.TemporaryDirectory(prefix="difftune-find-batch-") as scratch:
        result_path = Path(scratch) / "trial.json"
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no memory or CUDA state inherited
        process = context.Process(
            target=_batch_trial, args=(config.model_dump(mode="json"), batch_size, steps, scratch, str(result_path))
        )
        process.start()
        process.join()
        if result_path.exists():
            return json.loads(result_path.read_text())
        # Killed before it could report: on Linux most often the kernel's out-of-memory killer (SIGKILL).
        why = "killed (out of memory?)" if process.exitcode == -9 else f"failed with exit code {process.exitcode}"
        return {"batch_size": batch_size, "device": "unknown", "error": why}


def _batch_trial(config_data: dict, batch_size: int, steps: int, scratch: str, result_path: str) -> None:
    import sys

    import torch

    sys.stdout = sys.stderr  # the finder's stdout carries its JSON result alone

    from difftune.training.train import loop, setup

    batch = {"batch_size": batch_size, "max_steps": steps, "gradient_accumulation_steps": 1, "global_batch_size": 0}
    config = probe_config(Config.model_validate(config_data), Path(scratch) / "run", train=batch)
    cuda = torch.cuda.is_available()
    result = {"batch_size": batch_size, "device": "cuda" if cuda else "cpu"}
    if cuda:
        result["free_bytes"] = torch.cuda.mem_get_info()[0]
    try:
        run = setup(config)
        loop(run)
        run.accelerator.end_training()
        if cuda:
            result["peak_bytes"] = torch.cuda.max_memory_reserved()
        else:
            result["peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    except torch.OutOfMemoryError:
        result["error"] = "out of memory"
    except BatchBeyondData as err:  # refused before any work: the search stops at what the data holds
        result["data_holds"] = err.largest
    except Exception as err:  # not a question of size: the parent stops the search with this message
        result["failure"] = str(err) if isinstance(err, DifftuneError) else f"{type(err).__name__}: {err}"
    Path(result_path).write_text(json.dumps(result))


# The learning-rate range test.


def find_lr(
    config: Config,
    out_dir: Path,
    start_lr: float = 1e-7,
    end_lr: float = 1.0,
    steps: int = 100,
    smoothing: float = 0.98,
    diverge_factor: float = 4.0,
) -> dict:
    """Smith's range test (2017) as fastai runs it: the rate grows exponentially from `start_lr` to `end_lr` over
    `steps` optimizer steps of a probe of the job; the loss is smoothed (a debiased running mean) and the sweep
    stops once it passes `diverge_factor` times its minimum. Suggests a tenth of the rate at the smoothed
    minimum, where the loss still falls fast but is far from diverging. Writes the curve (JSON) and its plot
    (PNG) to `out_dir`; the job's own output is not touched."""
    from tqdm.auto import tqdm

    from difftune.training.optim import learning_rate_scale
    from difftune.training.train import accumulate_gradients, setup

    if not 0 < start_lr < end_lr:
        raise DifftuneError(f"find-lr: need 0 < --start-lr < --end-lr, got {start_lr:g} and {end_lr:g}")
    if steps < 10:
        raise DifftuneError(f"find-lr: --steps {steps} is too few for a smoothed curve; use 10 or more (100 is usual)")
    with tempfile.TemporaryDirectory(prefix="difftune-find-lr-") as scratch:
        # Warmup, schedule, EMA and the guard would each bend the curve: the sweep is the schedule.
        run = setup(
            probe_config(
                config,
                Path(scratch) / "run",
                train={"max_steps": steps},
                optim={"warmup_steps": 0, "lr_schedule": "constant"},
                ema={"enabled": False},
                guard={"enabled": False},
            )
        )
        groups = run.optimizer.param_groups
        ratios = [group["lr"] / groups[0]["lr"] for group in groups]  # the text encoders keep their relative rate
        max_norm = config.optim.max_grad_norm or float("inf")
        rates, losses, smoothed, average, best = [], [], [], 0.0, math.inf
        for step in tqdm(range(steps), desc="find-lr", disable=not run.main):
            rate = start_lr * (end_lr / start_lr) ** (step / (steps - 1))
            for group, ratio in zip(groups, ratios, strict=True):
                group["lr"] = rate * ratio
            loss = float(accumulate_gradients(run)[0])  # the sweep judges each step: one read of the device a step
            run.accelerator.clip_grad_norm_(run.parameters, max_norm)
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            average = smoothing * average + (1 - smoothing) * loss
            value = average / (1 - smoothing ** (step + 1))
            rates.append(rate)
            losses.append(loss)
            smoothed.append(value)
            if not math.isfinite(value) or value > diverge_factor * best:
                break
            best = min(best, value)
        run.metrics.close()
        run.accelerator.end_training()
    result = suggest_learning_rate(rates, smoothed, diverged=len(rates) < steps)
    global_batch = (
        run.config.train.batch_size * run.accelerator.num_processes * run.config.train.gradient_accumulation_steps
    )
    # The sweep set the rates themselves; optim.learning_rate is that rate before optim.scale_lr scales it.
    result["learning_rate"] = result["suggested_lr"] / learning_rate_scale(config.optim.scale_lr, global_batch)
    result["settings"] = {"optim.learning_rate": result["learning_rate"]}  # what `--write` and the UI apply
    result |= {
        "start_lr": start_lr,
        "end_lr": end_lr,
        "steps_run": len(rates),
        "lrs": rates,
        "losses": losses,
        "smoothed_losses": smoothed,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / LR_RANGE_FILE).write_text(json.dumps(result, indent=1) + "\n")
    plot_lr_range(result, out_dir / LR_PLOT_FILE)
    return result


def suggest_learning_rate(rates: list[float], smoothed: list[float], diverged: bool) -> dict:
    """A tenth of the rate at the smoothed minimum. `diverged`: whether the sweep stopped on divergence."""
    finite = [i for i, value in enumerate(smoothed) if math.isfinite(value)]
    if len(finite) < 3:
        raise DifftuneError("find-lr: the loss was not finite from the first steps: lower --start-lr")
    # The first tenth is left out of the search: a running mean of a handful of diffusion losses (each at a random
    # timestep) is mostly noise, and a lucky early value would pin the suggestion to the sweep's start.
    lowest = min(finite[len(rates) // 10 :] or finite, key=lambda i: smoothed[i])
    return {
        "suggested_lr": rates[lowest] / 10,
        "min_loss_lr": rates[lowest],
        "diverged": diverged,
        # No divergence: the minimum may lie past the sweep, and the suggestion is a lower bound.
        "note": ""
        if diverged
        else "the loss did not diverge within the sweep: raise --end-lr for a sharper suggestion",
    }


def plot_lr_range(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=100)
    axes.plot(result["lrs"], result["losses"], color="0.75", linewidth=0.8, label="loss")
    axes.plot(result["lrs"], result["smoothed_losses"], color="C0", linewidth=2, label="smoothed loss")
    axes.axvline(result["suggested_lr"], color="C3", linestyle="--", label=f"suggested {result['suggested_lr']:.2e}")
    axes.set_xscale("log")
    finite = [v for v in result["smoothed_losses"] if math.isfinite(v)]
    lowest = min(finite)
    bottom = min([lowest] + [v for v in result["losses"] if math.isfinite(v)])
    axes.set_ylim(bottom * 0.9, max(min(max(finite), 4 * lowest), lowest + 1e-6) * 1.1)  # the diverged tail clipped
    axes.set_xlabel("learning rate")
    axes.set_ylabel("training loss")
    axes.set_title("learning-rate range test")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
