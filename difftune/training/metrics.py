"""One JSON line per optimizer step in `metrics.jsonl`, mirrored to accelerate's trackers (TensorBoard)."""

from __future__ import annotations

import json
from pathlib import Path

from difftune.owned_files import open_append, write_file

METRICS_FILE = "metrics.jsonl"
RUN_FOLDER = "train.output_dir"  # how messages name the folder the run writes


def keep_lines_up_to_step(path: Path, step: int) -> None:
    """Drop the JSONL lines of steps after `step` (all of them for 0): a resumed run rewrites those steps. A link in
    its place is not the run's file: it goes, unread."""
    if path.is_symlink():
        path.unlink()
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text(encoding="utf-8").splitlines()
        if line.strip() and json.loads(line)["step"] <= step
    ]
    write_file(path, "".join(line + "\n" for line in kept), RUN_FOLDER, ours=False)


class MetricsLog:
    def __init__(self, output_dir: Path, accelerator, resumed_at_step: int = 0):
        self.accelerator = accelerator
        self.path, self.file = Path(output_dir) / METRICS_FILE, None
        if accelerator.is_main_process:
            keep_lines_up_to_step(self.path, resumed_at_step)
            self.file = open_append(self.path, RUN_FOLDER)

    def rewind(self, step: int) -> None:
        """Forget the lines after `step` (a rollback redoes those steps)."""
        if self.file:
            self.file.close()
            keep_lines_up_to_step(self.path, step)
            self.file = open_append(self.path, RUN_FOLDER)

    def write(self, step: int, values: dict[str, float]) -> None:
        if self.file:
            # A line per step, flushed, so a crash loses at most the step being written.
            self.file.write(json.dumps({"step": step, **values}) + "\n")
            self.file.flush()
        self.accelerator.log(values, step=step)

    def close(self) -> None:
        if self.file:
            self.file.close()


def read_metrics(output_dir: Path) -> list[dict]:
    path = Path(output_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
