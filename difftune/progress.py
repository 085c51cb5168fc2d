"""What a long step is doing while it does it: a line as it starts and its time and memory peak as it ends
(`phase`), and a bar over its items (`bar`), as every other trainer shows them; nothing with `log.quiet` (`--quiet`).

A phase's host peak is the process's resident set at its highest during the phase (Linux: the kernel's high-water
mark, reset as the phase starts), so each phase of a run says what it needed of the machine's RAM: the number a
user with 32 GB compares, and the one `difftune plan` predicts per phase. With CUDA in use, the device's too.

Lines go where the run's other lines go (`print_status`: the main process's print); bars to stderr, and only on a
terminal (tqdm's `disable=None`), so a log file holds the lines without a bar's thousand redraws. The training bar is
the exception, kept in logs as before: the UI reads a job's progress from it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm.auto import tqdm


def seconds_said(seconds: float) -> str:
    """`4.2 s`, `3 min 05 s`, `1 h 02 min`."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {rest:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def bytes_said(size: int) -> str:
    """`812 MiB`, `5.1 GiB`."""
    return f"{size / 2**20:.0f} MiB" if size < 2**30 else f"{size / 2**30:.1f} GiB"


@contextmanager
def phase(what: str, print_status: Callable[[str], None] | None) -> Iterator[None]:
    """`difftune: {what} ...` now, and `difftune: {what}: done in 4.2 s` when the block ends (`print_status` prints a
    line; None: quiet)."""
    if print_status is None:
        yield
        return
    print_status(f"difftune: {what} ...")
    sys.stdout.flush()  # a log file's lines as they happen, not when a buffer fills
    started = time.perf_counter()
    _reset_peaks()
    yield
    peaks = "".join(f", {where} peak {bytes_said(size)}" for where, size in peak_memory().items())
    print_status(f"difftune: {what}: done in {seconds_said(time.perf_counter() - started)}{peaks}")
    sys.stdout.flush()


def _reset_peaks() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux 4.0+)
    except OSError:
        pass  # another system, or not allowed: the peak is then the process's so far
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def process_status_bytes(field: str) -> int:
    """A `kB` line of this process's /proc status (`VmRSS`, `VmHWM`) in bytes; 0 where there is none (not Linux)."""
    status = Path("/proc/self/status")
    if not status.exists():
        return 0
    line = next((line for line in status.read_text().splitlines() if line.startswith(f"{field}:")), "")
    return int(line.split()[1]) * 1024 if line else 0


def peak_memory() -> dict[str, int]:
    """Bytes at the highest since the last reset: `host` (resident set, Linux) and `device` (CUDA, when in use)."""
    peaks = {"host": host} if (host := process_status_bytes("VmHWM")) else {}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        peaks["device"] = torch.cuda.max_memory_allocated()
    return peaks


def bar(items: Iterable, what: str, quiet: bool, total: int | None = None) -> tqdm:
    """A bar over `items` on a terminal, none in a log file or when quiet."""
    return tqdm(items, desc=what, total=total, disable=True if quiet else None, leave=False)
