"""A diffusers pipeline that ships no LoRA loader (HunyuanImage 2.1's, HunyuanVideo 1.5's) as the reader we did not
write: its transformer's own `load_lora_adapter` reads difftune's diffusers-layout file, and the pipeline then draws
what difftune's merged folder draws; and the kohya file read back as the same adapter."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from diffusers import ClassifierFreeGuidance
from safetensors.torch import load_file

from difftune.adapters import export
from difftune.training.train import train


def trained_and_merged(make_config, base: str, tmp_path: Path) -> tuple[Path, Path]:
    """A 3-step LoRA of `base` (a large learning rate: the adapter visibly changes a draw) and its merged folder."""
    trained = train(
        make_config(
            model__base=base,
            train__max_steps=3,
            optim__learning_rate=5e-2,
            train__output_dir=str(tmp_path / "run"),
            sample__prompts=[],
        )
    ).trained_path
    return trained, export.merge_into_folder(base, [(trained, 1.0)], tmp_path / "merged")[0]


def assert_pipeline_draws_the_adapter(
    pipeline_class: type, base: str, trained: Path, merged: Path, frames: int | None = None
) -> None:
    """The merged folder names `pipeline_class`, which loads it; `pipeline_class` over the base with the adapter
    loaded on its transformer draws what the merged folder draws (latents of a 32 px image, or a clip of `frames`, in
    4 steps of classifier-free guidance at 3), and not what the base alone draws."""
    assert json.loads((merged / "model_index.json").read_text())["_class_name"] == pipeline_class.__name__
    theirs = pipeline_class.from_pretrained(base, dtype=torch.float32)
    theirs.transformer.load_lora_adapter(str(trained), prefix="transformer")
    drawn = {}
    for name, folder in (("theirs", None), ("merged", merged), ("base", base)):
        pipeline = theirs if folder is None else pipeline_class.from_pretrained(folder, dtype=torch.float32)
        pipeline.set_progress_bar_config(disable=True)
        pipeline.guider = ClassifierFreeGuidance(guidance_scale=3.0)
        output = pipeline(
            prompt="a purple circle",
            negative_prompt="",
            height=32,
            width=32,
            **({"num_frames": frames} if frames else {}),
            num_inference_steps=4,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
        )
        drawn[name] = (output.frames if frames else output.images).numpy()
    assert np.abs(drawn["theirs"] - drawn["merged"]).max() < 1e-4
    assert np.abs(drawn["theirs"] - drawn["base"]).max() > 1e-3  # the adapter changed what is drawn


def kohya_modules_read_back(trained: Path, tmp_path: Path) -> set[str]:
    """The kohya file's module names, once it is checked to read back as the same adapter."""
    kohya = load_file(export.convert_adapter(trained, tmp_path / "kohya.safetensors", "kohya"))
    back = load_file(export.convert_adapter(tmp_path / "kohya.safetensors", tmp_path / "back.safetensors", "diffusers"))
    ours = load_file(trained)
    assert back.keys() == ours.keys()
    assert all(torch.allclose(back[key], ours[key], atol=1e-6) for key in ours)
    return {key.split(".", 1)[0] for key in kohya}
