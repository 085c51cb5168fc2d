"""Deployment: merge, single-file checkpoints, the kohya layout and sampling, checked by re-loading."""

import json

import pytest
import torch
from diffusers import StableDiffusionPipeline
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from difftune.adapters import export
from difftune.adapters.files import is_kohya
from difftune.adapters.trained import adapter_state_dict, add_adapters
from difftune.cli import main
from difftune.config import ModelConfig, load_config
from difftune.errors import DifftuneError
from difftune.families import load_components

from conftest import unet_inputs

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "conv1", "proj_in"]


def _make_adapter(tiny_base, path, kind, layout="diffusers", seed=0):
    """An adapter with random (non-identity) weights on the UNet and the text encoder, written to `path`."""
    config = load_config(
        None,
        [
            f"model.base={tiny_base}",
            f"adapter.kind={kind}",
            "adapter.rank=4",
            "adapter.alpha=8",
            "adapter.text_encoder=true",
            f"adapter.target_modules={json.dumps(TARGETS)}",
            "data.resolution=32",
        ],
    )
    components = load_components(config.model)
    add_adapters(components, config.adapter)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in [
            *components.denoiser.named_parameters(),
            *components.text_encoders["text_encoder"].named_parameters(),
        ]:
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
            elif "lora_magnitude" in name:
                param.mul_(1 + 0.1 * torch.rand(param.shape, generator=generator))
    tensors, lora_configs = adapter_state_dict(components, config.adapter)
    export.write_adapter(path, tensors, lora_configs, config.to_toml(), layout)
    return components


def _outputs(components):
    """UNet and text-encoder outputs on fixed inputs."""
    latents, timesteps, states = unet_inputs(components.denoiser)
    ids = components.tokenizers["tokenizer"](
        ["a red circle", "a blue square"], padding="max_length", return_tensors="pt"
    ).input_ids
    with torch.no_grad():
        return components.denoiser(latents, timesteps, states).sample, components.text_encoders["text_encoder"](ids)[0]


def _assert_same_outputs(a, b, atol=1e-5):
    for x, y in zip(_outputs(a), _outputs(b), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_adapter_file_reproduces_the_adapted_model(tiny_base, tmp_path, kind):
    adapted = _make_adapter(tiny_base, tmp_path / "a.safetensors", kind)
    loaded = load_components(ModelConfig(base=str(tiny_base)))
    export.apply_adapters(loaded, [(tmp_path / "a.safetensors", 1.0)])
    _assert_same_outputs(adapted, loaded)


@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_merged_model_equals_the_adapted_model(tiny_base, tmp_path, kind, scale):
    adapter = tmp_path / "a.safetensors"
    _make_adapter(tiny_base, adapter, kind)
    adapted = load_components(ModelConfig(base=str(tiny_base)))
    export.apply_adapters(adapted, [(adapter, scale)])
    merged = load_components(ModelConfig(base=str(tiny_base)))
    export.merge_adapters(merged, [(adapter, scale)])
    assert not any("lora" in key for key in merged.denoiser.state_dict())
    _assert_same_outputs(adapted, merged, atol=2e-5)
    base = load_components(ModelConfig(base=str(tiny_base)))
    assert (_outputs(merged)[0] - _outputs(base)[0]).abs().max() > 1e-3


def test_merge_command_writes_a_pipeline_and_a_single_file(tiny_base, tmp_path):
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    _make_adapter(tiny_base, first, "lora", seed=1)
    _make_adapter(tiny_base, second, "dora", seed=2)
    out = tmp_path / "merged"
    args = [
        "merge",
        "--base",
        str(tiny_base),
        "--adapter",
        f"{first}:0.7",
        "--adapter",
        f"{second}:0.5",
        "--out",
        str(out),
    ]
    assert main([*args, "--single-file"]) == 0

    expected = load_components(ModelConfig(base=str(tiny_base)))
    export.apply_adapters(expected, [(first, 0.7), (second, 0.5)])
    folder = load_components(ModelConfig(base=str(out)))
    _assert_same_outputs(expected, folder, atol=3e-5)

    single = StableDiffusionPipeline.from_single_file(
        str(out / "model.safetensors"), config=str(tiny_base), safety_checker=None, dtype=torch.float32
    )
    single_parts = load_components(ModelConfig(base=str(out)))
    single_parts.denoiser, single_parts.text_encoders["text_encoder"], single_parts.vae = (
        single.unet,
        single.text_encoder,
        single.vae,
    )
    _assert_same_outputs(folder, single_parts, atol=0)
    # A pickled copy loads only when allowed, and then tensors-only.
    torch.save({"state_dict": load_file(out / "model.safetensors")}, tmp_path / "model.ckpt")
    with pytest.raises(DifftuneError, match="allow_pickled_checkpoint"):
        load_components(ModelConfig(base=str(tmp_path / "model.ckpt"), single_file_config=str(tiny_base)))
    trusted = ModelConfig(
        base=str(tmp_path / "model.ckpt"), single_file_config=str(tiny_base), allow_pickled_checkpoint=True
    )
    _assert_same_outputs(folder, load_components(trusted), atol=0)
    # ...and difftune trains from it: model.base may be a single file, its architecture from a local folder.
    _assert_same_outputs(
        folder,
        load_components(ModelConfig(base=str(out / "model.safetensors"), single_file_config=str(tiny_base))),
        atol=0,
    )
    pixels = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(single.vae(pixels).sample, folder.vae(pixels).sample, rtol=0, atol=0)
    with safe_open(out / "model.safetensors", framework="pt") as handle:
        keys = set(handle.keys())
    # Every tensor of the folder is in the single file, under the original names A1111/ComfyUI expect.
    assert len(keys) == sum(
        len(m.state_dict()) for m in (folder.denoiser, folder.vae, folder.text_encoders["text_encoder"])
    )
    assert any(k.startswith("cond_stage_model.transformer.text_model.encoder.layers.") for k in keys)
    assert (
        "model.diffusion_model.input_blocks.0.0.weight" in keys
        and "first_stage_model.decoder.up.0.block.0.conv1.weight" in keys
    )

    assert main(args) == 2  # refuses to overwrite what is there
    assert main([*args, "--dtype", "fp16", "--overwrite"]) == 0
    assert load_components(ModelConfig(base=str(out))).denoiser.conv_in.weight.dtype == torch.float32  # loads as fp32
    with safe_open(out / "unet" / "diffusion_pytorch_model.safetensors", framework="pt") as handle:
        assert handle.get_tensor("conv_in.weight").dtype == torch.float16


def test_non_finite_adapter_is_refused_before_writing(tiny_base, tmp_path):
    adapter = tmp_path / "a.safetensors"
    _make_adapter(tiny_base, adapter, "lora")
    with safe_open(adapter, framework="pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(adapter)
    key = next(k for k in tensors if "lora_B" in k)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, adapter, metadata=metadata)
    out = tmp_path / "merged"
    with pytest.raises(DifftuneError, match=r"NaN or inf .*nothing was written"):
        export.merge_adapters(load_components(ModelConfig(base=str(tiny_base))), [(adapter, 1.0)])
    assert main(["merge", "--base", str(tiny_base), "--adapter", str(adapter), "--out", str(out)]) == 2
    assert not out.exists()


def test_fp16_overflow_in_the_merge_is_refused(tiny_base, tmp_path):
    adapter = tmp_path / "a.safetensors"
    _make_adapter(tiny_base, adapter, "lora")
    with pytest.raises(DifftuneError, match=r"the merged model in fp16: NaN or inf in \d+ tensors"):
        export.merge_adapters(load_components(ModelConfig(base=str(tiny_base))), [(adapter, 1e6)], dtype="fp16")


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_kohya_round_trip_is_exact(tiny_base, tmp_path, kind):
    original = tmp_path / "diffusers.safetensors"
    _make_adapter(tiny_base, original, kind)
    kohya, back = tmp_path / "kohya.safetensors", tmp_path / "back.safetensors"
    assert main(["convert", str(original), str(kohya), "--to", "kohya"]) == 0
    assert main(["convert", str(kohya), str(back), "--to", "diffusers", "--base", str(tiny_base)]) == 0
    before, after = load_file(original), load_file(back)
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    configs = [json.loads(safe_open(p, framework="pt").metadata()["lora_adapter_metadata"]) for p in (original, back)]
    for part in ("unet", "text_encoder"):
        for field in ("r", "lora_alpha", "use_dora"):
            assert configs[0][f"{part}.{field}"] == configs[1][f"{part}.{field}"]
    loaded = [load_components(ModelConfig(base=str(tiny_base))) for _ in range(2)]
    export.apply_adapters(loaded[0], [(original, 1.0)])
    export.apply_adapters(loaded[1], [(back, 1.0)])
    _assert_same_outputs(*loaded, atol=0)


def test_kohya_keys_and_metadata(tiny_base, tmp_path):
    path = tmp_path / "kohya.safetensors"
    _make_adapter(tiny_base, path, "dora", layout="kohya")
    with safe_open(path, framework="pt") as handle:
        metadata, tensors = handle.metadata(), {k: handle.get_tensor(k) for k in handle.keys()}
    te_modules = {k.split(".")[0] for k in tensors if k.startswith("lora_te_")}
    assert te_modules and all(m.startswith("lora_te_text_model_encoder_layers_") for m in te_modules)
    assert all(k.startswith(("lora_unet_", "lora_te_")) for k in tensors)
    linear = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    conv = "lora_unet_down_blocks_0_resnets_0_conv1"
    assert tensors[f"{linear}.dora_scale"].shape == (tensors[f"{linear}.lora_up.weight"].shape[0], 1)
    assert tensors[f"{conv}.dora_scale"].shape == (tensors[f"{conv}.lora_up.weight"].shape[0], 1, 1, 1)
    assert tensors[f"{linear}.alpha"].item() == 8.0
    assert metadata["ss_network_dim"] == "4" and metadata["ss_network_alpha"] == "8.0"
    assert (
        metadata["ss_network_module"] == "lycoris.kohya"
        and json.loads(metadata["ss_network_args"])["dora_wd"] == "True"
    )
    assert metadata["ss_base_model_version"] == "sd_v1" and metadata["ss_resolution"] == "(32, 32)"


def test_kohya_lora_loads_in_diffusers_own_reader(tiny_base, tmp_path):
    """diffusers' kohya converter is an independent reader of the layout: same outputs, every key consumed."""
    ours = _make_adapter(tiny_base, tmp_path / "kohya.safetensors", "lora", layout="kohya")
    pipeline = StableDiffusionPipeline.from_pretrained(tiny_base, safety_checker=None, dtype=torch.float32)
    pipeline.load_lora_weights(str(tmp_path), weight_name="kohya.safetensors")
    theirs = load_components(ModelConfig(base=str(tiny_base)))
    theirs.denoiser, theirs.text_encoders["text_encoder"] = pipeline.unet, pipeline.text_encoder
    _assert_same_outputs(ours, theirs)
    written = load_file(tmp_path / "kohya.safetensors")
    loaded_pairs = sum("lora_A" in k for m in (pipeline.unet, pipeline.text_encoder) for k in m.state_dict())
    assert loaded_pairs == sum(k.endswith("lora_down.weight") for k in written)


def test_kohya_dora_scale_follows_the_dora_formula(tiny_base, tmp_path):
    """W' = dora_scale * (W + alpha/r * up @ down) / ||W + alpha/r * up @ down||, norm per output row."""
    path = tmp_path / "kohya.safetensors"
    _make_adapter(tiny_base, path, "dora", layout="kohya")
    kohya = load_file(path)
    merged = load_components(ModelConfig(base=str(tiny_base)))
    export.merge_adapters(merged, [(path, 1.0)])
    base = load_components(ModelConfig(base=str(tiny_base)))
    name = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    key = "lora_unet_" + name.replace(".", "_")
    weight = base.denoiser.get_submodule(name).weight
    down, up, alpha = kohya[f"{key}.lora_down.weight"], kohya[f"{key}.lora_up.weight"], kohya[f"{key}.alpha"]
    direction = weight + alpha / down.shape[0] * up @ down
    expected = kohya[f"{key}.dora_scale"] * direction / direction.norm(dim=1, keepdim=True)
    torch.testing.assert_close(merged.denoiser.get_submodule(name).weight, expected, rtol=1e-5, atol=1e-6)


def test_training_can_write_kohya_directly(make_config, tiny_base, tmp_path):
    from difftune.training.train import train

    result_path = train(make_config(export__format="kohya", train__output_dir=str(tmp_path / "job"))).trained_path
    assert result_path == tmp_path / "job" / "job.safetensors"
    assert is_kohya(load_file(result_path))
    pipeline = StableDiffusionPipeline.from_pretrained(tiny_base, safety_checker=None, dtype=torch.float32)
    pipeline.load_lora_weights(str(result_path.parent), weight_name=result_path.name)
    assert any("lora_A" in k for k in pipeline.unet.state_dict())


def test_kohya_files_name_the_version_of_their_base(make_config, tiny_base, tmp_path):
    """`ss_base_model_version` (A1111 lists a LoRA under the versions it names) is the base's: an SD 2.x-shaped base
    (1024-wide text states, OpenCLIP-H's, and a v-prediction schedule) trains `sd_v2_v` adapters, not `sd_v1` ones."""
    from diffusers import DDPMScheduler, UNet2DConditionModel

    from difftune.families import FAMILIES
    from difftune.toy.micro import build_pipeline
    from difftune.toy.tiny import build_text_encoder
    from difftune.training.train import train

    pipeline = build_pipeline(seed=1, family="sd")
    pipeline.text_encoder = build_text_encoder(hidden_size=1024)
    pipeline.unet = UNet2DConditionModel.from_config(
        pipeline.unet.config, cross_attention_dim=1024, use_linear_projection=True
    )
    pipeline.scheduler = DDPMScheduler.from_config(pipeline.scheduler.config, prediction_type="v_prediction")
    pipeline.register_modules(text_encoder=pipeline.text_encoder, unet=pipeline.unet, scheduler=pipeline.scheduler)
    sd2 = tmp_path / "tiny-sd2"
    pipeline.save_pretrained(sd2, safe_serialization=True)
    result = train(
        make_config(
            model__base=str(sd2),
            export__format="kohya",
            train__max_steps=1,
            train__output_dir=str(tmp_path / "sd2-job"),
        )
    )
    with safe_open(result.trained_path, framework="pt") as handle:
        assert handle.metadata()["ss_base_model_version"] == "sd_v2_v"
    sd1 = tmp_path / "sd1.safetensors"
    _make_adapter(tiny_base, sd1, "lora")  # a diffusers-layout file whose config names tiny_base
    export.convert_adapter(sd1, tmp_path / "sd1_kohya.safetensors", "kohya")
    with safe_open(tmp_path / "sd1_kohya.safetensors", framework="pt") as handle:
        assert handle.metadata()["ss_base_model_version"] == "sd_v1"
    assert (
        main(
            [
                "merge",
                "--base",
                str(sd2),
                "--adapter",
                str(result.trained_path),
                "--out",
                str(tmp_path / "merged"),
                "--single-file",
            ]
        )
        == 0
    )
    assert (
        FAMILIES["sd"].layout.base_model_version(ModelConfig(base=str(tmp_path / "merged" / "model.safetensors")))
        == "sd_v2"
    )
    assert FAMILIES["sd"].layout.base_model_version(ModelConfig(base=str(tmp_path / "no-such-base"))) is None


def test_sample_command_writes_reproducible_images(tiny_base, tmp_path):
    adapter = tmp_path / "a.safetensors"
    _make_adapter(tiny_base, adapter, "lora")
    common = [
        "sample",
        "--base",
        str(tiny_base),
        "--adapter",
        f"{adapter}:0.8",
        "--prompt",
        "a red circle",
        "--prompt",
        "a blue square",
        "--steps",
        "3",
        "--seed",
        "5",
        "--guidance-scale",
        "2",
        "--scheduler",
        "euler_a",
        "--images-per-prompt",
        "2",
        "--negative-prompt",
        "blurry",
    ]
    assert main([*common, "--out", str(tmp_path / "one")]) == 0
    assert main([*common, "--out", str(tmp_path / "two")]) == 0
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == ["000.png", "001.png", "002.png", "003.png", "grid.png"]
    with Image.open(tmp_path / "one" / "002.png") as image, Image.open(tmp_path / "two" / "002.png") as again:
        assert image.text["prompt"] == "a blue square"
        assert "seed=7" in image.text["parameters"] and "scheduler=euler_a" in image.text["parameters"]
        assert "negative_prompt='blurry'" in image.text["parameters"] and "steps=3" in image.text["parameters"]
        assert image.size == (32, 32)
        assert list(image.getdata()) == list(again.getdata())
    with Image.open(tmp_path / "one" / "000.png") as first, Image.open(tmp_path / "one" / "001.png") as second:
        assert list(first.getdata()) != list(second.getdata())  # the next seed, a different image


def test_sample_command_errors(tiny_base, tmp_path, capsys):
    assert main(["sample", "--base", str(tiny_base), "--out", str(tmp_path)]) == 2
    assert "give at least one --prompt" in capsys.readouterr().err
    assert main(["sample", "--base", str(tiny_base), "--out", str(tmp_path), "--prompt", "x", "--steps", "0"]) == 2
    assert "sample.steps: Input should be greater than or equal to 1" in capsys.readouterr().err


def test_sample_with_a_taesd_decoder(tiny_base, tmp_path):
    from difftune.toy.tiny import build_taesd

    torch.manual_seed(0)
    build_taesd().save_pretrained(tmp_path / "taesd")
    common = ["sample", "--base", str(tiny_base), "--prompt", "a red circle", "--steps", "2", "--seed", "3"]
    assert main([*common, "--out", str(tmp_path / "vae")]) == 0
    assert main([*common, "--decoder", str(tmp_path / "taesd"), "--out", str(tmp_path / "taesd_out")]) == 0
    with Image.open(tmp_path / "vae" / "000.png") as full, Image.open(tmp_path / "taesd_out" / "000.png") as fast:
        assert fast.size == full.size == (32, 32)
        assert f"decoder={tmp_path / 'taesd'}" in fast.text["parameters"]
        assert list(fast.getdata()) != list(full.getdata())  # decoded by the other autoencoder


@pytest.mark.parametrize(
    ("kind", "layout", "extra"),
    [
        ("lora", "diffusers", {}),
        ("dora", "kohya", {}),
        ("none", "diffusers", {}),
        (
            "dora",
            "diffusers",
            {"adapter__alpha": 2.0},
        ),  # alpha / rank (0.5) folded into a DoRA's lora_B: the same weights
        # trained on a base with its principal part taken out, saved as the change on the untouched one
        ("lora", "kohya", {"adapter__init": "pissa", "adapter__rank_stabilized": True}),
    ],
)
def test_saved_result_reloads_to_the_in_training_sample(make_config, tmp_path, kind, layout, extra, capsys):
    from difftune.training.train import train

    config = make_config(
        adapter__kind=kind,
        adapter__text_encoder=True,
        export__format=layout,
        train__max_steps=4,
        sample__prompts=["a red circle"],
        sample__steps=3,
        **extra,
    )
    train(config)
    report = json.loads((tmp_path / "run" / "parity.json").read_text())
    expected = {"model"} if kind == "none" else {"diffusers", "kohya"}
    assert set(report["layouts"]) == expected
    assert report["prompt"] == "a red circle" and report["seed"] == 0
    assert all(result["max_pixel_difference"] <= report["warn_above_levels"] for result in report["layouts"].values())
    assert "warning" not in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["lora", "dora", "none", "embedding"])
def test_a_bf16_run_reloads_to_its_sample_exactly(make_config, tmp_path, kind, capsys):
    """In bf16 the reload draws what training drew, level for level: its adapters kept in fp32 and the trained parts'
    outputs in fp32 as Accelerate's prepared modules return them, the released encoders brought back in the run's
    dtype (the text cache releases them), a full fine-tune's trained parts in fp32. Before, every bf16 run drew 9 to 41
    levels away and warned; textual inversion in bf16 stopped at its first step (its frozen denoiser met fp32 inputs
    outside Accelerate's autocast)."""
    from difftune.training.train import train

    embedding = (
        {"adapter__embedding_token": "<prp>", "adapter__embedding_caption_word": "red"} if kind == "embedding" else {}
    )
    train(
        make_config(
            adapter__kind=kind,
            adapter__text_encoder=kind != "lora",
            train__mixed_precision="bf16",
            train__max_steps=3,
            cache__text=kind == "lora",
            sample__prompts=["a purple circle"],
            sample__steps=3,
            **embedding,
        )
    )
    report = json.loads((tmp_path / "run" / "parity.json").read_text())
    assert report["layouts"] and all(result["max_pixel_difference"] == 0 for result in report["layouts"].values()), (
        report
    )
    assert "warning" not in capsys.readouterr().out


def test_a_reload_that_loses_the_adapter_is_reported(make_config, tmp_path, monkeypatch, capsys):
    from difftune.training import parity
    from difftune.training.train import train

    real_apply = export.apply_adapters
    monkeypatch.setattr(
        parity.export,
        "apply_adapters",
        lambda components, adapters: real_apply(components, [(p, 0.0) for p, _ in adapters]),
    )
    config = make_config(
        train__max_steps=6, sample__prompts=["a red circle"], sample__steps=3, optim__learning_rate=1e-2
    )
    train(config)
    report = json.loads((tmp_path / "run" / "parity.json").read_text())
    assert report["layouts"]["diffusers"]["max_pixel_difference"] > report["warn_above_levels"]
    assert (
        "difftune: warning: the diffusers file reloaded in a fresh pipeline draws sample 000" in capsys.readouterr().out
    )


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_written_files_take_the_umasks_mode(make_config, tiny_base, tmp_path, mask):
    """safetensors writes its files 0600; difftune's results take the mode `open()` gives under the umask (0644
    under 022), so a ComfyUI or a web server running as another user reads them: the run's two adapter files and
    checkpoint, and a merged folder and single file."""
    import os
    import stat

    from difftune.training.train import train

    previous = os.umask(mask)
    try:
        result = train(make_config(train__output_dir=str(tmp_path / "job")))
        merged = tmp_path / "merged"
        assert (
            main(
                [
                    "merge",
                    "--base",
                    str(tiny_base),
                    "--adapter",
                    str(result.trained_path),
                    "--out",
                    str(merged),
                    "--single-file",
                ]
            )
            == 0
        )
    finally:
        os.umask(previous)
    written = [*(tmp_path / "job").glob("*.safetensors"), *(tmp_path / "job" / "checkpoints").rglob("*.safetensors")]
    written += [path for path in merged.rglob("*") if path.is_file()]
    assert len(written) >= 4 and any(path.suffix == ".safetensors" for path in merged.rglob("*"))
    for path in written:
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask, path
    for folder in [merged, *[path for path in merged.rglob("*") if path.is_dir()]]:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~mask, folder
