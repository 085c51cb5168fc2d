"""The machine the jobs run on, as the UI shows it: device memory and how busy each GPU is, host RAM and CPU, the disk
free under the jobs folder; and for a job, its memory plan's peaks beside the peaks it measured.

GPUs are read through NVML where the `nvidia-ml-py` package is installed (memory, utilisation and each process's
memory, whoever holds it), else through torch (this process's view of each device's free memory; no utilisation).
A job's measured host peaks are the ones its phases print (`progress.phase`: "done in 4.2 s, host peak 3.1 GiB"),
read from its log, and its trainer's resident set now; its plan is the `plan.json` the run wrote (`plan.check_fits`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import psutil

from difftune.progress import bytes_said
from difftune.training.plan import PLAN_FILE
from difftune.webui import jobs

# A phase's last line (`progress.phase`): what it was, and the peaks it measured.
PHASE_DONE = re.compile(r"^difftune: (?P<phase>.+?): done in [^,]+(?:, host peak (?P<host>[\d.]+ [MG]iB))?")
UNITS = {"MiB": 2**20, "GiB": 2**30}


def machine_state(jobs_dir: Path) -> dict:
    """CPU use (percent since the last call), host RAM used and total, disk free under `jobs_dir`, and each GPU's
    memory used and total (and utilisation, where NVML says it)."""
    memory = psutil.virtual_memory()
    return {
        "cpu_percent": psutil.cpu_percent(interval=None),
        "ram_used": memory.total - memory.available,
        "ram_total": memory.total,
        "disk_free": shutil.disk_usage(Path(jobs_dir) if Path(jobs_dir).exists() else Path.cwd()).free,
        "gpus": _gpus(),
    }


def _gpus() -> list[dict]:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML package or no driver: torch's view, or none
        return _torch_gpus()
    gpus = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        busy = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
        gpus.append({"device": f"cuda:{index}", "used": memory.used, "total": memory.total, "utilisation": busy})
    return gpus


def _torch_gpus() -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        gpus.append({"device": f"cuda:{index}", "used": total - free, "total": total, "utilisation": None})
    return gpus


def machine_line(state: dict) -> str:
    """The state in one line: `CPU 37% · RAM 9.1 GiB / 24.0 GiB · 53.0 GiB free for jobs · cuda:0 10.2 / 139.8 GiB,
    97% busy`."""
    parts = [
        f"CPU {state['cpu_percent']:.0f}%",
        f"RAM {bytes_said(state['ram_used'])} / {bytes_said(state['ram_total'])}",
        f"{bytes_said(state['disk_free'])} free for jobs",
    ]
    for gpu in state["gpus"]:
        busy = f", {gpu['utilisation']}% busy" if gpu["utilisation"] is not None else ""
        parts.append(f"{gpu['device']} {bytes_said(gpu['used'])} / {bytes_said(gpu['total'])}{busy}")
    return " · ".join(parts)


def job_memory(job: jobs.Job) -> dict:
    """A job's planned peaks (None where it wrote no plan), the host peak each finished phase measured, and its
    trainer's resident set now (None when it runs no more)."""
    plan_file = job.dir / PLAN_FILE
    plan = json.loads(plan_file.read_text(encoding="utf-8")) if jobs.own_file(job, plan_file) else None
    measured = {}
    for line in jobs.log_tail(job, max_chars=200_000).splitlines():
        found = PHASE_DONE.match(line)
        if found and found["host"]:
            size, unit = found["host"].split()
            measured[found["phase"]] = round(float(size) * UNITS[unit])
    process = job.process()
    try:
        resident = process.memory_info().rss if process is not None else None
    except psutil.Error:
        resident = None
    return {
        "planned_host": sum(plan["host"].values()) if plan else None,
        "planned_device": sum(plan["device"].values()) if plan and plan["device_type"] == "cuda" else None,
        "planned_phases": {name: sum(held.values()) for name, held in plan["host_phases"].items()} if plan else {},
        "measured_phases": measured,
        "resident_now": resident,
    }


def job_memory_lines(memory: dict) -> list[str]:
    """What the UI says of a job's memory: the plan's host (and device) peak beside the highest measured so far."""
    lines = []
    measured = max(memory["measured_phases"].values(), default=None)
    if memory["planned_host"] is not None:
        highest = f"; measured so far {bytes_said(measured)}" if measured else ""
        lines.append(f"host RAM: planned peak {bytes_said(memory['planned_host'])}{highest}")
    elif measured:
        lines.append(f"host RAM: measured peak so far {bytes_said(measured)} (no plan written)")
    if memory["planned_device"] is not None:
        lines.append(f"device: planned peak {bytes_said(memory['planned_device'])}")
    if memory["resident_now"] is not None:
        lines.append(f"trainer's resident set now {bytes_said(memory['resident_now'])}")
    return lines
