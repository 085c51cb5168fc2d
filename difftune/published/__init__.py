"""The configs of the bases people train, kept in the package, so `difftune plan` can answer "does it fit?" before
a 50 GB download, offline.

`bases.json` holds each published base by its hub id: its `model_index.json` and each part's `config.json` (a
scheduler's `scheduler_config.json`, an image processor's `preprocessor_config.json`), as its repository publishes
them, less what difftune never loads (a safety checker, the image processor of a base that encodes no image) and the
values every reader takes at their defaults; a part shared by several bases (CLIP-L, T5-XXL, FLUX.1's
autoencoder...) is named once in `parts.json`. Tokenizers keep the two facts a plan reads: their length and padding
side. Each family names the base it is planned by when its own base is not on this
machine (`REFERENCE_BASES`). Where a number came from is said beside it (`_source`): the repository's config, or
the diffusers model class's defaults where diffusers documents them as the published model's.

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
# The base each family is planned by when `model.base` is not on this machine (a folder to be converted, a file not
# yet downloaded): its flagship, as its 1024 px config trains.
REFERENCE_BASES = {
    "sd": "stable-diffusion-v1-5/stable-diffusion-v1-5",
    "sdxl": "stabilityai/stable-diffusion-xl-base-1.0",
    "sd3": "stabilityai/stable-diffusion-3.5-large",
    "flux": "black-forest-labs/FLUX.1-dev",
    "flux_kontext": "black-forest-labs/FLUX.1-Kontext-dev",
    "chroma": "lodestones/Chroma1-HD",
    "flux2": "black-forest-labs/FLUX.2-dev",
    "flux2_klein": "black-forest-labs/FLUX.2-klein-4B",
    "flux3": "black-forest-labs/FLUX.3-dev",
    "anima": "circlestone-labs/Anima-Base-v1.0-Diffusers",
    "kandinsky5": "kandinskylab/Kandinsky-5.0-T2I-Lite-sft-Diffusers",
    "kandinsky5_video": "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers",
    "qwen_image": "Qwen/Qwen-Image",
    "qwen_image21": "Qwen/Qwen-Image-2.1",
    "qwen_image_edit": "Qwen/Qwen-Image-Edit",
    "qwen_image_edit_plus": "Qwen/Qwen-Image-Edit-2509",
    "qwen_image_layered": "Qwen/Qwen-Image-Layered",
    "z_image": "Tongyi-MAI/Z-Image-Turbo",
    "z_image_omni": "Tongyi-MAI/Z-Image-Omni-Base",
    "krea2": "krea2-diffusers",
    "lumina2": "Alpha-VLLM/Lumina-Image-2.0",
    "ltx2": "Lightricks/LTX-2",
    "ideogram4": "ideogram-ai/ideogram-v4",
    "ernie_image": "baidu/ERNIE-Image",
    "hunyuan_image": "hunyuanvideo-community/HunyuanImage-2.1-Diffusers",
    "hunyuan_video15": "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
    "hunyuan_video15_i2v": "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v",
    "hidream": "HiDream-ai/HiDream-I1-Full",
    "wan": "Wan-AI/Wan2.1-T2V-14B-Diffusers",
    "wan_i2v": "Wan-AI/Wan2.2-I2V-A14B-Diffusers",
}


@cache
def _bases() -> dict:
    return json.loads((HERE / "bases.json").read_text(encoding="utf-8"))


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
            if name == "scheduler"
            else "preprocessor_config.json"
            if "image_processor_type" in config  # an image processor's (Wan 2.1 I2V's, HunyuanVideo 1.5 I2V's)
            else "config.json"
        )
        (folder / name).mkdir()
        (folder / name / file).write_text(json.dumps(config, indent=1), encoding="utf-8")
    return folder
