"""Two machines of two processes each, played on one machine: the shipped multi-node configs, torch's static
rendezvous on loopback, gloo. 2 x 2 processes at batch 2 reading tar shards train like one process at batch 8 reading
the same images in their folder, each "machine" with a cache folder of its own (as on machines' local disks)."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from difftune.training.metrics import read_metrics

from conftest import REPO, free_port
from test_sources import write_shards

COMMON = [
    "--config",
    "configs/tiny_lora.toml",
    "sample.prompts=[]",
    "sample.before=false",
    "log.progress_bar=false",
    "data.num_workers=0",
    "adapter.text_encoder=false",
    "train.max_steps=4",
]


def _two_machines(kind: str, out, tmp_path) -> list[str]:
    """Both machines' commands run together; returns their outputs."""
    port, env = free_port(), {**os.environ, "HF_HUB_OFFLINE": "1", "ACCELERATE_USE_CPU": "true"}
    shards = write_shards(REPO / "examples" / "purple", tmp_path / "shards", per_shard=5)
    processes = []
    for rank in (0, 1):
        if kind == "ddp":  # accelerate's own launcher reads the shipped config, as on real machines
            launcher = [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                "configs/accelerate/multi_node_ddp.yaml",
                "--machine_rank",
                str(rank),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                str(port),
                "--num_processes",
                "4",
                "--mixed_precision",
                "no",
                "scripts/train.py",
            ]
        # accelerate enables FSDP on accelerator devices only: tests/fsdp_cpu_launch.py switches it on (see there)
        else:
            launcher = [
                shutil.which("torchrun") or "torchrun",
                "--nnodes=2",
                f"--node_rank={rank}",
                "--nproc_per_node=2",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                "tests/fsdp_cpu_launch.py",
                "train",
            ]
            env["DIFFTUNE_FSDP_CONFIG"] = str(REPO / "configs/accelerate/multi_node_fsdp.yaml")
        command = [
            *launcher,
            *COMMON,
            f"train.output_dir={out}",
            "train.batch_size=2",
            f"cache.dir={tmp_path / f'cache{rank}'}",
            f"data.path={shards}",
        ]
        processes.append(
            subprocess.Popen(
                command, cwd=REPO, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outputs = [process.communicate(timeout=600) for process in processes]
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, stderr[-4000:]
    return [stdout for stdout, _ in outputs]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    run = subprocess.run(
        [
            sys.executable,
            "scripts/train.py",
            *COMMON,
            f"train.output_dir={out / 'run'}",
            "train.batch_size=8",
            f"cache.dir={out / 'cache'}",
        ],
        cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_two_machines_of_two_processes_train_like_one_process(kind, one_process, tmp_path):
    outputs = _two_machines(kind, tmp_path / "run", tmp_path)
    assert "4 process(es)" in outputs[0]
    assert [row["loss"] for row in read_metrics(tmp_path / "run")] == pytest.approx(
        [row["loss"] for row in read_metrics(one_process / "run")], rel=1e-5
    )
    expected = load_file(one_process / "run" / "pytorch_lora_weights.safetensors")
    trained = load_file(tmp_path / "run" / "pytorch_lora_weights.safetensors")
    assert trained.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(trained[key], value, rtol=0, atol=1e-6, msg=key)
    # Each machine's cache folder holds every entry (the second round filled what the first left on the other
    # machine; a shard member's entry is its image file's) and the scan's index its first process wrote.
    for rank in (0, 1):
        assert sorted(p.name for p in (tmp_path / f"cache{rank}").rglob("*.safetensors")) == sorted(
            p.name for p in (one_process / "cache").rglob("*.safetensors")
        )
        assert len(list((tmp_path / f"cache{rank}" / "scans").iterdir())) == 1
