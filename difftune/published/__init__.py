"""The configs of the bases people train, kept in the package, so `difftune plan` can answer "does it fit?" before
a 50 GB download, offline.

Each family's folder keeps its own in `families/<family>/bases.json`: `bases`, each published base by its hub id with
its `model_index.json` and each part's `config.json` (a scheduler's `scheduler_config.json`, an image processor's
`preprocessor_config.json`), as its repository publishes them, less what difftune never loads (a safety checker, the
image processor of a base that encodes no image) and the values every reader takes at their defaults; and
`planned_by`, the base the family is planned by when its own base is not on this machine (its flagship, as its 1024 px
config trains). A part shared by several bases (CLIP-L, T5-XXL, FLUX.1's autoencoder...) is named once in this
folder's `parts.json`. Tokenizers keep the two facts a plan reads: their length and padding side. Where a number came
from is said beside it (`_source`): the repository's config, or the diffusers model class's defaults where diffusers
documents them as the published model's.

May import nothing of difftune's: it is data.

`config_folder` writes a base's configs into a folder laid out as the hub's, which the plan reads as it reads a
local pipeline folder.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import cache
from pathlib import Path

HERE = Path(__file__).parent
FAMILY_FOLDERS = HERE.parent / "families"


@cache
def _family_files() -> dict[str, dict]:
    """Each family folder's `bases.json`, by the folder's name (the family's)."""
    return {
        file.parent.name: json.loads(file.read_text(encoding="utf-8"))
        for file in sorted(FAMILY_FOLDERS.glob("*/bases.json"))
    }


@cache
def _bases() -> dict:
    return {hub_id: base for kept in _family_files().values() for hub_id, base in kept["bases"].items()}


def reference_bases() -> dict[str, str]:
    """The base each family is planned by when `model.base` is not on this machine: {family: hub id}."""
    return {family: kept["planned_by"] for family, kept in _family_files().items()}


@cache
def _parts() -> dict:
    return json.loads((HERE / "parts.json").read_text(encoding="utf-8"))


def published_bases() -> list[str]:
    return sorted(_bases())


def is_published(base: str) -> bool:
    return base in _bases()


def model_index(base: str) -> dict:
    return _bases()[base]["model_index"]


def tokenizer_settings(base: str, name: str) -> dict:
    """A tokenizer's `model_max_length` and `padding_side`, as its `tokenizer_config.json` has them."""
    return _bases()[base]["tokenizers"][name]


def part_config(base: str, name: str) -> dict:
    """A part's config.json: its own, or the shared one it names, with the base's changes to it."""
    spec = _bases()[base]["parts"][name]
    if isinstance(spec, str):
        return dict(_parts()[spec])
    if "shared" in spec:
        return {**_parts()[spec["shared"]], **{key: value for key, value in spec.items() if key != "shared"}}
    return dict(spec)


@cache
def config_folder(base: str) -> Path:
    """A folder laid out as `base`'s hub repository, holding its configs alone (no weights, no tokenizer files)."""
    folder = Path(tempfile.mkdtemp(prefix="difftune-configs-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # a process's own: gone when it ends
    (folder / "model_index.json").write_text(json.dumps(model_index(base), indent=1), encoding="utf-8")
    for name in _bases()[base]["parts"]:
        config = part_config(base, name)
        file = (
            "scheduler_config.json"
            if name.endswith("scheduler")  # MiniMax-H3's `audio_scheduler` too
            else "preprocessor_config.json"
            if "image_processor_type" in config  # an image processor's (Wan 2.1 I2V's, HunyuanVideo 1.5 I2V's)
            else "config.json"
        )
        (folder / name).mkdir()
        (folder / name / file).write_text(json.dumps(config, indent=1), encoding="utf-8")
    return folder
