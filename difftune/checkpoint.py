"""Resumable checkpoints: written atomically, loaded only when complete, restoring the exact run.

`output_dir/checkpoints/step-NNNNNN/` holds:
- `accelerate/`: accelerate's `save_state` (optimizer, LR scheduler, loss scaler, every process's RNG
  states); models are left out by hooks, since a LoRA run would otherwise save the frozen base each time.
  accelerate reads these back with `torch.load(weights_only=True)` and an allowlist.
- `trained.safetensors`: the trained parameters by name, and the EMA's as `ema.<name>`; full tensors even under
  FSDP (gathered from every process's shard, and sliced back into shards on load).
- `state.json`: the position (optimizer steps, micro-batches consumed), the guard's history, the best validation
  results so far, the config.
- `COMPLETE`: written last. A folder without it, or a `.tmp-` folder, is never loaded.

Data order and per-sample noise are functions of (seed, position), so the position is all the data
side needs: the resumed run draws exactly the batches, noise and timesteps the killed run would have.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from difftune.config import Config, resolve_path_values
from difftune.errors import DifftuneError
from difftune.sharding import gather, load_full

CHECKPOINTS_DIR = "checkpoints"
MARKER = "COMPLETE"
TRAINED_FILE = "trained.safetensors"
STATE_FILE = "state.json"
EMA_PREFIX = "ema."


@dataclass
class Progress:
    global_step: int = 0  # optimizer steps done
    micro_batches: int = 0  # global micro-batches consumed from the data stream


class StopRequest:
    """SIGTERM or SIGINT (the UI's stop button, Ctrl-C, a cluster's preemption notice) asks the run to stop
    after the current step with a checkpoint; a second signal gets the default behaviour at once.

    Every process answers `agreed` alike (a request on any process counts), so all stop at the same step.
    """

    MESSAGE = "difftune: stopped at step"  # how train's log says it honoured one; the UI's jobs read it

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # Python installs handlers there only
            self._previous = {sig: signal.signal(sig, self._request) for sig in self.SIGNALS}

    def _request(self, signum, frame) -> None:
        if self.requested:
            self.restore()
            signal.raise_signal(signum)
        self.requested = True

    def agreed(self, accelerator, early_stop: bool = False) -> str | None:
        """Why every process stops now: "request" (a signal on any process), "early_stop" (`early_stop` on any: the
        main process validates), or None to go on. One collective either way."""
        flags = torch.tensor([float(self.requested), float(early_stop)], device=accelerator.device)
        requested, early = accelerator.reduce(flags, reduction="sum").tolist()
        return "request" if requested else "early_stop" if early else None

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> StopRequest:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def keep_models_out_of_accelerate_state(accelerator) -> None:
    """Our trained weights go to trained.safetensors; accelerate keeps the optimizer, scheduler and RNG."""
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: weights.clear())
    accelerator.register_load_state_pre_hook(lambda models, input_dir: models.clear())


class Checkpointer:
    """Saves and loads one run's checkpoints: `save` and `load` take the same objects (the trained parameters by
    name, the EMA, the guard) and `load` puts back into them what `save` took out of them."""

    def __init__(self, accelerator, output_dir: Path, config: Config):
        self.accelerator = accelerator
        self.output_dir = Path(output_dir)
        self.config = config

    def path(self, step: int) -> Path:
        return self.output_dir / CHECKPOINTS_DIR / f"step-{step:06d}"

    def is_complete(self, step: int) -> bool:
        return (self.path(step) / MARKER).is_file()

    def save(self, progress: Progress, named: dict, ema, guard, best=None) -> Path:
        """Write to `.tmp-step-N`, flush, rename to `step-N`, then mark it complete; prune beyond `keep_last`."""
        accelerator, final = self.accelerator, self.path(progress.global_step)
        staging = final.with_name(f".tmp-{final.name}")
        if accelerator.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(staging / "accelerate"))  # every process writes its own RNG state
        main = accelerator.is_main_process
        tensors = gather(named, keep=main)  # under FSDP every process holds a shard
        if ema:
            tensors |= gather({EMA_PREFIX + name: shadow for name, shadow in zip(named, ema.shadow_params)}, keep=main)
        accelerator.wait_for_everyone()
        if main:
            bad = [name for name, value in tensors.items() if not torch.isfinite(value).all()]
            if bad:
                raise DifftuneError(f"checkpoint at step {progress.global_step}: NaN or inf in {bad[0]}; not saved")
            save_file(tensors, staging / TRAINED_FILE)
            state = {
                "progress": asdict(progress),
                "num_processes": accelerator.num_processes,
                "guard": guard.state_dict(),
                "best": best.state_dict() if best else None,
                "ema_updates": ema.optimization_step if ema else None,  # drives the EMA's decay ramp
                "config": self.config.to_toml(),
            }
            (staging / STATE_FILE).write_text(json.dumps(state, indent=1), encoding="utf-8")
            _fsync_tree(staging)
            if final.exists():
                shutil.rmtree(final)
            staging.rename(final)
            _write_synced(final / MARKER, f"step {progress.global_step}\n")
            for old in complete_checkpoints(self.output_dir)[: -self.config.checkpoint.keep_last]:
                shutil.rmtree(old)
        accelerator.wait_for_everyone()
        return final

    def load(self, path: Path, named: dict, ema, guard, best=None) -> Progress:
        """Restore trained weights, EMA, guard, best results, optimizer, scheduler and RNG from `path`; where to
        continue."""
        accelerator = self.accelerator
        missing = [name for name in (TRAINED_FILE, STATE_FILE, "accelerate") if not (path / name).exists()]
        if missing:
            raise DifftuneError(f"checkpoint {path} is missing {', '.join(missing)}; it cannot be resumed")
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
        check_resumable(state["config"], self.config, state["num_processes"], accelerator.num_processes, accelerator.print)
        tensors = load_file(path / TRAINED_FILE)
        weights = {k: v for k, v in tensors.items() if not k.startswith(EMA_PREFIX)}
        if weights.keys() != named.keys():
            difference = sorted(weights.keys() ^ named.keys())
            raise DifftuneError(f"checkpoint {path}: its trained parameters do not match this model (e.g. {difference[0]})")
        with torch.no_grad():
            for name, param in named.items():
                load_full(param, weights[name])
            if ema:
                saved = [tensors.get(EMA_PREFIX + name) for name in named]
                if all(t is not None for t in saved):
                    for shadow, value in zip(ema.shadow_params, saved):
                        load_full(shadow, value)
                    ema.optimization_step = state["ema_updates"]
                else:
                    accelerator.print("difftune: the checkpoint has no EMA; the EMA starts from the resumed weights")
                    ema.shadow_params = [param.detach().clone() for param in named.values()]
        guard.load_state_dict(state["guard"])
        if best and state.get("best"):
            best.load_state_dict(state["best"])
        accelerator.load_state(str(path / "accelerate"))
        progress = Progress(**state["progress"])
        accelerator.print(f"difftune: resumed from {path} at step {progress.global_step}")
        return progress


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """Checkpoints with their completion marker, oldest first."""
    folder = Path(output_dir) / CHECKPOINTS_DIR
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("step-*") if (p / MARKER).is_file())


def find_checkpoint(output_dir: Path, resume: str) -> Path | None:
    """`auto`: the latest complete checkpoint of output_dir (None if there is none); else the given folder."""
    if resume == "auto":
        found = complete_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / MARKER).is_file():
        raise DifftuneError(f"--resume {path}: not a complete checkpoint (no {MARKER} marker); use --resume auto")
    return path


def _keys(section: str) -> set[str]:
    return set(Config.model_fields[section].annotation.model_fields)


# Settings a resumed run must share with the checkpoint: anything else would make it another run. The
# per-process batch size may change with the process count, as long as the global batch stays the same.
LOCKED = {
    "model": _keys("model"),
    "data": _keys("data") - {"num_workers"},
    "adapter": _keys("adapter"),
    "train": {"gradient_accumulation_steps", "seed"},
    "optim": {"optimizer"},
    "prior": _keys("prior") - {"loss_weight", "batch_size"},  # which class images, and so the data order
}


def check_resumable(saved_toml: str, config: Config, saved_processes: int, num_processes: int, print_fn=print) -> None:
    """Fail naming every setting that makes resuming meaningless; log the changes that are safe."""
    saved, current = tomllib.loads(saved_toml), tomllib.loads(config.to_toml())
    # Checkpoints written before paths were recorded absolute hold them relative to the working directory, and
    # those written before families existed name none (they were SD's).
    resolve_path_values(saved, Path.cwd())
    saved.setdefault("model", {}).setdefault("family", "sd")
    locked, changed = [], []
    for section in sorted(set(saved) | set(current)):
        old, new = saved.get(section, {}), current.get(section, {})
        for key in sorted(set(old) | set(new)):
            if old.get(key) == new.get(key):
                continue
            is_locked = key in LOCKED.get(section, ())
            (locked if is_locked else changed).append(f"{section}.{key}: {old.get(key)!r} -> {new.get(key)!r}")
    saved_batch, batch = saved["train"]["batch_size"] * saved_processes, config.train.batch_size * num_processes
    if saved_batch != batch:
        locked.append(f"global batch (train.batch_size x processes): {saved_batch} -> {batch}")
    if locked:
        raise DifftuneError(
            "cannot resume: these settings differ from the checkpoint's and would make it another run:\n  "
            + "\n  ".join(locked)
            + "\nStart a new run (another train.output_dir), or restore them."
        )
    for line in changed:
        print_fn(f"difftune: resuming with a changed setting: {line}")


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    _fsync_dir(path.parent)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as file:
                os.fsync(file.fileno())
    for folder in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        _fsync_dir(folder)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
