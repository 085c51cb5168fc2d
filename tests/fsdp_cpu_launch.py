"""The difftune CLI under accelerate's FSDP2 on CPU processes (gloo), for the tests:

    ACCELERATE_USE_CPU=true torchrun --nproc_per_node 2 tests/fsdp_cpu_launch.py train --config ...

accelerate turns FSDP on only for accelerator devices: on a CPU-only machine its state stays MULTI_CPU even
with an FSDP config, while torch's FSDP2 itself runs on CPU over gloo. This launcher lets accelerate set up
the processes, then switches its state to FSDP with the plugin that the shipped configs/accelerate/fsdp.yaml
describes (its `fsdp_config`, passed as the FSDP_* environment `accelerate launch` would set), so
accelerate's own FSDP2 code runs: fully_shard, the optimizer's switch to sharded parameters, clipping, and
save_state/load_state.
"""

import os
import sys
from pathlib import Path

import yaml
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from difftune.cli import main

# The shipped config whose fsdp_config it applies; the multi-node tests name configs/accelerate/multi_node_fsdp.yaml.
FSDP_CONFIG = Path(
    os.environ.get("DIFFTUNE_FSDP_CONFIG", Path(__file__).resolve().parents[1] / "configs/accelerate/fsdp.yaml")
)

_accelerator_state_init = AcceleratorState.__init__


def _init_sharded(self, *args, **kwargs):
    _accelerator_state_init(self, *args, **kwargs)
    if self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = FullyShardedDataParallelPlugin()


if __name__ == "__main__":
    for key, value in yaml.safe_load(FSDP_CONFIG.read_text())["fsdp_config"].items():
        os.environ["FSDP_" + key.removeprefix("fsdp_").upper()] = (
            str(value).lower() if isinstance(value, bool) else str(value)
        )
    AcceleratorState.__init__ = _init_sharded
    sys.exit(main())
