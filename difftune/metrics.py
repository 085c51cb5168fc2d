"""One JSON line per optimizer step in `metrics.jsonl`, mirrored to accelerate's trackers (TensorBoard)."""

from __future__ import annotations

import json
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    def __init__(self, output_dir: Path, accelerator):
        self.accelerator = accelerator
        self.file = open(output_dir / METRICS_FILE, "w", encoding="utf-8") if accelerator.is_main_process else None

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
