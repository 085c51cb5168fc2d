"""Writing what training produced, in formats other tools load.

The adapter file is one safetensors file in the layout diffusers' `load_lora_weights` reads: peft
keys prefixed `unet.` / `text_encoder.`, each part's peft `LoraConfig` under the metadata key
`lora_adapter_metadata` (so rank, alpha and DoRA are read, not guessed from shapes), and the
resolved difftune config under `difftune_config`. Weights are kept in fp32: lossless, and small.
"""

from __future__ import annotations

import json
from pathlib import Path

from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY, LORA_WEIGHT_NAME_SAFE
from safetensors.torch import save_file

from difftune.adapters import adapter_state_dict
from difftune.config import Config
from difftune.models import Components, assemble_pipeline
from difftune.sample import sampling_scheduler

ADAPTER_FILE = LORA_WEIGHT_NAME_SAFE  # the name `pipeline.load_lora_weights(output_dir)` looks for
FULL_MODEL_DIR = "model"
CONFIG_METADATA_KEY = "difftune_config"


def save_trained(components: Components, config: Config, output_dir: Path) -> Path:
    """The adapter file, or with `adapter.kind = "none"` a complete diffusers pipeline folder."""
    if config.adapter.kind == "none":
        path = output_dir / FULL_MODEL_DIR
        pipeline = assemble_pipeline(components, sampling_scheduler(config.sample.scheduler, components))
        pipeline.save_pretrained(path, safe_serialization=True)
        return path
    tensors, lora_configs = adapter_state_dict(components, config.adapter)
    metadata = {
        "format": "pt",
        LORA_ADAPTER_METADATA_KEY: json.dumps(lora_configs, sort_keys=True),
        CONFIG_METADATA_KEY: config.to_toml(),
    }
    path = output_dir / ADAPTER_FILE
    save_file(tensors, path, metadata=metadata)
    return path
