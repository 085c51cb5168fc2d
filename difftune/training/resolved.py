"""A run's settings decided once, before anything loads: the family, the gradient accumulation its processes need,
the offloaded blocks its budget allows, the data settings its family reads with, and the dtypes it keeps each part in.
Training sets up by them and the resolved config it writes records them; the memory plan and the parity check read the
same dtypes (models/dtypes.py)."""

from __future__ import annotations

from dataclasses import dataclass

from difftune.config import Config
from difftune.errors import DifftuneError
from difftune.families import family_of
from difftune.families.common.family import Family
from difftune.models.dtypes import RunDtypes, run_dtypes
from difftune.training.plan import with_offload_budget


@dataclass(frozen=True)
class ResolvedRun:
    """What `resolve` decided."""

    # As the run reads it: accumulation for its processes, the offload budget as blocks, the family named and the data
    # settings it reads with (a file written from it says what was trained)
    config: Config
    family: Family
    dtypes: RunDtypes
    offload_budget: str  # the `model.offload_budget` the blocks were planned for ("": none)


def resolve(config: Config, num_processes: int) -> ResolvedRun:
    """`config` decided for a run of `num_processes` processes (each process decides alike)."""
    config = with_accumulation(config, num_processes)
    budget = config.model.offload_budget
    config = with_offload_budget(config)
    family = family_of(config.model)
    config = config.model_copy(
        update={
            "model": config.model.model_copy(update={"family": family.name}),
            "data": family.conditioning.data_settings(config.data),
        }
    )
    return ResolvedRun(config, family, run_dtypes(config), budget)


def with_accumulation(config: Config, num_processes: int) -> Config:
    """`train.global_batch_size`, when set, turns into the accumulation steps that reach it with this many
    processes; the result says what runs (its global_batch_size is 0 again, so the saved config re-runs)."""
    train_config, target = config.train, config.train.global_batch_size
    if not target:
        return config
    per_step = train_config.batch_size * num_processes
    if target % per_step:
        raise DifftuneError(
            f"train.global_batch_size {target} is not a multiple of train.batch_size {train_config.batch_size} x "
            f"{num_processes} process(es) = {per_step}; change either, or set gradient_accumulation_steps instead"
        )
    train_config = train_config.model_copy(
        update={"gradient_accumulation_steps": target // per_step, "global_batch_size": 0}
    )
    return config.model_copy(update={"train": train_config})
