"""Block offloading (`model.offload_blocks`): offloaded layers compute exactly what they compute in place, in
forward and in backward (with and without gradient checkpointing), their weights really leave the model, and from
the second step on every copy is one made ahead of its use. On CPU the copies run in line; the CUDA stream path is
checked in test_cuda.py."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import StableDiffusionPipeline
from peft import LoraConfig
from safetensors.torch import load_file

from difftune.data import sharding
from difftune.errors import DifftuneError
from difftune.families import FAMILIES
from difftune.memory import storage
from difftune.memory.offload import Offloader, offload_blocks, spread
from difftune.training.train import train


def offloader_of(model: torch.nn.Module) -> Offloader | None:
    return next(
        (
            module.offloader
            for module in model.modules()
            if isinstance(module, storage.ComputedFromStored) and module.offloader is not None
        ),
        None,
    )


@pytest.mark.parametrize("checkpointing", [False, True])
def test_offloaded_layers_compute_as_in_place_and_are_copied_ahead(tiny_base, checkpointing):
    unet = StableDiffusionPipeline.from_pretrained(tiny_base, safety_checker=None).unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=["to_q", "to_v", "conv1"]))
    if checkpointing:
        unet.enable_gradient_checkpointing()
        unet.train()
    in_place = copy.deepcopy(unet)
    blocks = FAMILIES["sd"].offloadable_blocks(unet)
    for block in blocks:
        storage.store_frozen_layers(block, torch.float32)
    offloader = offload_blocks(blocks, torch.device("cpu"))
    # The stored weights left the model: what it holds of them is empty placeholders.
    kept = sum(p.numel() for p in unet.parameters())
    assert kept + offloader.host_bytes // 4 == sum(p.numel() for p in in_place.parameters())
    torch.manual_seed(0)
    inputs = (torch.randn(2, 4, 16, 16), torch.tensor([10, 500]), torch.randn(2, 77, unet.config.cross_attention_dim))
    for _ in range(2):
        offloader.copies = dict.fromkeys(offloader.copies, 0)
        with storage.computed_copies_saved_as_stored():
            loss = unet(*inputs).sample.square().mean()
        loss.backward()
        expected = in_place(*inputs).sample.square().mean()
        expected.backward()
        assert loss.item() == expected.item()
        for (name, param), other in zip(unet.named_parameters(), in_place.parameters(), strict=True):
            if param.requires_grad:
                assert torch.equal(param.grad, other.grad), name
    # Forward ran the down blocks, the mid block, then the up blocks; the second step copied every weight ahead.
    names = {id(module): name for name, module in unet.named_modules()}
    assert [names[id(blocks[i])] for i in offloader.order] == [
        *(f"down_blocks.{i}" for i in range(len(unet.down_blocks))),
        "mid_block",
        *(f"up_blocks.{i}" for i in range(len(unet.up_blocks))),
    ]
    assert offloader.copies["in_line"] == 0 and offloader.copies["prefetched"] > 0
    assert len(offloader.staged) <= 2


@pytest.mark.parametrize("weight_dtype", ["auto", "fp8"])
def test_offloaded_training_is_training_in_place(make_config, tmp_path, weight_dtype):
    settings = dict(
        train__max_steps=3,
        optim__learning_rate=1e-2,
        model__weight_dtype=weight_dtype,
        sample__prompts=["a red circle"],
        sample__parity=True,
    )
    in_place = train(make_config(train__output_dir=str(tmp_path / "in-place"), **settings))
    offloaded = train(make_config(train__output_dir=str(tmp_path / "offloaded"), model__offload_blocks=4, **settings))
    assert offloaded.losses == in_place.losses
    expected = load_file(in_place.trained_path)
    assert all(torch.equal(value, expected[key]) for key, value in load_file(offloaded.trained_path).items())
    offloader = offloader_of(offloaded.components.denoiser)
    assert offloader is not None and len(offloader.layers) == 4 and offloader.copies["prefetched"] > 0
    assert offloader_of(in_place.components.denoiser) is None
    parity = (tmp_path / "offloaded" / "parity.json").read_text()  # reloaded with the same blocks offloaded
    assert '"max_pixel_difference": 0' in parity


def test_offload_settings_are_checked(make_config, tiny_base):
    with pytest.raises(
        DifftuneError, match=r"offload_blocks = 2 keeps frozen weights in host memory, and a full fine-tune"
    ):
        make_config(model__offload_blocks=2, adapter__kind="none")
    with pytest.raises(DifftuneError, match=r"offload_blocks = 2 keeps .* with FSDP"):
        sharding.check_config(make_config(model__offload_blocks=2))
    with pytest.raises(
        DifftuneError, match=r"model\.offload_blocks = 99, and this UNet2DConditionModel has 5 blocks: set at most 5"
    ):
        train(make_config(model__offload_blocks=99, train__max_steps=1))


def test_offloaded_blocks_are_spread_evenly():
    assert spread(1, 7) == [3]
    assert spread(2, 8) == [2, 6]
    assert spread(3, 9) == [1, 4, 7]
    assert spread(5, 5) == [0, 1, 2, 3, 4]
