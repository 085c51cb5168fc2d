"""Trainer-vs-inference parity: the saved result, reloaded as a user loads it, draws what training drew.

After the final save, the base is loaded afresh, each saved adapter file is attached through the same reader
`merge` / `sample` use (the diffusers layout and the kohya / ComfyUI one), and the first end-of-run prompt is drawn
with its seed, precision and sampler. The largest pixel difference from the in-training sample goes to
`parity.json`. Zero means the file holds exactly what was trained; anything else means something was lost
between the trainer's modules and the file (a key, a scale, DoRA's magnitude), which users otherwise meet as
"it looks better in training than in my tool".
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from types import MethodType

import numpy as np
import torch
from accelerate.utils import convert_outputs_to_fp32
from peft.tuners.tuners_utils import BaseTunerLayer

from difftune.adapters import export
from difftune.adapters.trained import trained_parts
from difftune.config import Config
from difftune.families import load_components
from difftune.families.common.drawing import Sample, generate_images
from difftune.memory.quantize import quantize_linear_layers
from difftune.models.components import place_frozen, store_loaded_text_encoders
from difftune.models.dtypes import RunDtypes
from difftune.owned_files import write_file
from difftune.training.metrics import RUN_FOLDER

PARITY_FILE = "parity.json"
# Levels of 255. The reload runs the same computation, so 0 is expected; channels-last vs default layout may
# round differently by a level.
WARN_ABOVE_LEVELS = 2


def check_parity(
    config: Config,
    files: dict[str, list[Path] | str],
    reference: Sample,
    device: torch.device,
    dtypes: RunDtypes,
    autocast,
    outputs_in_fp32: bool = False,
) -> dict:
    """Re-draw `reference` from each layout the run wrote (`files`: layout -> its files, or why that layout could not
    hold the adapter) in a fresh pipeline, its frozen weights placed as training placed them (stored in another
    dtype, offloaded, as the config says), its adapters' weights in fp32 and, with `outputs_in_fp32` (Accelerate's
    mixed precision, whose prepared modules return fp32: the sampler then steps in fp32), the trained parts'
    outputs in fp32 too; the report."""
    sample_config = config.sample.model_copy(
        update={"prompts": [reference.entry], "images_per_prompt": 1, "seed": reference.seed}
    )
    report = {"prompt": reference.prompt, "seed": reference.seed, "warn_above_levels": WARN_ABOVE_LEVELS, "layouts": {}}
    not_checked = {layout: why for layout, why in files.items() if isinstance(why, str)}
    if not_checked:
        report["not_checked"] = not_checked
    for layout, paths in files.items():
        if not isinstance(paths, str):
            components = _fresh_components(config, paths, device, dtypes)
            trained = trained_parts(components, config.adapter)
            whole = (
                trained.values() if config.adapter.trains_whole_parts else ()
            )  # a full fine-tune's (a ControlNet) stay fp32, as trained
            with adapters_kept_in_fp32(components):
                place_frozen(
                    components,
                    device,
                    dtypes.compute,
                    whole,
                    stored=dtypes.stored,
                    offloaded=config.model.offload_blocks,
                )
            if outputs_in_fp32:
                for module in trained.values():
                    module.forward = MethodType(convert_outputs_to_fp32(module.forward.__func__), module)
            with autocast():
                drawn = generate_images(components, sample_config, device)[0]
            difference = max(
                np.abs(ours - theirs).max() for ours, theirs in zip(_levels(drawn), _levels(reference), strict=True)
            )
            report["layouts"][layout] = {
                "file": ", ".join(path.name for path in paths),
                "max_pixel_difference": int(difference),
            }
    return report


def _levels(sample: Sample) -> list[np.ndarray]:
    """What a sample's file holds, as the levels compared: an image's 8-bit pixels, a clip's every frame's, a sound's
    16-bit samples (its FLAC's)."""
    if sample.sound is not None:
        return [np.round(np.clip(sample.sound.samples, -1, 1) * 32767).astype(np.int32)]
    return [np.asarray(frame, np.int32) for frame in sample.clip or [sample.image]]


def room_for_a_fresh_copy(components, device: torch.device) -> str | None:
    """Why the check cannot run here, or None: it loads the base afresh in fp32 beside the trained one, and at the
    end of a long run on a large base that copy must not be what runs the machine out of memory (FLUX.1 in fp32 is
    63 GiB). The RAM available and, on a GPU, its free memory are compared with the copy's bytes."""
    import psutil

    from difftune.progress import bytes_said

    needed = sum(
        t.numel() * 4 if t.is_floating_point() or t.dtype == torch.uint8 else t.numel() * t.element_size()
        for module in components.modules()
        for t in (*module.parameters(), *module.buffers())
    )
    room = {"RAM available": psutil.virtual_memory().available}
    if device.type == "cuda":
        room["free GPU memory"] = torch.cuda.mem_get_info(device)[0]
    short = [f"{bytes_said(free)} of {where}" for where, free in room.items() if needed > free]
    if not short:
        return None
    return (
        f"parity: not checked: redrawing loads a fresh fp32 copy of the base ({bytes_said(needed)}), more than the "
        f"{' and the '.join(short)}; sample.parity = false leaves the check out"
    )


def parity_line(report: dict) -> str:
    """The report in one line: "parity: 0 levels in both layouts", or each layout's levels."""
    levels = {layout: result["max_pixel_difference"] for layout, result in report["layouts"].items()}
    if len(levels) == 2 and len(set(levels.values())) == 1:
        said = f"{next(iter(levels.values()))} levels in both layouts"
    else:
        said = ", ".join(f"{value} levels in the {layout} file" for layout, value in levels.items())
    unchecked = "".join(f"; the {layout} layout not checked" for layout in report.get("not_checked", {}))
    return (
        f"parity: {said} (the saved files redrawn in a fresh pipeline against sample 000; see {PARITY_FILE}){unchecked}"
    )


def write_report(report: dict, output_dir: Path) -> list[str]:
    """`parity.json`; the warnings to show (one per layout above the threshold)."""
    write_file(output_dir / PARITY_FILE, json.dumps(report, indent=2) + "\n", RUN_FOLDER, ours=False)
    return [
        f"the {layout} file reloaded in a fresh pipeline draws sample 000 up to {result['max_pixel_difference']}/255 "
        f"away from the in-training sample (more than {WARN_ABOVE_LEVELS}): see {PARITY_FILE}"
        for layout, result in report["layouts"].items()
        if result["max_pixel_difference"] > WARN_ABOVE_LEVELS
    ]


@contextmanager
def adapters_kept_in_fp32(components):
    """The attached adapters' weights as read (fp32) after the block, which places the model in a half dtype: training
    keeps the weights it trains in fp32 (`cast_training_params`); rounded to bf16 they drew 9 to 27 levels away."""
    adapters = [
        parameter
        for module in components.modules()
        for layer in module.modules()
        if isinstance(layer, BaseTunerLayer)
        for name in layer.adapter_layer_names
        for parameter in getattr(layer, name).parameters()
    ]
    values = [parameter.detach().clone() for parameter in adapters]
    yield
    for parameter, value in zip(adapters, values, strict=True):
        parameter.data = value.to(parameter.device)


def _fresh_components(config: Config, paths: list[Path], device: torch.device, dtypes: RunDtypes):
    if config.adapter.trains_all_weights:  # the saved pipeline folder holds every part, its autoencoder included
        return load_components(
            config.model.model_copy(update={"base": str(paths[0]), "vae": "", "revision": "", "variant": ""})
        )
    components = load_components(config.model)
    store_loaded_text_encoders(components, dtypes)  # as training read its captions
    if config.model.quantize != "none":  # the file is checked on the base it was trained on
        quantize_linear_layers(components.denoiser, config.model.quantize, device, dtypes.compute)
    export.apply_adapters(components, [(path, 1.0) for path in paths])
    return components
