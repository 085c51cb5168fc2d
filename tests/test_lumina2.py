"""Lumina 2 beyond the conformance suite: its single file in the original layout, against diffusers' own reader."""

from __future__ import annotations

import torch
from diffusers import Lumina2Transformer2DModel
from diffusers.loaders.single_file_utils import convert_lumina2_to_diffusers
from safetensors.torch import save_file

from difftune.families import FAMILIES
from difftune.models.components import Components

FAMILY = FAMILIES["lumina2"]


def test_the_single_file_is_the_original_layout_as_diffusers_reads_it(tmp_path):
    """diffusers' reader assumes Lumina-Image 2.0's widths (q 2304, k and v 768 each) and its two caption refiner
    blocks: one joint block at those widths, built on the meta device, its weights random bytes read as fp8 (every
    value compared bit for bit, both ways)."""
    with torch.device("meta"):
        model = Lumina2Transformer2DModel(num_layers=1, num_refiner_layers=2, cap_feat_dim=64)
    ours = {
        key: torch.randint(0, 256, value.shape, dtype=torch.uint8).view(torch.float8_e4m3fn)
        for key, value in model.state_dict().items()
    }
    components = Components(
        family=FAMILY, denoiser=model, vae=None, text_encoders={}, tokenizers={}, noise_scheduler=None
    )
    components.denoiser.load_state_dict(ours, assign=True)
    original = FAMILY.layout.to_single_file(components)
    assert {
        "layers.0.attention.qkv.weight",
        "cap_embedder.1.weight",
        "final_layer.adaLN_modulation.1.weight",
        "context_refiner.1.attention_norm2.weight",
        "noise_refiner.0.adaLN_modulation.1.weight",
    } <= set(original)
    original["norm_final.weight"] = original["norm_final.weight"].to(torch.float8_e4m3fn)
    # Unprefixed: diffusers' reader lists the keys before it strips ComfyUI's prefix, then pops them by the old names.
    theirs = convert_lumina2_to_diffusers(dict(original))
    save_file(
        {f"model.diffusion_model.{key}": value for key, value in original.items()}, tmp_path / "lumina2.safetensors"
    )
    back = FAMILY.loading.denoiser_file_weights(str(tmp_path / "lumina2.safetensors")).tensors
    assert theirs.keys() == ours.keys() == back.keys()
    for key, value in ours.items():
        assert torch.equal(theirs[key].view(torch.uint8), value.view(torch.uint8)), key
        assert torch.equal(back[key].view(torch.uint8), value.view(torch.uint8)), key
