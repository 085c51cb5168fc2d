"""A training run: its setup, its loop and everything that watches, stops, saves and resumes it.

`train` (setup, the step, the loop, the end of the run), `resolved` (a run's settings decided once, before anything
loads), `optim`, `ema`, `guard` (non-finite losses, spikes),
`checkpoint` (exact resume), `validation`, `metrics`, `output_lock`, `prior` (class images for prior preservation),
`training_adapter`, `activations` (per-block statistics), `parity` (the saved files redrawn), `finders` (batch size
and learning rate), `preflight` (the checks before anything loads) and `plan` (a job's host and device peaks,
predicted before it starts).

May import every library layer below it (adapters, families, data, memory, config). Never `toy/`: a judge of samples
is registered by whoever has one (`validation.register_judge`).
"""
