"""The dtypes a run keeps a base's parts in: decided from its settings in one place (`run_dtypes`), once a run,
before anything loads; loading, placing, the memory plan and the parity check read the `RunDtypes` they are given.

The rule: frozen weights compute in `model.weight_dtype`, or (`auto`) in the mixed precision's dtype (fp32 without
one). Where the settings store the denoiser's frozen layers apart (`Config.stores_frozen_weights`: fp8, or 16 bits
under fp32 compute; storage.py) they are kept in `model.weight_dtype` and computed in that dtype. Each part loads in
the dtype the run keeps it in, so no frozen weight is held in fp32 on the host unless the run computes with it in fp32
(a 12B transformer shipped in bf16 took 48 GB as fp32 before training started); a full fine-tune loads in fp32, its
trained weights' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from difftune.config import Config

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
STORED_DTYPES = DTYPES | {"fp8": torch.float8_e4m3fn}
AS_STORED = "as stored"  # a part loaded in its files' own dtype: memory-mapped, no copy (`PartDtypes.denoiser`)


@dataclass(frozen=True)
class PartDtypes:
    """The dtype each part of a base is loaded in (`Family.load`). `denoiser`: a dtype, `AS_STORED`, or None to
    leave it out (the encoders loaded again at the end of a run)."""

    denoiser: torch.dtype | str | None = torch.float32
    vae: torch.dtype = torch.float32
    others: torch.dtype = torch.float32  # the text encoders and drawing parts
    # Where the run stores the denoiser's frozen layers in fp8 (storage.py), the dtype they compute in: an fp8 single
    # file's weights are then kept as the file holds them (`denoiser_files.load_denoiser_file`).
    stored_fp8_computes_in: torch.dtype | None = None
    # False: the family's drawing parts (Wan 2.2's other expert, Ideogram 4's unconditional transformer) are left out,
    # where nothing draws before the run's end (train.py loads them again for its end samples).
    drawing_parts: bool = True


FP32_PARTS = PartDtypes()


@dataclass(frozen=True)
class RunDtypes:
    """The dtypes of one run's parts (`run_dtypes`)."""

    compute: torch.dtype  # what frozen weights compute in
    stored: torch.dtype | None  # what the denoiser's frozen layers are stored in while computing in `compute`, or None
    # Stored as the denoiser loads (`store_loaded_denoiser`); False where an init that rewrites the base factors its
    # fp32 weights first (PiSSA, OLoRA): then stored as it is placed (`place_frozen`).
    stored_at_load: bool
    text_encoders_stored: torch.dtype | None  # the text encoders' frozen layers' storage (`model.text_encoder_dtype`)
    loaded: PartDtypes  # what each part loads in


def run_dtypes(config: Config) -> RunDtypes:
    """The one rule (this module's docstring) applied to `config`."""
    if config.model.weight_dtype != "auto" and not config.stores_frozen_weights:
        compute = DTYPES[config.model.weight_dtype]
    else:  # FP8 training keeps bf16 weights: torchao casts them to FP8 per matmul, with fresh scales.
        compute = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}.get(
            config.train.mixed_precision, torch.float32
        )
    stored = STORED_DTYPES[config.model.weight_dtype] if config.stores_frozen_weights else None
    return RunDtypes(
        compute=compute,
        stored=stored,
        stored_at_load=not config.adapter.rewrites_base,
        text_encoders_stored=STORED_DTYPES["fp8"] if config.model.text_encoder_dtype == "fp8" else None,
        loaded=_loaded(config, compute, stored),
    )


def _loaded(config: Config, compute: torch.dtype, stored: torch.dtype | None) -> PartDtypes:
    """What each part loads in. A denoiser whose frozen layers are stored apart loads as its files hold it,
    memory-mapped without a copy, and is stored layer by layer at once (`store_loaded_denoiser`): its host peak is the
    stored bytes, not a 16-bit or fp32 copy of the whole. A KL VAE under fp16 loads in fp32 (`cast_frozen` keeps one
    that asks for `force_upcast` there)."""
    if config.adapter.trains_all_weights:
        return FP32_PARTS
    # An init that rewrites the base factors the fp32 weights; the run casts or stores them after (`place_frozen`).
    denoiser = torch.float32 if config.adapter.rewrites_base else AS_STORED if stored is not None else compute
    stores_fp8 = denoiser == AS_STORED and stored == STORED_DTYPES["fp8"]
    return PartDtypes(
        denoiser=denoiser,
        vae=torch.float32 if compute == torch.float16 else compute,
        others=compute,
        stored_fp8_computes_in=compute if stores_fp8 else None,
        drawing_parts=draws_before_the_end(config),
    )


def draws_before_the_end(config: Config) -> bool:
    """Whether the run draws before its end samples: before samples, previews, or prior preservation's class images
    (the drawing parts are loaded with the base then; else only for the end samples: a Wan 2.2 expert's 28 GB twin
    is not held while the other trains)."""
    return bool(config.sample.prompts and (config.sample.before or config.sample.every_steps)) or config.prior.enabled
