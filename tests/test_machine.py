"""The UI's machine panel: the host's RAM, CPU and disk as psutil and the file system say them, and a job's planned
peaks beside the peaks its phases measured."""

import shutil
import time

import psutil

from difftune.config import load_config
from difftune.training.plan import PLAN_FILE
from difftune.webui import jobs, machine

from conftest import REPO


def test_the_machine_state_is_the_hosts(tmp_path):
    state = machine.machine_state(tmp_path)
    assert state["ram_total"] == psutil.virtual_memory().total
    assert 0 < state["ram_used"] < state["ram_total"]
    assert abs(state["disk_free"] - shutil.disk_usage(tmp_path).free) < 2**30  # others write meanwhile
    line = machine.machine_line(state)
    assert line.startswith("CPU ") and "RAM " in line and "free for jobs" in line


def test_a_jobs_planned_peaks_stand_beside_its_measured_ones(tmp_path):
    config = load_config(
        REPO / "configs" / "tiny_lora.toml", ["train.max_steps=2", "sample.prompts=[]", "log.progress_bar=false"]
    )
    job = jobs.launch_job(config, tmp_path, "measured")
    deadline, resident = time.monotonic() + 180, []
    while job.is_running() and time.monotonic() < deadline:
        resident.append(machine.job_memory(job)["resident_now"])  # its trainer's, while it runs
        time.sleep(0.5)
    assert job.status() == "finished" and (job.dir / PLAN_FILE).is_file()
    assert any(size and size > 100 * 2**20 for size in resident)
    memory = machine.job_memory(job)
    assert memory["resident_now"] is None  # it runs no more
    measured = memory["measured_phases"]
    assert "training" in measured and max(measured.values()) > 100 * 2**20
    # The plan predicted the host's peak of this run within a factor of two (the tiny base: mostly Python itself).
    assert 0.5 < memory["planned_host"] / max(measured.values()) < 2
    lines = machine.job_memory_lines(memory)
    assert lines[0].startswith("host RAM: planned peak") and "measured so far" in lines[0]
