"""Resizing a LoRA to a lower rank (`difftune resize`): each module's change, its scale times `lora_B @ lora_A`,
re-factored by its singular value decomposition, keeping the largest singular values: at most `rank` of them, or the
fewest whose share of the change's Frobenius norm reaches `keep_fro` (sd-scripts' `resize_lora.py` `sv_fro`), or
both. Truncating the SVD is the best change of that rank (Eckart-Young): no other rank-k LoRA is closer.

The SVD is taken of the factors, not of the full change: with `B = Q_b R_b` and `A^T = Q_a R_a` (QR), the change
`Q_b (R_b R_a^T) Q_a^T` has the singular values of the rank x rank core, so a 3072 x 12288 layer costs a 16 x 16 SVD
and two thin QRs instead of a 3072 x 12288 SVD (what sd-scripts computes), with the same result. The resized factors
share each singular value's square root, and the change is folded into them (alpha = rank: a scale of 1), so every
reader applies the file alike. LoRA files alone: a DoRA's magnitudes are tied to its direction and LoHa/LoKr are not
products of two factors (refused, naming the part).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from difftune.adapter_kinds import KINDS, file_kind
from difftune.adapters.files import parts_of
from difftune.adapters.kohya import split_adapter_key
from difftune.adapters.trained import adapter_scale, derived_lora_configs
from difftune.errors import DifftuneError


@dataclass(frozen=True)
class ResizedLayer:
    """One module's resize: its rank before and after, and the share of its change's Frobenius norm kept."""

    module: str  # `<part>.<module>`, as the diffusers layout names it
    rank_before: int
    rank_after: int
    kept: float


def resize_lora(
    tensors: dict[str, torch.Tensor], lora_configs: dict, rank: int | None = None, keep_fro: float | None = None
) -> tuple[dict[str, torch.Tensor], dict, list[ResizedLayer]]:
    """A LoRA's tensors and configs (difftune's layout, as `read_any_adapter` gives them) resized as the module says;
    the resized tensors, their configs, and a row per module."""
    check_rank_settings("resize", rank, keep_fro)
    resized, configs, rows = dict(tensors), dict(lora_configs), []
    for part in parts_of(tensors):
        kind = file_kind(lora_configs, part)
        if kind is not KINDS["lora"]:
            raise DifftuneError(
                f"{part}: a {kind.name} adapter; resize re-factors a LoRA's two factors (a DoRA's magnitudes follow "
                f"its direction, LoHa/LoKr are not two factors): merge it into the base instead"
            )
        ranks = {}
        for key in [key for key in tensors if key.startswith(f"{part}.") and key.endswith(".lora_A.weight")]:
            module = split_adapter_key(key.partition(".")[2])[0]
            down, up = tensors[key], tensors[f"{part}.{module}.lora_B.weight"]
            scale = adapter_scale(lora_configs, part, module, down.shape[0])
            new_down, new_up, kept = _resized_factors(down, up, scale, rank, keep_fro)
            resized[key], resized[f"{part}.{module}.lora_B.weight"] = new_down, new_up
            ranks[module] = new_down.shape[0]
            rows.append(ResizedLayer(f"{part}.{module}", down.shape[0], new_down.shape[0], kept))
        configs |= configs_at_scale_one({part: ranks})
    return resized, configs, rows


def configs_at_scale_one(ranks: dict[str, dict[str, int]]) -> dict:
    """Each part's LoRA config (by part, by module: its rank) for factors that hold their change whole: alpha = rank,
    no rsLoRA, no DoRA."""
    alphas = {part: {module: float(r) for module, r in part_ranks.items()} for part, part_ranks in ranks.items()}
    configs = derived_lora_configs(ranks, alphas, dict.fromkeys(ranks, False))
    return configs | {f"{part}.use_rslora": False for part in ranks}


def check_rank_settings(command: str, rank: int | None, keep_fro: float | None) -> None:
    """Refuse `--rank` / `--keep-fro` settings that keep nothing, or neither given."""
    if rank is None and keep_fro is None:
        raise DifftuneError(
            f"{command}: give --rank (the most each layer keeps), --keep-fro (the norm to keep), or both"
        )
    if rank is not None and rank < 1:
        raise DifftuneError(f"--rank {rank}: a rank is 1 or more")
    if keep_fro is not None and not 0 < keep_fro <= 1:
        raise DifftuneError(f"--keep-fro {keep_fro}: a share of a layer's change's norm, over 0 and at most 1")


def kept_ranks(singular: torch.Tensor, total: float, rank: int | None, keep_fro: float | None) -> int:
    """How many of the largest singular values (descending) to keep: at most `rank`, and no more than hold `keep_fro`
    of the Frobenius norm whose square is `total`; at least 1."""
    keep = len(singular) if rank is None else min(rank, len(singular))
    if keep_fro is not None and total > 0:
        energy = singular.square().cumsum(0)
        keep = min(keep, int(torch.searchsorted(energy, keep_fro**2 * total * (1 - 1e-12))) + 1)
    return max(keep, 1)


def truncated_factors(
    u: torch.Tensor,
    singular: torch.Tensor,
    vh: torch.Tensor,
    total: float,
    rank: int | None,
    keep_fro: float | None,
    most: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """An SVD `u @ diag(singular) @ vh` (singular values descending) of a change whose Frobenius norm squared is
    `total`, cut to `kept_ranks` (and at most `most`): `down` (k, n) and `up` (m, k), each with the square root of
    every kept singular value, and the share of the change's norm they keep."""
    keep = kept_ranks(singular, total, rank, keep_fro)
    keep = keep if most is None else min(keep, most)
    root = singular[:keep].sqrt()
    kept = math.sqrt(min(1.0, float(singular[:keep].square().sum()) / total)) if total > 0 else 1.0
    return root[:, None] * vh[:keep], u[:, :keep] * root, kept


def _resized_factors(
    down: torch.Tensor, up: torch.Tensor, scale: float, rank: int | None, keep_fro: float | None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """`down` (r, in[, kh, kw]) and `up` (out, r[, 1, 1]) of one module, resized: the new factors and the share of
    the change's Frobenius norm they keep. A convolution's factors are read as matrices over its flattened kernel."""
    b = up.flatten(1).double() * scale
    a = down.flatten(1).double()
    q_up, r_up = torch.linalg.qr(b)
    q_down, r_down = torch.linalg.qr(a.T)
    u, singular, vh = torch.linalg.svd(r_up @ r_down.T)
    new_down, new_up, kept = truncated_factors(
        q_up @ u, singular, vh @ q_down.T, float(singular.square().sum()), rank, keep_fro
    )
    keep = new_down.shape[0]
    return (
        new_down.reshape(keep, *down.shape[1:]).to(down.dtype),
        new_up.reshape(up.shape[0], keep, *up.shape[2:]).to(up.dtype),
        kept,
    )


def summary(rows: list[ResizedLayer]) -> str:
    """One line: how many layers, their ranks before and after, the norm they kept (least and median)."""
    after = sorted(row.rank_after for row in rows)
    kept = sorted(row.kept for row in rows)
    before = sorted({row.rank_before for row in rows})
    return (
        f"{len(rows)} layers, rank {'/'.join(map(str, before))} -> {after[0]}-{after[-1]} "
        f"(mean {sum(after) / len(after):.1f}); change's norm kept: least {kept[0]:.3f}, "
        f"median {kept[len(kept) // 2]:.3f}"
    )


def resize_file(
    source: Path, target: Path, rank: int | None, keep_fro: float | None, layout: str | None = None, base: str = ""
) -> tuple[Path, list[ResizedLayer], str]:
    """`difftune resize` (the UI's too): the LoRA file `source` (any tool's layout) resized and written to `target` in
    `layout` (default: the source's); the file written, each layer's row, the layout."""
    from difftune.adapters import export
    from difftune.adapters.files import is_kohya
    from difftune.files import open_safetensors

    check_rank_settings("resize", rank, keep_fro)
    with open_safetensors(source) as handle:
        layout = layout or ("kohya" if is_kohya(dict.fromkeys(handle.keys())) else "diffusers")
    tensors, lora_configs, config_toml = export.read_any_adapter(source, base or None)
    tensors, lora_configs, rows = resize_lora(tensors, lora_configs, rank, keep_fro)
    written = export.write_adapter(target, tensors, lora_configs, config_toml, layout, base=base)
    return written, rows, layout
