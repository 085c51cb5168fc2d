"""What a running job is asked between two steps: to stop (SIGTERM or SIGINT: the UI's stop button, Ctrl-C, a
cluster's preemption notice), and through files in its folder to draw its sample prompts now or save now (the UI's
"Sample now" and "Save now", `difftune request`), never by stopping it.

A request file is `<output_dir>/requests/<what>`: written by whoever asks, seen by the main process at a step boundary
within a second and removed as it is answered. Every process answers alike at the same step (a signal on any process,
a file seen by the main one): one small collective a step carries them all where there are several processes.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from pathlib import Path

from difftune.errors import DifftuneError
from difftune.owned_files import remove, touch_file
from difftune.training.output_lock import is_held

REQUESTS_DIR = "requests"
REQUESTS_SETTING = "the run's requests folder"  # how messages name it
ASKED = ("sample", "save")  # what a request file may ask, by its name


def ask(output_dir: Path, what: str) -> Path:
    """Ask the job writing `output_dir` to `what` ("sample": draw the sample prompts; "save": write a checkpoint and
    a snapshot of the result) at its next step boundary; the request's file."""
    if what not in ASKED:
        raise DifftuneError(f"{what!r}: a running job can be asked to {' or '.join(ASKED)}")
    if not is_held(output_dir):
        raise DifftuneError(
            f"{output_dir}: no run is training there now (none holds the folder), so none would answer; a request "
            "left for a later run would fire when it resumes"
        )
    path = Path(output_dir) / REQUESTS_DIR / what
    try:
        touch_file(path, REQUESTS_SETTING)
    except PermissionError:
        raise DifftuneError(f"{path.parent}: not writable by this user; ask as the user the run trains as") from None
    return path


class RunRequests:
    """A run's requests while it trains (the loop holds one): a signal asks it to stop after the current step with a
    checkpoint (a second signal gets the default behaviour at once); request files ask for samples or a save."""

    MESSAGE = "difftune: stopped at step"  # how train's log says it honoured a stop; the UI's jobs read it

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    LOOK_EVERY_S = 1.0

    def __init__(self, output_dir: Path, main: bool, print_status=print):
        self.folder = Path(output_dir) / REQUESTS_DIR
        self.main = main  # the process that reads the request files
        self.requested = False
        self._looked_at = -math.inf  # when the request files were last looked for: the first step looks
        if main:  # asked of a run that has ended: not this one's to answer (a resume would have answered it)
            for what in ASKED:
                if (self.folder / what).is_file():
                    remove(self.folder / what, REQUESTS_SETTING)
                    print_status(
                        f"difftune: a request to {what} left from before this run is dropped (ask again to have it)"
                    )
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # Python installs handlers there only
            self._previous = {sig: signal.signal(sig, self._request) for sig in self.SIGNALS}

    def _request(self, signum, frame) -> None:
        if self.requested:
            self.restore()
            signal.raise_signal(signum)
        self.requested = True

    def agreed(self, accelerator, early_stop: bool = False) -> tuple[str | None, set[str]]:
        """Why every process stops now ("request": a signal on any process; "early_stop": `early_stop` on any, the
        main process validates; None to go on), and what the request files ask (`ASKED`'s names, their files
        removed; looked for at most once a second). One collective across processes; none for a single process,
        which need not read the device (a read makes the host wait for the device)."""
        looks = self._time_to_look()
        files = [looks and (self.folder / what).is_file() for what in ASKED]
        flags = [float(self.requested), float(early_stop), *map(float, files)]
        if accelerator.num_processes > 1:
            # here: `difftune request` asks through this module, and starts in a blink without torch
            import torch

            from difftune.memory.transfer import to_device

            flags = accelerator.reduce(to_device(torch.tensor(flags), accelerator.device), reduction="sum").tolist()
        requested, early, *asked = flags
        for what, seen in zip(ASKED, files, strict=True):
            if seen:
                remove(self.folder / what, REQUESTS_SETTING)
        reason = "request" if requested else "early_stop" if early else None
        return reason, {what for what, count in zip(ASKED, asked, strict=True) if count}

    def _time_to_look(self) -> bool:
        """Whether the main process looks for request files now: at most once every `LOOK_EVERY_S` seconds, so a fast
        step (a 64 px tiny job's 30 ms) makes no filesystem call, and a person's click is still answered in a second."""
        now = time.monotonic()
        if not self.main or now - self._looked_at < self.LOOK_EVERY_S:
            return False
        self._looked_at = now
        return True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> RunRequests:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
