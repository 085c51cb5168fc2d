"""Skipping optimizer steps that would damage the run: NaN/inf, and spikes against a running mean.

The loop asks `Guard.judge` once per optimizer step, after gradients are complete and before the
optimizer steps; on a skip it steps neither the optimizer nor the EMA, so parameters and optimizer
state stay bit-identical. Every process judges the same (process-averaged) loss and the same
(all-reduced) gradient norm, so all of them skip together.
"""

from __future__ import annotations

import json
import math
from collections import deque
from pathlib import Path

from difftune.config import GuardConfig
from difftune.errors import DifftuneError
from difftune.owned_files import open_append
from difftune.training.metrics import RUN_FOLDER, keep_lines_up_to_step

SKIPPED_FILE = "skipped_steps.jsonl"
# Activation records are sparse (every `log.activations_every_steps`): a short window of them, judged once a few exist.
ACTIVATION_WINDOW = 8
ACTIVATION_WARMUP = 3


class Guard:
    def __init__(self, config: GuardConfig, output_dir: Path | None):
        self.config = config
        self.log_path = output_dir / SKIPPED_FILE if output_dir else None
        # Running means over the last accepted steps (a window, so one old outlier ages out).
        self.losses: deque[float] = deque(maxlen=config.spike_warmup_steps)
        self.grad_norms: deque[float] = deque(maxlen=config.spike_warmup_steps)
        self.consecutive = 0
        self.skipped = 0
        self.rollbacks = 0
        self.activation_maxima: dict[str, deque[float]] = {}  # block -> its last recorded largest outputs

    def start_at(self, step: int) -> None:
        """A fresh run (step 0) starts a fresh list of skips; a resumed one keeps what happened up to its checkpoint."""
        if self.log_path:
            keep_lines_up_to_step(self.log_path, step)

    def judge(self, step: int, loss: float, grad_norm: float, grad_overflow_is_expected: bool = False) -> str | None:
        """The reason to skip this step, or None to apply it.

        `grad_overflow_is_expected`: under fp16 loss scaling an inf gradient means the scale was too high; the
        scaler skips that update and lowers the scale itself, so it is not a fault here.
        """
        if not self.config.enabled:
            return None
        reason = None
        if not math.isfinite(loss):
            reason = "non-finite loss"
        elif not math.isfinite(grad_norm) and not grad_overflow_is_expected:
            reason = "non-finite gradient norm"
        elif self.config.spike_factor and len(self.losses) == self.losses.maxlen:
            if loss > self.config.spike_factor * _mean(self.losses):
                reason = f"loss spike ({loss:.4g} > {self.config.spike_factor:g} x mean {_mean(self.losses):.4g})"
            elif grad_norm > self.config.spike_factor * _mean(self.grad_norms):
                reason = (
                    f"gradient-norm spike ({grad_norm:.4g} > {self.config.spike_factor:g} x mean "
                    f"{_mean(self.grad_norms):.4g})"
                )
        if reason is None:
            self.consecutive = 0
            if math.isfinite(grad_norm):
                self.losses.append(loss)
                self.grad_norms.append(grad_norm)
        else:
            self.consecutive += 1
            self.skipped += 1
        return reason

    def watch_activations(self, maxima: dict[str, float]) -> list[str]:
        """Warnings for blocks whose largest output is non-finite or over `activation_spike_factor` times its
        running mean. A warning, not a skip: growing activations precede a divergence by many steps, and the
        step itself may still be sound."""
        factor, warnings = self.config.activation_spike_factor, []
        for name, value in maxima.items():
            history = self.activation_maxima.setdefault(name, deque(maxlen=ACTIVATION_WINDOW))
            if not math.isfinite(value):
                warnings.append(f"block {name} output a non-finite value")
                continue
            if factor and len(history) >= ACTIVATION_WARMUP and value > factor * _mean(history):
                warnings.append(
                    f"block {name}'s largest output {value:.4g} is over {factor:g} x its running mean "
                    f"{_mean(history):.4g} "
                    "(activations growing: lower optim.learning_rate or watch for a divergence)"
                )
            history.append(value)
        return warnings

    def state_dict(self) -> dict:
        return {
            "losses": list(self.losses),
            "grad_norms": list(self.grad_norms),
            "consecutive": self.consecutive,
            "skipped": self.skipped,
            "rollbacks": self.rollbacks,
            "activation_maxima": {name: list(values) for name, values in self.activation_maxima.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.losses.clear()
        self.losses.extend(state["losses"])
        self.grad_norms.clear()
        self.grad_norms.extend(state["grad_norms"])
        self.consecutive, self.skipped, self.rollbacks = state["consecutive"], state["skipped"], state["rollbacks"]
        # Checkpoints written before activation monitoring hold no maxima.
        self.activation_maxima = {
            name: deque(values, maxlen=ACTIVATION_WINDOW) for name, values in state.get("activation_maxima", {}).items()
        }

    def record(self, step: int, reason: str, loss: float, grad_norm: float, paths: list[str]) -> None:
        """Append the skip to skipped_steps.jsonl."""
        if self.log_path:
            with open_append(self.log_path, RUN_FOLDER) as file:
                record = {
                    "step": step,
                    "reason": reason,
                    "loss": _json_number(loss),
                    "grad_norm": _json_number(grad_norm),
                }
                file.write(json.dumps({**record, "images": paths}) + "\n")

    def divergence(self, loss: float) -> str | None:
        """Why the run has diverged (too many skips in a row, or a loss over the hard limit), or None."""
        if not self.config.enabled:
            return None
        if self.consecutive >= self.config.max_consecutive_skips:
            return f"{self.consecutive} optimizer steps in a row were skipped"
        if self.config.max_loss and loss > self.config.max_loss:
            return f"loss {loss:.4g} is above guard.max_loss = {self.config.max_loss:g}"
        return None

    def stop(self, step: int, why: str) -> DifftuneError:
        return DifftuneError(
            f"stopped at step {step}: {why}; see {SKIPPED_FILE}. Lower optim.learning_rate, check the listed images, "
            f"set guard.rollback = true, or raise guard.max_consecutive_skips. Nothing from this step on was saved."
        )


def _mean(values) -> float:
    return sum(values) / len(values)


def _json_number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)
