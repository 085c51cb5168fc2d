"""Adapters made by other tools: diffusers' own save functions, kohya-style files; read, converted, merged, sampled."""

import json
import re

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPipeline
from diffusers.utils.state_dict_utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from difftune.adapters import export
from difftune.adapters.files import read_adapter
from difftune.adapters.kohya import family_to_kohya
from difftune.cli import main
from difftune.config import ModelConfig
from difftune.errors import DifftuneError
from difftune.families import load_components

from conftest import unet_inputs

RANK, ALPHA = 4, 8.0


def _randomized_lora(tiny_base, seed=0):
    """The tiny base with random (non-identity) LoRAs on the UNet and text encoder, as a diffusers user makes them."""
    components = load_components(ModelConfig(base=str(tiny_base)))
    unet_config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["to_q", "to_k", "to_v", "to_out.0", "conv1"])
    # All four projections: diffusers' kohya reader tells the text encoder's key style by `out_proj` being there.
    text_config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "k_proj", "v_proj", "out_proj"])
    components.denoiser.add_adapter(unet_config)
    components.text_encoders["text_encoder"].add_adapter(text_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in [
            *components.denoiser.named_parameters(),
            *components.text_encoders["text_encoder"].named_parameters(),
        ]:
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return components, unet_config, text_config


def _save_as_diffusers_example(components, folder, unet_config=None, text_config=None):
    """What diffusers' LoRA training examples write: `convert_state_dict_to_diffusers` keys, `save_lora_weights`."""
    StableDiffusionPipeline.save_lora_weights(
        folder,
        unet_lora_layers=convert_state_dict_to_diffusers(get_peft_model_state_dict(components.denoiser)),
        text_encoder_lora_layers=convert_state_dict_to_diffusers(
            get_peft_model_state_dict(components.text_encoders["text_encoder"])
        ),
        unet_lora_adapter_metadata=unet_config.to_dict() if unet_config else None,
        text_encoder_lora_adapter_metadata=text_config.to_dict() if text_config else None,
        safe_serialization=True,
    )
    return folder / "pytorch_lora_weights.safetensors"


def _outputs(unet, text_encoder, tokenizer):
    latents, timesteps, states = unet_inputs(unet)
    ids = tokenizer(["a red circle"], padding="max_length", return_tensors="pt").input_ids
    with torch.no_grad():
        return unet(latents, timesteps, states).sample, text_encoder(ids)[0]


def _diffusers_reference(tiny_base, path):
    """diffusers' own reader of `path`: the independent check of what the file means."""
    pipeline = StableDiffusionPipeline.from_pretrained(tiny_base, safety_checker=None, dtype=torch.float32)
    pipeline.load_lora_weights(str(path.parent), weight_name=path.name)
    return _outputs(pipeline.unet, pipeline.text_encoder, pipeline.tokenizer)


def _difftune_outputs(tiny_base, path):
    components = load_components(ModelConfig(base=str(tiny_base)))
    export.apply_adapters(components, [(path, 1.0)])
    return _outputs(components.denoiser, components.text_encoders["text_encoder"], components.tokenizers["tokenizer"])


def _assert_close(a, b, atol=1e-5):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("with_metadata", [False, True])
def test_diffusers_saved_lora_reads_as_diffusers_reads_it(tiny_base, tmp_path, with_metadata):
    adapted, unet_config, text_config = _randomized_lora(tiny_base)
    configs = (unet_config, text_config) if with_metadata else ()
    path = _save_as_diffusers_example(adapted, tmp_path, *configs)
    tensors, lora_configs, config_toml = read_adapter(path)
    assert config_toml == ""
    assert lora_configs["unet.r"] == RANK and lora_configs["text_encoder.r"] == RANK
    # Without metadata diffusers takes alpha = rank, and so do we; with it, the file's alpha.
    assert lora_configs["unet.lora_alpha"] == (ALPHA if with_metadata else RANK)
    assert all(k.endswith(("lora_A.weight", "lora_B.weight")) for k in tensors)
    _assert_close(_difftune_outputs(tiny_base, path), _diffusers_reference(tiny_base, path))
    if with_metadata:  # the file says what the trained model was: both readers reproduce it
        _assert_close(
            _difftune_outputs(tiny_base, path),
            _outputs(adapted.denoiser, adapted.text_encoders["text_encoder"], adapted.tokenizers["tokenizer"]),
        )


def test_diffusers_saved_lora_converts_to_kohya_and_back_losslessly(tiny_base, tmp_path):
    adapted, unet_config, text_config = _randomized_lora(tiny_base)
    original = _save_as_diffusers_example(adapted, tmp_path, unet_config, text_config)
    kohya, back = tmp_path / "kohya.safetensors", tmp_path / "back.safetensors"
    assert main(["convert", str(original), str(kohya), "--to", "kohya", "--base", str(tiny_base)]) == 0
    assert main(["convert", str(kohya), str(back), "--to", "diffusers", "--base", str(tiny_base)]) == 0
    before, before_configs, _ = read_adapter(original)
    after, after_configs, _ = read_adapter(back)
    assert before.keys() == after.keys()
    # The diffusers layout holds the change in its tensors: alpha / rank (2, exact in fp32) folded into lora_B.
    for key in before:
        expected = before[key] * (ALPHA / RANK) if key.endswith("lora_B.weight") else before[key]
        assert torch.equal(expected, after[key]), key
    for part in ("unet", "text_encoder"):
        assert (after_configs[f"{part}.r"], after_configs[f"{part}.lora_alpha"]) == (RANK, RANK)
        assert before_configs[f"{part}.use_dora"] == after_configs[f"{part}.use_dora"]
    with safe_open(back, framework="pt") as handle:
        assert json.loads(handle.metadata()[export.FOLDED_ALPHA_KEY])["unet"]["lora_alpha"] == ALPHA
    with safe_open(kohya, framework="pt") as handle:
        metadata = handle.metadata()
    assert metadata["ss_network_dim"] == str(RANK) and metadata["ss_network_alpha"] == str(ALPHA)
    assert metadata["ss_sd_model_name"] == tiny_base.name and "ss_max_train_steps" not in metadata
    # diffusers' own kohya reader, on our kohya file, gives what the original file gives.
    _assert_close(_diffusers_reference(tiny_base, kohya), _diffusers_reference(tiny_base, original))


def _hand_built_kohya(tiny_base, path, dtype=torch.float16):
    """A kohya sd-scripts style file built key by key: fp16, `.alpha` != rank, text encoder `lora_te_text_model_*`,
    no metadata at all."""
    components = load_components(ModelConfig(base=str(tiny_base)))
    generator = torch.Generator().manual_seed(5)
    tensors = {}
    unet_linears = [
        n
        for n, m in components.denoiser.named_modules()
        if isinstance(m, torch.nn.Linear) and n.endswith(("to_k", "to_out.0"))
    ]
    text_linears = [
        n
        for n, m in components.text_encoders["text_encoder"].named_modules()
        if isinstance(m, torch.nn.Linear) and n.endswith(("k_proj", "out_proj"))
    ]
    for prefix, model, names in (
        ("lora_unet_", components.denoiser, unet_linears),
        ("lora_te_text_model_", components.text_encoders["text_encoder"], text_linears),
    ):
        for name in names:
            layer = model.get_submodule(name)
            key = prefix + name.replace(".", "_")
            tensors[f"{key}.lora_down.weight"] = (torch.randn(RANK, layer.in_features, generator=generator) * 0.3).to(
                dtype
            )
            tensors[f"{key}.lora_up.weight"] = (torch.randn(layer.out_features, RANK, generator=generator) * 0.3).to(
                dtype
            )
            tensors[f"{key}.alpha"] = torch.tensor(2.0, dtype=dtype)
    save_file(tensors, path)
    return path


def test_hand_built_kohya_file_reads_as_diffusers_reads_it(tiny_base, tmp_path):
    path = _hand_built_kohya(tiny_base, tmp_path / "shared.safetensors")
    with pytest.raises(DifftuneError, match=r"needs --base"):
        export.convert_adapter(path, tmp_path / "x.safetensors", "diffusers")
    tensors, lora_configs, _ = export.read_any_adapter(path, str(tiny_base))
    assert lora_configs["unet.r"] == RANK and lora_configs["unet.lora_alpha"] == 2.0
    assert lora_configs["text_encoder.lora_alpha"] == 2.0
    _assert_close(_difftune_outputs(tiny_base, path), _diffusers_reference(tiny_base, path), atol=1e-3)


def test_merge_sample_average_and_eval_take_other_tools_files(tiny_base, tmp_path, capsys):
    adapted, _, _ = _randomized_lora(tiny_base)
    diffusers_file = _save_as_diffusers_example(adapted, tmp_path)
    kohya_file = _hand_built_kohya(tiny_base, tmp_path / "kohya.safetensors")
    base = str(tiny_base)
    assert (
        main(
            [
                "merge",
                "--base",
                base,
                "--adapter",
                str(diffusers_file),
                "--adapter",
                f"{kohya_file}:0.5",
                "--out",
                str(tmp_path / "merged"),
            ]
        )
        == 0
    )
    merged = StableDiffusionPipeline.from_pretrained(tmp_path / "merged", safety_checker=None)
    reference = load_components(ModelConfig(base=base))
    export.apply_adapters(reference, [(diffusers_file, 1.0), (kohya_file, 0.5)])
    _assert_close(
        _outputs(merged.unet, merged.text_encoder, merged.tokenizer),
        _outputs(reference.denoiser, reference.text_encoders["text_encoder"], reference.tokenizers["tokenizer"]),
        atol=1e-4,
    )
    assert (
        main(
            [
                "sample",
                "--base",
                base,
                "--adapter",
                str(kohya_file),
                "--prompt",
                "a red circle",
                "--steps",
                "2",
                "--resolution",
                "32",
                "--out",
                str(tmp_path / "samples"),
            ]
        )
        == 0
    )
    assert (tmp_path / "samples" / "000.png").is_file()
    said = capsys.readouterr().out  # the merge and the sampling each say what they do, then how long it took
    assert re.search(r"^difftune: merging 2 adapter\(s\) into .*: done in \d", said, re.M), said
    assert re.search(r"^difftune: loading .* with 1 adapter\(s\): done in \d", said, re.M), said
    # In bf16 (a GPU's default: a large base in fp32 is twice the memory) the same sample, to bf16's rounding.
    assert (
        main(
            [
                "sample",
                "--base",
                base,
                "--adapter",
                str(kohya_file),
                "--prompt",
                "a red circle",
                "--steps",
                "2",
                "--resolution",
                "32",
                "--out",
                str(tmp_path / "samples_bf16"),
                "--dtype",
                "bf16",
            ]
        )
        == 0
    )
    full, half = (
        np.asarray(Image.open(tmp_path / folder / "000.png"), np.int16) for folder in ("samples", "samples_bf16")
    )
    assert 0 < np.abs(full - half).mean() < 4, np.abs(full - half).mean()
    second = _save_as_diffusers_example(_randomized_lora(tiny_base, seed=1)[0], tmp_path / "second")
    assert main(["average", str(diffusers_file), str(second), "--out", str(tmp_path / "avg.safetensors")]) == 0
    averaged = load_file(tmp_path / "avg.safetensors")
    first_tensors, second_tensors = read_adapter(diffusers_file)[0], read_adapter(second)[0]
    for key, value in averaged.items():
        torch.testing.assert_close(value, (first_tensors[key] + second_tensors[key]) / 2)
    report = tmp_path / "eval.json"
    capsys.readouterr()
    assert (
        main(
            [
                "eval",
                "--base",
                base,
                "--adapter",
                str(kohya_file),
                "--samples-per-prompt",
                "1",
                "--steps",
                "2",
                "--out",
                str(report),
            ]
        )
        == 0
    )
    assert "after" in json.loads(report.read_text())
    # Each prompt is said on stderr as it starts (an eval ran 36 minutes without a word); stdout is the report alone.
    said = capsys.readouterr()
    assert json.loads(said.out) == json.loads(report.read_text())
    lines = said.err.splitlines()
    assert (
        lines[0] == "difftune eval: base: seen 1/12 a red circle"
        and "difftune eval: adapted: concept 3/3 a purple triangle" in lines
    )
    assert len([line for line in lines if line.startswith("difftune eval: ")]) == 2 * (12 + 3)


def test_keys_that_cannot_be_placed_are_named(tiny_base, tmp_path):
    unknown_kind = tmp_path / "ia3.safetensors"
    save_file({"unet.down_blocks.0.attentions.0.proj_in.ia3_l": torch.ones(2, 2)}, unknown_kind)
    with pytest.raises(DifftuneError, match=r"cannot place key unet\.down_blocks\.0\.attentions\.0\.proj_in\.ia3_l"):
        read_adapter(unknown_kind)
    loha_without_config = tmp_path / "loha.safetensors"
    save_file({"unet.down_blocks.0.attentions.0.proj_in.hada_w1_a": torch.ones(2, 2)}, loha_without_config)
    with pytest.raises(DifftuneError, match=r"hada_w1_a is a LoHa/LoKr tensor in peft's layout without its"):
        read_adapter(loha_without_config)
    other_model = tmp_path / "other.safetensors"
    save_file(
        {
            "unet.mid_block.no_such.to_q.lora_A.weight": torch.ones(4, 8),
            "unet.mid_block.no_such.to_q.lora_B.weight": torch.zeros(8, 4),
        },
        other_model,
    )
    with pytest.raises(
        DifftuneError, match=r"unet\.mid_block\.no_such\.to_q\.lora_A\.weight: the base model's unet has no module"
    ):
        export.apply_adapters(load_components(ModelConfig(base=str(tiny_base))), [(other_model, 1.0)])
    kohya_other = tmp_path / "kohya_other.safetensors"
    save_file(
        {
            "lora_unet_no_such_block_to_q.lora_down.weight": torch.ones(4, 8),
            "lora_unet_no_such_block_to_q.lora_up.weight": torch.zeros(8, 4),
            "lora_unet_conv_in.lora_down.weight": torch.ones(4, 4, 3, 3),
            "lora_unet_conv_in.lora_up.weight": torch.zeros(32, 4, 1, 1),
        },
        kohya_other,
    )
    with pytest.raises(
        DifftuneError,
        match=r"lora_unet_no_such_block_to_q\.lora_down\.weight: 'lora_unet_no_such_block_to_q' "
        r"is not a module of the base, in diffusers' names or the original \(SGM/LDM\) ones; "
        r"1 of the file's 2 modules are not .* made for a model of another architecture",
    ):
        export.read_any_adapter(kohya_other, str(tiny_base))
    other_part = tmp_path / "kohya_te2.safetensors"
    te2 = "lora_te2_text_model_encoder_layers_0_mlp_fc1"
    save_file({f"{te2}.lora_down.weight": torch.ones(4, 8), f"{te2}.lora_up.weight": torch.zeros(8, 4)}, other_part)
    with pytest.raises(
        DifftuneError,
        match=r"its prefix names a part this model family does not have \(its prefixes: "
        r"lora_unet_, lora_te_\); the file is for another kind of model",
    ):
        export.read_any_adapter(other_part, str(tiny_base))
    not_safetensors = tmp_path / "adapter.safetensors"
    not_safetensors.write_bytes(b"PK\x03\x04 a zip, not safetensors")
    with pytest.raises(DifftuneError, match=r"not a readable safetensors file"):
        read_adapter(not_safetensors)


# kohya sd-scripts trains SDXL on its own copy of the original (SGM) UNet, and names its LoRA modules after it.


def _sdxl_unet_outputs(unet):
    latents, timesteps, states = unet_inputs(unet)
    pooled = torch.randn(
        latents.shape[0],
        unet.config.projection_class_embeddings_input_dim - 6 * unet.config.addition_time_embed_dim,
        generator=torch.Generator().manual_seed(1),
    )
    time_ids = torch.tensor([[32.0, 32.0, 0.0, 0.0, 32.0, 32.0]]).repeat(latents.shape[0], 1)
    with torch.no_grad():
        return unet(latents, timesteps, states, added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample


def test_a_kohya_sdxl_lora_in_original_block_names_reads_as_diffusers_reads_it(tiny_sdxl_base, tmp_path):
    """`lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_k`-style keys (attention and resnet layers): difftune
    applies them where diffusers' own loader does, and reads the same adapter as from diffusers-named keys."""
    from diffusers import StableDiffusionXLPipeline

    from difftune.models import single_file

    adapted = load_components(ModelConfig(base=str(tiny_sdxl_base)))
    adapted.denoiser.add_adapter(
        LoraConfig(
            r=RANK,
            lora_alpha=ALPHA,
            target_modules=[
                "to_q",
                "to_k",
                "to_v",
                "to_out.0",
                "proj_in",
                "proj_out",
                "ff.net.2",
                "conv1",
                "conv2",
                "time_emb_proj",
            ],
        )
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in adapted.denoiser.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    tensors = {f"unet.{key}": value for key, value in get_peft_model_state_dict(adapted.denoiser).items()}
    configs = {f"unet.{field}": value for field, value in adapted.denoiser.peft_config["default"].to_dict().items()}
    diffusers_named = family_to_kohya(adapted.family, tensors, configs)
    original = {
        diffusers: sgm
        for sgm, diffusers in single_file.unet_ldm_module_names(
            [name for name, _ in adapted.denoiser.named_modules()]
        ).items()
    }
    renamed = {}
    for key, value in diffusers_named.items():
        module, _, kind = key.removeprefix("lora_unet_").partition(".")
        diffusers_module = next(name for name in original if name.replace(".", "_") == module)
        renamed[f"lora_unet_{original[diffusers_module].replace('.', '_')}.{kind}"] = value
    assert "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_k.lora_down.weight" in renamed
    assert "lora_unet_output_blocks_0_0_in_layers_2.lora_down.weight" in renamed
    path = tmp_path / "sgm.safetensors"
    save_file({key: value.contiguous() for key, value in renamed.items()}, path)

    ours = load_components(ModelConfig(base=str(tiny_sdxl_base)))
    export.apply_adapters(ours, [(path, 1.0)])
    pipeline = StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_base, dtype=torch.float32)
    pipeline.load_lora_weights(str(tmp_path), weight_name=path.name)
    expected = _sdxl_unet_outputs(adapted.denoiser)
    torch.testing.assert_close(_sdxl_unet_outputs(pipeline.unet), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(_sdxl_unet_outputs(ours.denoiser), expected, rtol=1e-4, atol=1e-5)
    save_file(diffusers_named, tmp_path / "diffusers_named.safetensors")
    read_sgm, configs_sgm, _ = export.read_any_adapter(path, str(tiny_sdxl_base))
    read_diffusers, configs_diffusers, _ = export.read_any_adapter(
        tmp_path / "diffusers_named.safetensors", str(tiny_sdxl_base)
    )
    assert configs_sgm == configs_diffusers and read_sgm.keys() == read_diffusers.keys()
    assert all(torch.equal(read_sgm[key], read_diffusers[key]) for key in read_sgm)


def test_original_unet_names_are_those_diffusers_maps_for_every_layer_of_an_sdxl_unet():
    """Every linear and convolution layer of an SDXL-shaped UNet (two layers per block, attention in the lower two
    levels, SDXL's conditioning): the original name difftune gives it is the one diffusers' own kohya reader maps back
    to that layer, pair by pair."""
    from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
    from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft

    from difftune.models import single_file

    unet = UNet2DConditionModel(
        sample_size=8,
        layers_per_block=2,
        block_out_channels=(32, 64, 64),
        cross_attention_dim=32,
        attention_head_dim=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 2),
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + 32,
        use_linear_projection=True,
        norm_num_groups=32,
    )
    layers = {
        name: module for name, module in unet.named_modules() if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d))
    }
    original = single_file.unet_ldm_module_names(list(layers))
    assert (
        original["input_blocks.4.1.transformer_blocks.0.attn1.to_k"]
        == "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_k"
    )
    assert (
        original["middle_block.1.transformer_blocks.1.attn2.to_v"]
        == "mid_block.attentions.0.transformer_blocks.1.attn2.to_v"
    )
    kohya = {}
    for index, (sgm, name) in enumerate(
        original.items()
    ):  # each layer's lora_down holds its index: pairs, not only sets
        weight, spatial = layers[name].weight, (1, 1) if layers[name].weight.ndim == 4 else ()
        kohya[f"lora_unet_{sgm.replace('.', '_')}.lora_down.weight"] = torch.full(
            (1, weight.shape[1], *spatial), float(index)
        )
        kohya[f"lora_unet_{sgm.replace('.', '_')}.lora_up.weight"] = torch.zeros(weight.shape[0], 1, *spatial)
    state, _ = StableDiffusionXLPipeline.lora_state_dict(kohya, unet_config=unet.config)
    peft = convert_unet_state_dict_to_peft({key.removeprefix("unet."): value for key, value in state.items()})
    diffusers_reads = {
        key.removesuffix(".lora_A.weight"): int(value.flatten()[0])
        for key, value in peft.items()
        if key.endswith(".lora_A.weight")
    }
    assert diffusers_reads == {name: index for index, name in enumerate(original.values())}
