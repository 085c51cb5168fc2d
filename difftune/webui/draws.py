"""The samples a job drew, draw by draw (the Train tab's gallery across steps): the base's before training
(`samples/before/`), each `sample.every_steps` or "sample now" draw (`samples/step-N/`), the trained result's
(`samples/`) and its EMA weights' (`samples_ema/`); each file with the prompt it was drawn from, as the file itself
records it (a PNG's text chunk, a clip's metadata)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from difftune.webui.jobs import SAMPLE_CLIPS, Job, own_file

_STEP = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class Draw:
    label: str  # "before training", "step 20", "trained", "trained (EMA)"
    folder: Path
    order: tuple[int, int]  # before, steps in order, then the results

    def files(self, job: Job) -> list[Path]:
        """The drawn images and clips (not the grid), in prompt order; only the job's own files."""
        found = [path for pattern in ("[0-9][0-9][0-9].png", *SAMPLE_CLIPS) for path in self.folder.glob(pattern)]
        return sorted(path for path in found if own_file(job, path))


def draws(job: Job) -> list[Draw]:
    """Every draw the job made that left files, in the order it made them."""
    found = []
    for folder in (job.dir / "samples", *sorted((job.dir / "samples").glob("*")), job.dir / "samples_ema"):
        if not folder.is_dir() or folder.is_symlink():
            continue
        step = _STEP.fullmatch(folder.name)
        if folder.name == "before":
            draw = Draw("before training", folder, (0, 0))
        elif step:
            draw = Draw(f"step {int(step.group(1))}", folder, (1, int(step.group(1))))
        elif folder.name == "samples":
            draw = Draw("trained", folder, (2, 0))
        elif folder.name == "samples_ema":
            draw = Draw("trained (EMA)", folder, (2, 1))
        else:
            continue
        if draw.files(job):
            found.append(draw)
    return sorted(found, key=lambda draw: draw.order)


def drawn_prompt(path: Path) -> str:
    """The prompt a sample file says it was drawn from (`drawing.sample_tags`), or "" where it says none."""
    if path.suffix == ".mp4":
        try:
            import av

            with av.open(str(path)) as container:
                return container.metadata.get("prompt", "")
        except (ImportError, OSError):
            return ""
    with Image.open(path) as image:
        if path.suffix == ".png":
            return image.text.get("prompt", "")
        said = image.getexif().get(0x010E, "")  # an animated WebP's "name: text" lines
    return next((line.removeprefix("prompt: ") for line in said.splitlines() if line.startswith("prompt: ")), "")
