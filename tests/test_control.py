"""ControlNet training (`adapter.kind = "controlnet"`): the step is diffusers' train_controlnet.py's, the saved folder
loads in diffusers' own ControlNet pipeline and draws what difftune drew, cached and uncached runs and resumed ones
match, and what it cannot train with is refused by name."""

import numpy as np
import pytest
import torch
from diffusers import (
    ControlNetModel,
    DDIMScheduler,
    FluxControlNetModel,
    FluxControlNetPipeline,
    FluxControlPipeline,
    QwenImageControlNetModel,
    QwenImageControlNetPipeline,
    SD3ControlNetModel,
    StableDiffusion3ControlNetPipeline,
    StableDiffusionControlNetPipeline,
    StableDiffusionXLControlNetPipeline,
)
from PIL import Image
from safetensors.torch import load_file

from difftune.adapters.export import merge_into_folder
from difftune.config import ModelConfig
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components
from difftune.toy.tiny import placed_shape_pairs, write_pair_folder
from difftune.training.metrics import read_metrics
from difftune.training.train import train


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    """Eight shapes with their silhouettes as control images, in the edit pairs' layout."""
    folder = tmp_path_factory.mktemp("placed")
    write_pair_folder(folder, placed_shape_pairs(8, seed=0))
    return folder


def _controlnet_job(make_config, placed, tmp_path, name="controlnet", **overrides):
    settings = {
        "data__path": str(placed),
        "adapter__kind": "controlnet",
        "adapter__text_encoder": False,
        "train__max_steps": 4,
        "train__output_dir": str(tmp_path / name),
        "optim__learning_rate": 1e-3,
        "sample__prompts": [{"prompt": "a red circle", "controls": [str(placed / "control" / "0000.png")]}],
        "sample__steps": 4,
        **overrides,
    }
    return make_config(**settings)


@pytest.mark.parametrize(
    ("family", "pipeline_class", "arguments"),
    [
        ("sd", StableDiffusionControlNetPipeline, {"safety_checker": None, "feature_extractor": None}),
        ("sdxl", StableDiffusionXLControlNetPipeline, {}),
        ("sd3", StableDiffusion3ControlNetPipeline, {}),
        ("flux", FluxControlNetPipeline, {}),
        ("qwen_image", QwenImageControlNetPipeline, {}),
    ],
)
def test_the_saved_controlnet_draws_in_diffusers_pipeline_what_difftune_drew(
    make_config, placed, micro_base, tmp_path, family, pipeline_class, arguments
):
    """The folder loads with `ControlNetModel.from_pretrained` into the family's diffusers ControlNet pipeline
    (`from_pretrained`: diffusers' own loading, none of difftune's) and draws the run's sample 000 exactly; the run's
    own parity check says 0 too. SDXL's ControlNet reads the UNet's added conditioning (pooled text, sizes) as well."""
    base = micro_base(family)
    # Flux and Qwen-Image at guidance 1: no true classifier-free guidance (their micro bases have no guidance
    # embedding, and difftune's negative pass is the pipelines' `true_cfg_scale`, which the call below leaves out)
    guidance = 1.0 if family in ("flux", "qwen_image") else 3.0
    config = _controlnet_job(make_config, placed, tmp_path, model__base=str(base), sample__guidance_scale=guidance)
    train(config)
    out = tmp_path / "controlnet"
    model_class = {
        "sd": ControlNetModel,
        "sdxl": ControlNetModel,
        "sd3": SD3ControlNetModel,
        "flux": FluxControlNetModel,
        "qwen_image": QwenImageControlNetModel,
    }[family]
    controlnet = model_class.from_pretrained(out / "controlnet")
    trained = load_file(out / "controlnet" / "diffusion_pytorch_model.safetensors")
    outputs = ("controlnet_down_blocks.", "controlnet_blocks.")  # the zero-initialised layers out: trained
    assert any(key.startswith(outputs) and trained[key].abs().sum() > 0 for key in trained)
    pipeline = pipeline_class.from_pretrained(base, controlnet=controlnet, **arguments)
    if family in ("sd", "sdxl"):
        pipeline.scheduler = DDIMScheduler.from_config(pipeline.scheduler.config)  # sample.scheduler "auto": DDIM
    ours = np.asarray(Image.open(out / "samples" / "000.png").convert("RGB"), np.int16)
    control = {("image" if family in ("sd", "sdxl") else "control_image"): Image.open(placed / "control" / "0000.png")}
    if family in ("sd3", "flux"):  # the T5 tokens difftune trains and draws with
        tokenizer = pipeline.tokenizer_3 if family == "sd3" else pipeline.tokenizer_2
        control["max_sequence_length"] = tokenizer.model_max_length
    if family == "qwen_image":  # the text tokens difftune trains and draws with
        control["max_sequence_length"] = FAMILIES["qwen_image"].conditioning.padded_text_tokens
    torch.manual_seed(config.sample.seed)  # SD3's ControlNet pipeline draws its control's latents from torch's own
    [theirs] = pipeline(
        prompt="a red circle",
        **control,
        height=32,
        width=32,
        num_inference_steps=config.sample.steps,
        guidance_scale=config.sample.guidance_scale,
        generator=torch.Generator("cpu").manual_seed(config.sample.seed),
        **({"true_cfg_scale": 1.0} if family == "qwen_image" else {}),
    ).images
    assert np.abs(ours - np.asarray(theirs, np.int16)).max() == 0
    assert '"max_pixel_difference": 0' in (out / "parity.json").read_text()


def test_the_denoiser_adds_the_controlnets_residuals_as_diffusers_script_does(tiny_base):
    """`Family.denoise` with a control image is train_controlnet.py's step: the ControlNet run on the UNet's own
    inputs with the control image in [0, 1], its residuals added to the UNet's blocks."""
    components = load_components(ModelConfig(base=str(tiny_base)))
    controlnet = components.family.controlnet.build(components)
    with torch.no_grad():  # zero convolutions out would add nothing: give them weights
        for block in (*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block):
            block.weight.normal_(0, 0.1)
    components.controlnet = controlnet
    generator = torch.Generator().manual_seed(0)
    channels = components.denoiser.config.in_channels
    side = 32 // components.pixels_per_latent
    noisy = torch.randn(2, channels, side, side, generator=generator)
    states = torch.randn(2, 8, components.denoiser.config.cross_attention_dim, generator=generator)
    pixels = torch.rand(2, 3, 32, 32, generator=generator) * 2 - 1
    timesteps = torch.tensor([10, 500])
    with torch.no_grad():
        ours = components.family.denoise(
            components,
            noisy,
            timesteps,
            {
                "encoder_hidden_states": states,
                "control": components.family.controlnet.control_input(components, pixels),
            },
            None,
        )
        down, mid = controlnet(
            noisy, timesteps, encoder_hidden_states=states, controlnet_cond=(pixels + 1) / 2, return_dict=False
        )
        expected = components.denoiser(
            noisy,
            timesteps,
            encoder_hidden_states=states,
            down_block_additional_residuals=down,
            mid_block_additional_residual=mid,
        ).sample
        plain = components.denoiser(noisy, timesteps, encoder_hidden_states=states).sample
    torch.testing.assert_close(ours, expected)
    assert not torch.allclose(ours, plain, atol=1e-4)  # the residuals changed the prediction


def test_cached_uncached_and_resumed_runs_train_the_same_controlnet(make_config, placed, tmp_path):
    """The cache holds the targets' latents and never the controls (read as pixels, cut as the cached view was): the
    losses match an uncached run's; a run stopped and resumed ends with the same weights."""
    train(_controlnet_job(make_config, placed, tmp_path, "uncached", sample__prompts=[]))
    cached = {"cache__latents": True, "cache__text": True, "cache__dir": str(tmp_path / "cache"), "sample__prompts": []}
    train(_controlnet_job(make_config, placed, tmp_path, "cached", **cached))
    train(_controlnet_job(make_config, placed, tmp_path, "resumed", train__max_steps=2, **cached))
    train(_controlnet_job(make_config, placed, tmp_path, "resumed", **cached), resume="auto")
    losses = {run: [row["loss"] for row in read_metrics(tmp_path / run)] for run in ("uncached", "cached", "resumed")}
    assert len(losses["uncached"]) == 4
    np.testing.assert_allclose(losses["cached"], losses["uncached"], rtol=1e-4)
    assert losses["resumed"] == losses["cached"]
    assert not any((tmp_path / "cache").rglob("*control*"))
    cached_weights, resumed = (
        load_file(tmp_path / run / "controlnet" / "diffusion_pytorch_model.safetensors")
        for run in ("cached", "resumed")
    )
    assert all(torch.equal(cached_weights[key], resumed[key]) for key in cached_weights)


def test_an_image_without_a_control_is_named(make_config, shapes, tmp_path):
    with pytest.raises(DifftuneError, match=r"data\.path: .*0000\.png has no control image; .*control"):
        train(_controlnet_job(make_config, shapes, tmp_path, sample__prompts=[]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model__quantize": "int8"}, r"leave out model\.quantize"),
        ({"adapter__text_encoder": True}, r"leave out adapter\.text_encoder"),
        ({"export__format": "kohya"}, r'leave out export\.format = "kohya"'),
        (
            {"sample__prompts": ["a red circle"]},
            r"'a red circle' has 0 images; a ControlNet or control LoRA draws from one",
        ),
        ({"train__mixed_precision": "bf16"}, r'"controlnet" with train\.mixed_precision = "bf16" fails on a CPU'),
    ],
)
def test_settings_a_controlnet_cannot_train_with_are_refused(make_config, placed, tmp_path, overrides, message):
    with pytest.raises(DifftuneError, match=message):
        train(_controlnet_job(make_config, placed, tmp_path, **overrides))


def test_a_family_without_a_controlnet_is_refused(make_config, placed, micro_base, tmp_path):
    with pytest.raises(DifftuneError, match=r'adapter\.kind = "controlnet": .* has no ControlNet model'):
        train(_controlnet_job(make_config, placed, tmp_path, model__base=str(micro_base("chroma")), sample__prompts=[]))


@pytest.mark.parametrize("memory", [{"model__weight_dtype": "fp8"}, {"model__offload_blocks": 2}])
def test_a_controlnet_trains_beside_a_denoiser_stored_apart(make_config, placed, tmp_path, memory):
    """The ControlNet is built from the denoiser before its frozen layers are stored in fp8, offloaded or cast, so it
    starts from the loaded weights and trains in fp32 while they stay as the run keeps them."""
    train(_controlnet_job(make_config, placed, tmp_path, sample__prompts=[], **memory))
    weights = load_file(tmp_path / "controlnet" / "controlnet" / "diffusion_pytorch_model.safetensors")
    assert {tensor.dtype for tensor in weights.values()} == {torch.float32}
    losses = [row["loss"] for row in read_metrics(tmp_path / "controlnet")]
    assert len(losses) == 4 and all(np.isfinite(losses))


def _with_trained_outputs(controlnet: torch.nn.Module) -> torch.nn.Module:
    """`controlnet` with its zero-initialised layers given weights, so that what it adds shows."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in controlnet.named_parameters():
            if name.startswith(("controlnet_blocks", "controlnet_single_blocks", "pos_embed_input", "controlnet_x")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return controlnet


def test_sd3s_and_fluxs_controlnets_add_as_diffusers_scripts_do(micro_base):
    """SD3's step is train_controlnet_sd3.py's (the ControlNet's block outputs into the transformer's blocks) and
    Flux's is train_controlnet_flux.py's (latents and control packed by `FluxControlNetPipeline._pack_latents`, image
    ids from its `_prepare_latent_image_ids`, timestep / 1000, the prediction unpacked by its `_unpack_latents`)."""
    generator = torch.Generator().manual_seed(0)
    for family in ("sd3", "flux"):
        components = load_components(ModelConfig(base=str(micro_base(family))))
        controlnet = _with_trained_outputs(components.family.controlnet.build(components))
        components.controlnet = controlnet
        transformer = components.denoiser
        channels, side, batch = transformer.config.in_channels, 8, 2
        if family == "flux":
            channels //= 4  # Flux's transformer reads 2x2 patches of the latents
        noisy = torch.randn(batch, channels, side, side, generator=generator)
        control = torch.randn(batch, channels, side, side, generator=generator)
        width = transformer.config.joint_attention_dim
        states = torch.randn(batch, 6, width, generator=generator)
        pooled = torch.randn(batch, transformer.config.pooled_projection_dim, generator=generator)
        timesteps = torch.tensor([100.0, 700.0])
        conditioning = {
            "encoder_hidden_states": states,
            "pooled_prompt_embeds": pooled,
            "control": components.family.controlnet.control_input(components, control),
        }
        if family == "flux" and components.family_options.text_padding_mask:
            conditioning["text_mask"] = torch.ones(batch, 6)
        with torch.no_grad():
            ours = components.family.denoise(components, noisy, timesteps, conditioning, None)
            if family == "sd3":
                text = {"encoder_hidden_states": states, "pooled_projections": pooled, "timestep": timesteps}
                [samples] = controlnet(hidden_states=noisy, controlnet_cond=control, return_dict=False, **text)
                expected = transformer(
                    hidden_states=noisy, block_controlnet_hidden_states=samples, return_dict=False, **text
                )[0]
            else:
                packed = FluxControlNetPipeline._pack_latents(noisy, batch, channels, side, side)
                packed_control = FluxControlNetPipeline._pack_latents(control, batch, channels, side, side)
                inputs = {
                    "timestep": timesteps / 1000,
                    "guidance": None,
                    "pooled_projections": pooled,
                    "encoder_hidden_states": states,
                    "txt_ids": torch.zeros(6, 3),
                    "img_ids": FluxControlNetPipeline._prepare_latent_image_ids(
                        batch, side // 2, side // 2, "cpu", torch.float32
                    ),
                }
                blocks, single_blocks = controlnet(
                    hidden_states=packed, controlnet_cond=packed_control, return_dict=False, **inputs
                )
                prediction = transformer(
                    hidden_states=packed,
                    controlnet_block_samples=blocks,
                    controlnet_single_block_samples=single_blocks,
                    return_dict=False,
                    **inputs,
                )[0]
                expected = FluxControlNetPipeline._unpack_latents(prediction, side * 8, side * 8, 8)
            plain = components.family.denoise(
                components, noisy, timesteps, {k: v for k, v in conditioning.items() if k != "control"}, None
            )
        torch.testing.assert_close(ours, expected, msg=family)
        assert not torch.allclose(ours, plain, atol=1e-4), family  # the ControlNet changed the prediction


@pytest.mark.parametrize("family", ["sd", "flux"])
def test_the_memory_plan_counts_the_controlnet_as_trained(make_config, placed, micro_base, tmp_path, family):
    """`difftune plan` builds the ControlNet on the meta device (nothing copied) and counts its weights and AdamW's
    moments as trained, as many as the real one holds."""
    from difftune.training import plan

    base = micro_base(family)
    config = _controlnet_job(make_config, placed, tmp_path, model__base=str(base), sample__prompts=[])
    predicted = plan.plan_memory(config, "cuda")
    components = load_components(ModelConfig(base=str(base)))
    parameters = sum(p.numel() for p in components.family.controlnet.build(components).parameters())
    assert predicted.device["trained weights"] == 4 * parameters
    assert predicted.device["optimizer state"] == 8 * parameters
    assert predicted.device["activations and gradients"] > 0


def test_a_control_lora_loads_in_flux_control_pipeline_and_draws_what_difftune_drew(
    make_config, placed, micro_base, tmp_path
):
    """A control LoRA (`adapter.control_input`) on micro Flux: its file is a plain diffusers-layout LoRA whose
    `x_embedder` reads twice the base's inputs; `FluxControlPipeline.from_pretrained(base)` widens the base as
    `load_lora_weights` reads it and draws the run's sample 000 from the same control image exactly. The kohya layout
    is not written (said why)."""
    base = micro_base("flux")
    config = _controlnet_job(
        make_config,
        placed,
        tmp_path,
        model__base=str(base),
        adapter__kind="lora",
        adapter__control_input=True,
        sample__guidance_scale=1.0,
    )
    train(config)
    out = tmp_path / "controlnet"
    lora = load_file(out / "pytorch_lora_weights.safetensors")
    inputs = FluxControlPipeline.from_pretrained(base).transformer.x_embedder.in_features
    assert lora["transformer.x_embedder.lora_A.weight"].shape[1] == 2 * inputs
    assert not any(path.name.startswith("controlnet.") for path in out.glob("*.safetensors"))  # no kohya file
    pipeline = FluxControlPipeline.from_pretrained(base)
    pipeline.load_lora_weights(out)
    torch.manual_seed(config.sample.seed)
    call = {
        "prompt": "a red circle",
        "control_image": Image.open(placed / "control" / "0000.png"),
        "height": 32,
        "width": 32,
        "num_inference_steps": config.sample.steps,
        "guidance_scale": 1.0,
        "max_sequence_length": pipeline.tokenizer_2.model_max_length,
    }
    [theirs] = pipeline(**call, generator=torch.Generator("cpu").manual_seed(config.sample.seed)).images
    ours = np.asarray(Image.open(out / "samples" / "000.png").convert("RGB"), np.int16)
    assert np.abs(ours - np.asarray(theirs, np.int16)).max() == 0
    parity = (out / "parity.json").read_text()
    assert '"max_pixel_difference": 0' in parity and "no kohya layout" in parity

    # Merged into the base: a FluxControlPipeline folder whose transformer's config says its width, which diffusers
    # loads whole and which draws as the LoRA on the base did (merging rounds by a level at most).
    merge_into_folder(str(base), [(out / "pytorch_lora_weights.safetensors", 1.0)], tmp_path / "merged", "fp32")
    merged = FluxControlPipeline.from_pretrained(tmp_path / "merged")
    assert merged.transformer.config.in_channels == 2 * inputs
    torch.manual_seed(config.sample.seed)
    [drawn] = merged(**call, generator=torch.Generator("cpu").manual_seed(config.sample.seed)).images
    assert np.abs(ours - np.asarray(drawn, np.int16)).max() <= 1


def test_a_control_lora_starts_as_the_base(make_config, placed, micro_base, tmp_path):
    """The widened input layer's new half is zero and the LoRA's B too: the first step's loss is a plain LoRA's on
    the same data, bit for bit; later steps read the control and part ways."""
    base = str(micro_base("flux"))
    (tmp_path / "no controls").mkdir()
    plain, control = (
        _controlnet_job(
            make_config,
            placed,
            tmp_path,
            name,
            model__base=base,
            adapter__kind="lora",
            adapter__control_input=reads,
            sample__prompts=[],
            optim__learning_rate=1e-2,
            **({} if reads else {"data__control_path": str(tmp_path / "no controls")}),  # the same images, alone
        )
        for name, reads in (("plain", False), ("control", True))
    )
    train(plain)
    train(control)
    losses = {run: [row["loss"] for row in read_metrics(tmp_path / run)] for run in ("plain", "control")}
    assert losses["control"][0] == losses["plain"][0]
    assert losses["control"][1:] != losses["plain"][1:]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"adapter__kind": "loha"}, r'control_input cannot train with adapter\.kind = "loha"'),
        ({"export__format": "kohya"}, r'control_input cannot train with export\.format = "kohya"'),
        ({"model__base": None}, r"adapter\.control_input: Stable Diffusion .* has no pipeline that reads control"),
    ],
)
def test_settings_a_control_lora_cannot_train_with_are_refused(
    make_config, placed, micro_base, tmp_path, overrides, message
):
    settings = {"model__base": str(micro_base("flux")), "adapter__kind": "lora", "sample__prompts": []}
    settings |= {key: value for key, value in overrides.items() if value is not None}
    if overrides.get("model__base", "") is None:
        settings.pop("model__base")  # the micro SD base
    with pytest.raises(DifftuneError, match=message):
        train(_controlnet_job(make_config, placed, tmp_path, adapter__control_input=True, **settings))


def test_a_controlnets_snapshots_are_folders_its_pipeline_loads(make_config, placed, tmp_path):
    """`export.every_steps` snapshots a ControlNet as the folder its result is (`snapshots/step-000002/`), not as a
    folder named like an adapter file."""
    train(_controlnet_job(make_config, placed, tmp_path, sample__prompts=[], export__every_steps=2))
    snapshots = sorted((tmp_path / "controlnet" / "snapshots").iterdir())
    assert [path.name for path in snapshots] == ["step-000002", "step-000004"]
    first = ControlNetModel.from_pretrained(snapshots[0])
    last = load_file(tmp_path / "controlnet" / "controlnet" / "diffusion_pytorch_model.safetensors")
    assert all(
        torch.equal(tensor, last[name])
        for name, tensor in load_file(snapshots[1] / "diffusion_pytorch_model.safetensors").items()
    )
    assert not all(torch.equal(tensor, last[name]) for name, tensor in first.state_dict().items())
