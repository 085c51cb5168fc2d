"""Train a job: `accelerate launch scripts/train.py --config configs/tiny_lora.toml [section.key=value ...]`.

The same as `difftune train`; this file only exists so that `accelerate launch` has a script to run.
"""

import sys

from difftune.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
