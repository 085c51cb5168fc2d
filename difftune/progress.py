"""What a long step is doing while it does it: a line as it starts and its time as it ends (`phase`), and a bar
over its items (`bar`), as every other trainer shows them; nothing with `log.quiet` (`--quiet`).

Lines go where the run's other lines go (`say`: the main process's print); bars to stderr, and only on a terminal
(tqdm's `disable=None`), so a log file holds the lines without a bar's thousand redraws. The training bar is the
exception, kept in logs as before: the UI reads a job's progress from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from tqdm.auto import tqdm


def seconds_said(seconds: float) -> str:
    """`4.2 s`, `3 min 05 s`, `1 h 02 min`."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {rest:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


@contextmanager
def phase(what: str, say: Callable[[str], None] | None) -> Iterator[None]:
    """`difftune: {what} ...` now, and `difftune: {what}: done in 4.2 s` when the block ends; `say` None: quiet."""
    if say is None:
        yield
        return
    say(f"difftune: {what} ...")
    started = time.perf_counter()
    yield
    say(f"difftune: {what}: done in {seconds_said(time.perf_counter() - started)}")


def bar(items: Iterable, what: str, quiet: bool, total: int | None = None) -> tqdm:
    """A bar over `items` on a terminal, none in a log file or when quiet."""
    return tqdm(items, desc=what, total=total, disable=True if quiet else None, leave=False)
