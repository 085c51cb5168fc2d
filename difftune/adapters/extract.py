"""Extracting a LoRA from a full fine-tune (`difftune extract`): each layer a LoRA of the family adapts (or, asked,
every linear and convolution) whose weights differ between the base and the fine-tuned model gets the truncated SVD
of its difference as its two factors (sd-scripts' `extract_lora_from_models.py`), at most `rank` singular values, or
the fewest holding `keep_fro` of the difference's Frobenius norm, or both. Unchanged layers (no element moved more
than `min_difference`) are left out. The file is the adapter of the base's family, written in either layout as a
trained one is.

The SVD is exact where the spectrum is needed whole (`keep_fro` alone) or the layer is small; otherwise randomized
(`torch.svd_lowrank` with 10 + rank extra directions and 4 power iterations), which a large layer needs: a 3072 x
12288 layer's full SVD takes about two minutes on 2 CPU cores. Both models are loaded in fp32, as merging loads its
base: a fine-tune's changes are smaller than bf16's resolution of the weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from difftune.adapters.files import module_names_of
from difftune.adapters.resize import ResizedLayer, check_rank_settings, configs_at_scale_one, truncated_factors
from difftune.errors import DifftuneError
from difftune.models.components import Components


def extract_lora(
    base: Components,
    tuned: Components,
    rank: int | None = None,
    keep_fro: float | None = None,
    min_difference: float = 1e-6,
    device: torch.device | str = "cpu",
    all_layers: bool = False,
) -> tuple[dict[str, torch.Tensor], dict, list[ResizedLayer]]:
    """The LoRA tensors (difftune's layout) and configs of `tuned` - `base`, and a row per layer extracted (its
    `rank_before` the difference's full rank). The parts and layers are those a LoRA of the family adapts (its
    default targets, in the denoiser and the text encoders its pipeline's LoRA loader reads), so the file loads where
    a trained one does; `all_layers`: every changed linear and convolution of those parts (the diffusers layout names
    them all; a kohya layout may not)."""
    check_rank_settings("extract", rank, keep_fro)
    if type(base.family) is not type(tuned.family):
        raise DifftuneError(
            f"extract: the fine-tuned model is a {tuned.family.description} base, the base a {base.family.description} "
            "one; give the base the fine-tune started from"
        )
    family, tuned_parts, names = base.family, tuned.parts(), module_names_of(base).names
    tensors, ranks, rows = {}, {}, []
    for part in (family.denoiser_name, *family.targets.adapted_text_encoders()):
        model = base.parts().get(part)
        if model is None or tuned_parts.get(part) is None:
            continue
        base_layers, tuned_layers = dict(model.named_modules()), dict(tuned_parts[part].named_modules())
        targets = None if all_layers else family.targets.targets_of(part, model)
        for module in names[part]:
            if targets is not None and not any(module == t or module.endswith(f".{t}") for t in targets):
                continue
            before, after = base_layers[module].weight, tuned_layers.get(module)
            if after is None or after.weight.shape != before.shape:
                raise DifftuneError(
                    f"extract: {part}.{module} is not in the fine-tuned model as in the base; give the base the "
                    "fine-tune started from"
                )
            difference = after.weight.detach().to(device, torch.float64) - before.detach().to(device, torch.float64)
            if difference.abs().max() <= min_difference:
                continue
            down, up, kept, full_rank = _low_rank(difference, rank, keep_fro, torch.finfo(before.dtype).eps)
            tensors[f"{part}.{module}.lora_A.weight"] = down.float().cpu().contiguous()
            tensors[f"{part}.{module}.lora_B.weight"] = up.float().cpu().contiguous()
            ranks.setdefault(part, {})[module] = down.shape[0]
            rows.append(ResizedLayer(f"{part}.{module}", full_rank, down.shape[0], kept))
    if not tensors:
        raise DifftuneError(
            f"extract: no layer of the fine-tuned model differs from the base by more than {min_difference}"
        )
    return tensors, configs_at_scale_one(ranks), rows


def _low_rank(
    difference: torch.Tensor, rank: int | None, keep_fro: float | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """A layer's difference (out, in[, kh, kw]) as `down` (k, in[, kh, kw]) and `up` (out, k[, 1, 1]), the share of
    its Frobenius norm they keep, and the difference's rank: its singular values over the weights' rounding (the
    largest times the longer side times `eps`, the weights' dtype's, as `torch.linalg.matrix_rank` counts; of a
    randomized SVD's, at most those it computed). Ranks beyond it are rounding, and are not kept."""
    matrix = difference.flatten(1)
    smallest_side = min(matrix.shape)
    oversampled = None if rank is None else min(smallest_side, rank + 10)
    if oversampled is None or oversampled == smallest_side:
        u, singular, vh = torch.linalg.svd(matrix, full_matrices=False)
    else:
        u, singular, v = torch.svd_lowrank(matrix, q=oversampled, niter=4)
        vh = v.T
    full_rank = max(1, int((singular > singular[0] * max(matrix.shape) * eps).sum()))
    down, up, kept = truncated_factors(u, singular, vh, float(matrix.square().sum()), rank, keep_fro, full_rank)
    keep = down.shape[0]
    kernel = difference.shape[2:]
    return (
        down.reshape(keep, *difference.shape[1:]),
        up.reshape(difference.shape[0], keep, *(1,) * len(kernel)),
        kept,
        full_rank,
    )


def extract_file(
    base: str,
    tuned: str,
    out: Path,
    rank: int | None,
    keep_fro: float | None,
    layout: str = "diffusers",
    min_difference: float = 1e-6,
    device: str | None = None,
    all_layers: bool = False,
) -> tuple[Path, list[ResizedLayer]]:
    """`difftune extract` (the UI's too): both models loaded in fp32 (the ranks checked first), the fine-tune's
    difference as a LoRA written to `out` in `layout` on `device` (default: a GPU where there is one); the file
    written and each layer's row."""
    from difftune.adapters import export
    from difftune.config import ModelConfig
    from difftune.families import load_components

    check_rank_settings("extract", rank, keep_fro)  # before loading two models
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    base_components = load_components(ModelConfig(base=base))
    tuned_components = load_components(ModelConfig(base=tuned))
    tensors, lora_configs, rows = extract_lora(
        base_components, tuned_components, rank, keep_fro, min_difference, device, all_layers
    )
    written = export.write_adapter(out, tensors, lora_configs, "", layout, family=base_components.family, base=base)
    return written, rows
