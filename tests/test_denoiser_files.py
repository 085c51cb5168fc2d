"""Reading denoiser-alone files where they lie: a layout's conversion followed by rows, scales following their rows."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from difftune.errors import DifftuneError
from difftune.models.denoiser_files import converted_rows, read_denoiser_file

FP8 = torch.float8_e4m3fn


def _joined_and_split(weights: dict) -> dict:
    """A layout conversion of the kinds families do: q and k joined, a fused layer split, a vector reshaped."""
    weights = dict(weights)
    first, second = weights.pop("fused.weight").split([2, 6])
    return {
        "qk.weight": torch.cat([weights.pop("q.weight"), weights.pop("k.weight")]),
        "first.weight": first,
        "second.weight": second,
        "table": weights.pop("table").reshape(2, 3),
    }


def test_each_converted_tensor_is_the_files_rows_with_their_own_scales(tmp_path):
    generator = torch.Generator().manual_seed(0)
    weights = {
        "q.weight": torch.randn(4, 8, generator=generator),
        "k.weight": torch.randn(4, 8, generator=generator) * 9,
        "fused.weight": torch.randn(8, 8, generator=generator),
        "table": torch.randn(6, generator=generator),
    }
    scales = {key: value.abs().max() / 448 for key, value in weights.items() if value.dim() == 2}
    file = {"scaled_fp8": torch.zeros(0, dtype=FP8), "table": weights["table"]}
    for key, scale in scales.items():
        file[key] = (weights[key] / scale).to(FP8)
        file[key.removesuffix(".weight") + ".scale_weight"] = scale
    save_file({f"model.diffusion_model.{key}": value for key, value in file.items()}, tmp_path / "scaled.safetensors")
    read = read_denoiser_file(str(tmp_path / "scaled.safetensors"), _joined_and_split)
    products = {key: file[key].float() * scale for key, scale in scales.items()} | {"table": weights["table"]}
    expected = _joined_and_split(products)
    assert read.tensors.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(read.weight(key, torch.float32), value), key
    assert isinstance(read.fp8_scales["qk.weight"], torch.Tensor)  # rows of two tensors of different scales
    assert read.fp8_scales["first.weight"] == pytest.approx(scales["fused.weight"].item(), rel=0, abs=0)
    fused = read.tensors["first.weight"], read.tensors["second.weight"]
    assert all(part.untyped_storage().data_ptr() == fused[0].untyped_storage().data_ptr() for part in fused)  # views


def test_a_conversion_that_moves_more_than_rows_is_refused():
    with pytest.raises(
        DifftuneError, match=r"proj.weight: the conversion of this file's layout does more than move whole rows"
    ):
        converted_rows({"proj.weight": torch.Size((4, 8))}, lambda weights: {"proj.weight": weights["proj.weight"].T})
