"""The inpainting families beyond the conformance suite: the random masks each view trains with, the mask and masked
image read as `StableDiffusionInpaintPipeline` and `FluxFillPipeline` read theirs (one pipeline step equals
difftune's), and samples that name an image and its mask."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from diffusers import (
    ControlNetModel,
    DDIMScheduler,
    StableDiffusionControlNetInpaintPipeline,
    StableDiffusionXLControlNetInpaintPipeline,
)
from PIL import Image

from difftune.cli import main
from difftune.config import Config, ModelConfig, SampleConfig
from difftune.data.dataset import image_to_tensor
from difftune.data.inpaint_masks import MASK_KINDS, random_mask, view_masks
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components
from difftune.families.common.drawing import _control_panels, generate_images
from difftune.families.common.tokens import pack
from difftune.toy.tiny import placed_shape_pairs, write_pair_folder
from difftune.training.train import train


def _image(color=(240, 40, 40)) -> Image.Image:
    image = Image.new("RGB", (32, 32), (30, 160, 220))
    image.paste(color, (8, 8, 20, 20))
    return image


def test_each_view_gets_its_own_mask_of_every_kind_the_recipe_draws():
    """A view's mask is its pixels' (the same view, the same mask: cached and encoded runs agree); another view, a
    flipped one too, gets another. Drawn many times, every kind appears about as often as its share, each mask
    binary, covering some of the image and, but for the whole-image kind, not all of it."""
    pixels = image_to_tensor(_image())[None]
    flipped = pixels.flip(-1)
    assert torch.equal(view_masks(pixels), view_masks(pixels.clone()))
    assert not torch.equal(view_masks(pixels), view_masks(flipped).flip(-1))
    assert set(view_masks(pixels).unique().tolist()) <= {0.0, 1.0}
    rng = random.Random(0)
    covered = [np.asarray(random_mask(64, 48, rng), dtype=np.float32).mean() / 255 for _ in range(400)]
    whole = sum(share == 1.0 for share in covered) / len(covered)
    assert abs(whole - MASK_KINDS["whole"]) < 0.05
    assert min(covered) > 0 and np.median(covered) < 0.5


@pytest.mark.parametrize("name", ["sd_inpaint", "sdxl_inpaint", "flux_fill"])
def test_the_mask_and_masked_image_are_read_as_the_pipeline_reads_them(name, micro_base):
    """difftune's view conditioning is the pipeline's for that image and mask: the masked image encoded to its
    posterior's mode. With the latents the pipeline drew from that posterior, one step of the pipeline equals
    difftune's (SD's and SDXL's: DDIM from its first timestep; Fill: Euler from pure noise, the noise less the
    velocity). Another mask changes the prediction."""
    family = FAMILIES[name]
    components = load_components(ModelConfig(base=str(micro_base(name))))
    pipeline = components.pipeline()
    pipeline.set_progress_bar_config(disable=True)
    image, prompt = _image(), "a red square"
    pixels = image_to_tensor(image)[None]
    with torch.no_grad():
        ours = family.conditioning.pixel_conditioning(components, pixels)
        mask = Image.fromarray((ours["inpaint_mask"][0, 0].numpy() * 255).astype(np.uint8))
        posterior = components.vae.encode(pixels * (ours["inpaint_mask"] < 0.5)).latent_dist
        drawn = posterior.sample(torch.Generator().manual_seed(7))  # what the pipeline's generator draws
        conditioning = family.conditioning.encode_prompts(
            components, family.conditioning.tokenize(components.tokenizers, [prompt])
        )
        noise = torch.randn(1, family.latent_channels(components.denoiser), 8, 8, generator=torch.Generator())
        arguments = {"prompt": prompt, "image": image, "mask_image": mask, "height": 32, "width": 32}
        arguments |= {"num_inference_steps": 1, "generator": torch.Generator().manual_seed(7), "output_type": "latent"}
        geometry = None
        if name != "flux_fill":  # from pure noise (SDXL's pipeline starts from the noised image by default)
            pipeline.scheduler = DDIMScheduler.from_config(pipeline.scheduler.config)
            theirs = pipeline(**arguments, guidance_scale=1.0, latents=noise, strength=1.0).images
            geometry = torch.tensor([[32.0, 32, 0, 0, 32, 32]])  # SDXL's size conditioning: sizes, crop, target
            timestep = pipeline.scheduler.timesteps[0]
        else:
            length = family.max_sequence_length(components)
            theirs = pipeline(
                **arguments, sigmas=[1.0], guidance_scale=3.0, latents=pack(noise), max_sequence_length=length
            )
            theirs = theirs.images
            timestep = torch.tensor(1000.0)
        components.family_options = components.family_options.model_copy(update={"guidance": 3.0})

        def prediction(mask):
            view = conditioning | {"inpaint_mask": mask, "masked_latents": drawn}
            return family.denoise(components, noise, timestep.reshape(1).float(), view, geometry)

        predicted = prediction(ours["inpaint_mask"])
        other = prediction(1 - ours["inpaint_mask"])
    torch.testing.assert_close(ours["masked_latents"], posterior.mode(), rtol=0, atol=1e-6)
    if name != "flux_fill":
        alpha, last = pipeline.scheduler.alphas_cumprod[int(timestep)], pipeline.scheduler.final_alpha_cumprod
        clean = (noise - (1 - alpha).sqrt() * predicted) / alpha.sqrt()
        torch.testing.assert_close(theirs, last.sqrt() * clean + (1 - last).sqrt() * predicted, rtol=0, atol=1e-5)
    else:
        torch.testing.assert_close(theirs, pack(noise - predicted), rtol=0, atol=1e-5)
    assert (predicted - other).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["sd_inpaint", "sdxl_inpaint", "flux_fill"])
def test_samples_name_an_image_and_its_mask(name, micro_base, tmp_path):
    """A sample prompt without both is refused before training, saying how to write it; one with both is drawn, its
    grid naming them, and drawn the same with its mask named as `mask`; Fill's samples give the guidance embedding the
    scale and no negative prompt (its pipeline takes none)."""
    base = str(micro_base(name))
    family = FAMILIES[name]
    with pytest.raises(DifftuneError, match=r'controls = \["image.png", "mask.png"\]'):
        family.check_config(Config(model=ModelConfig(base=base), sample=SampleConfig(prompts=["a red square"])))
    family.check_config(
        Config(
            model=ModelConfig(base=base),
            sample=SampleConfig(prompts=[{"prompt": "a red square", "controls": ["a.png", "mask.png"]}]),
        )
    )
    components = load_components(ModelConfig(base=base))
    _image().save(tmp_path / "a.png")
    Image.new("L", (32, 32), 255).save(tmp_path / "mask.png")
    entry = {"prompt": "a red square", "controls": [str(tmp_path / "a.png"), str(tmp_path / "mask.png")]}
    [sample] = generate_images(components, SampleConfig(prompts=[entry], steps=2, resolution=32), torch.device("cpu"))
    assert sample.control_names == ("image", "mask") and [c.size for c in sample.controls] == [(32, 32)] * 2
    named = {"prompt": "a red square", "controls": [str(tmp_path / "a.png")], "mask": str(tmp_path / "mask.png")}
    [same] = generate_images(components, SampleConfig(prompts=[named], steps=2, resolution=32), torch.device("cpu"))
    assert same.control_names == ("image", "mask")
    assert np.array_equal(np.asarray(same.image), np.asarray(sample.image))  # the mask named as such: the same draw
    if name == "flux_fill":
        assert family.drawing.sampling_arguments(components, 30.0, "blurry") == {
            "max_sequence_length": family.max_sequence_length(components),
            "guidance_scale": 30.0,
        }


def test_a_subjects_mask_is_the_views_inpainting_mask_cached_or_not(micro_base, make_config, shapes, tmp_path):
    """With `data.masks`, an image's mask is what its views learn to fill (0.5 and over), an image without one gets
    random masks: a cached run's entries hold them, and it trains as a run that encodes every step. Another mask file
    is another cache entry."""
    from safetensors.torch import load_file

    from difftune.data.dataset import image_to_tensor as to_tensor
    from difftune.training.metrics import read_metrics
    from difftune.training.train import train

    masks = tmp_path / "masks"
    masks.mkdir()
    images = sorted(shapes.glob("*.png"))
    subject = Image.new("L", (32, 32), 0)
    subject.paste(200, (4, 6, 20, 30))
    for image in images[::2]:
        subject.save(masks / image.name)
    common = {
        "model__base": str(micro_base("sd_inpaint")),
        "data__masks": "folder",
        "data__mask_path": str(masks),
        "data__unmasked_weight": 1.0,  # the loss over the whole image: what the mask changes is the conditioning
        "cache__dir": str(tmp_path / "cache"),
    }

    def losses(name, **settings):
        train(make_config(train__output_dir=str(tmp_path / name), **common | settings))
        return [row["loss"] for row in read_metrics(tmp_path / name)]

    encoded = losses("encoded")
    assert losses("cached", cache__latents=True) == pytest.approx(encoded, rel=1e-5)
    assert losses("random", data__masks="off") != pytest.approx(encoded, rel=1e-3)  # every view's mask drawn
    entries = {path: load_file(path) for path in (tmp_path / "cache" / "latents").rglob("*.safetensors")}
    by_mask = {tuple(entry["inpaint_mask"].flatten().tolist()): entry for entry in entries.values()}
    expected = (torch.from_numpy(np.array(subject)) >= 128).to(torch.uint8)
    assert tuple(expected.flatten().tolist()) in by_mask  # the subject's, from the mask file
    with Image.open(images[1]) as image:
        drawn = view_masks(to_tensor(image.convert("RGB"))[None]).to(torch.uint8)
    assert tuple(drawn.flatten().tolist()) in by_mask  # drawn from the pixels of an image without one

    subject.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(masks / images[0].name)
    before = set(entries)
    losses("moved", cache__latents=True)
    assert len(set((tmp_path / "cache" / "latents").rglob("*.safetensors")) - before) == 1


@pytest.mark.parametrize("name, text_to_image", [("sd_inpaint", "sd"), ("sdxl_inpaint", "sdxl")])
def test_an_inpainting_single_file_is_read_as_its_family_by_its_input_channels(
    name, text_to_image, micro_base, tmp_path
):
    """An inpainting checkpoint's keys are its text-to-image family's: `auto` tells them apart by the UNet's input
    layer (9 channels against 4), and a file named as the other family is refused, naming its own."""
    from safetensors.torch import save_file

    from difftune.families import family_of

    for family in (name, text_to_image):
        components = load_components(ModelConfig(base=str(micro_base(family))))
        save_file(FAMILIES[family].layout.to_single_file(components), tmp_path / f"{family}.safetensors")
        assert family_of(ModelConfig(base=str(tmp_path / f"{family}.safetensors"))) is FAMILIES[family]
    with pytest.raises(DifftuneError, match=f"of the {name} family"):
        family_of(ModelConfig(base=str(tmp_path / f"{name}.safetensors"), family=text_to_image))


@pytest.mark.parametrize("name", ["z_image", "flux2_klein"])
def test_a_text_to_image_runs_masked_samples_are_painted_by_its_inpaint_pipeline(
    name, micro_base, make_config, tmp_path
):
    """A sample prompt with a `mask` paints into its image through the family's inpaint pipeline (Z-Image's, FLUX.2
    [klein]'s: the text-to-image base's own drawing blended into the image), with the run's adapter: diffusers' own
    pipeline, reading the saved file with `load_lora_weights`, draws the same from the same seed, and so does `difftune
    sample --control --mask`; the sample file names its mask. A base that paints into no image refuses a mask by name,
    and Z-Image one with references."""
    base = micro_base(name)
    family = FAMILIES[name]
    _image().save(tmp_path / "a.png")
    mask = Image.new("L", (32, 32), 0)
    mask.paste(255, (4, 4, 24, 24))
    mask.save(tmp_path / "mask.png")
    entry = {"prompt": "a red square", "controls": [str(tmp_path / "a.png")], "mask": str(tmp_path / "mask.png")}
    config = make_config(
        model__base=str(base),
        adapter__text_encoder=False,
        train__max_steps=2,
        optim__learning_rate=2e-2,
        sample__prompts=[entry],
        sample__steps=3,
        sample__guidance_scale=1.0,
        sample__resolution=32,
    )
    result = train(config)
    with Image.open(tmp_path / "run" / "samples" / "000.png") as sample:
        assert sample.text["mask"] == str(tmp_path / "mask.png")
        ours = np.asarray(sample.convert("RGB"), dtype=np.int16)

    pipeline = family.drawing.inpaint_pipeline_class.from_pretrained(base, dtype=torch.float32)
    pipeline.load_lora_weights(str(result.trained_path.parent), weight_name=result.trained_path.name)
    pipeline.set_progress_bar_config(disable=True)
    arguments = family.drawing.sampling_arguments(load_components(ModelConfig(base=str(base))), 1.0, "")
    theirs = pipeline(
        prompt="a red square",
        image=_image(),
        mask_image=mask,
        height=32,
        width=32,
        num_inference_steps=3,
        generator=torch.Generator("cpu").manual_seed(0),
        **arguments,
    ).images[0]
    assert np.abs(ours - np.asarray(theirs, dtype=np.int16)).max() <= 2
    drawn_by_cli = [
        *("--base", str(base), "--adapter", str(result.trained_path), "--prompt", "a red square"),
        *("--control", str(tmp_path / "a.png"), "--mask", str(tmp_path / "mask.png"), "--steps", "3"),
        *("--guidance-scale", "1.0", "--resolution", "32", "--out", str(tmp_path / "cli")),
    ]
    assert main(["sample", *drawn_by_cli]) == 0
    cli = np.asarray(Image.open(tmp_path / "cli" / "000.png").convert("RGB"), dtype=np.int16)
    assert np.abs(ours - cli).max() <= 2

    with pytest.raises(DifftuneError, match="has a mask; Stable Diffusion"):
        FAMILIES["sd"].check_config(
            Config(model=ModelConfig(base=str(micro_base("sd"))), sample=SampleConfig(prompts=[entry]))
        )
    with_reference = entry | {"controls": [str(tmp_path / "a.png")] * 2}
    checked = Config(model=ModelConfig(base=str(base)), sample=SampleConfig(prompts=[with_reference]))
    if name == "z_image":
        with pytest.raises(DifftuneError, match="1 references beside the image it paints into; .* reads none"):
            family.check_config(checked)
    else:
        family.check_config(checked)  # [klein]'s inpainting reads references


@pytest.mark.parametrize(
    "name, pipeline_class",
    [
        ("sd_inpaint", StableDiffusionControlNetInpaintPipeline),
        ("sdxl_inpaint", StableDiffusionXLControlNetInpaintPipeline),
    ],
)
def test_an_inpainting_bases_controlnet_draws_in_diffusers_controlnet_inpaint_pipeline(
    name, pipeline_class, micro_base, make_config, tmp_path
):
    """A ControlNet trained on an inpainting base (random masks, control images from edit pairs) starts as the
    inpainting UNet's blocks, its input layer the UNet's first four channels (it reads the noisy latents alone, as the
    inpainting ControlNet pipelines give it them); its saved folder loads with `ControlNetModel.from_pretrained` into
    diffusers' ControlNet inpainting pipeline, which draws the run's sample (image, mask, control image) exactly; a
    sample prompt without its control image is refused, naming all three."""
    base = micro_base(name)
    placed = tmp_path / "placed"
    write_pair_folder(placed, placed_shape_pairs(8, seed=0))
    components = load_components(ModelConfig(base=str(base)))
    started = FAMILIES[name].controlnet.build(components)
    assert started.config.in_channels == 4 and components.denoiser.config.in_channels == 9
    torch.testing.assert_close(started.conv_in.weight, components.denoiser.conv_in.weight[:, :4], rtol=0, atol=0)

    _image().save(tmp_path / "a.png")
    mask = Image.new("L", (32, 32), 0)
    mask.paste(255, (4, 4, 28, 28))
    mask.save(tmp_path / "mask.png")
    control = placed / "control" / "0000.png"
    entry = {
        "prompt": "a red circle",
        "controls": [str(tmp_path / "a.png"), str(control)],
        "mask": str(tmp_path / "mask.png"),
    }
    settings = {
        "model__base": str(base),
        "data__path": str(placed),
        "adapter__kind": "controlnet",
        "adapter__text_encoder": False,
        "train__max_steps": 4,
        "optim__learning_rate": 1e-3,
        "sample__steps": 4,
    }
    with pytest.raises(DifftuneError, match=r'controls = \["image.png", "mask.png", "control.png"\]'):
        train(make_config(**settings, sample__prompts=[{"prompt": "a red circle", "controls": [str(control)]}]))
    config = make_config(**settings, sample__prompts=[entry])
    train(config)
    out = tmp_path / "run"
    controlnet = ControlNetModel.from_pretrained(out / "controlnet")
    assert controlnet.config.in_channels == 4
    pipeline = pipeline_class.from_pretrained(base, controlnet=controlnet)
    pipeline.scheduler = DDIMScheduler.from_config(pipeline.scheduler.config)  # sample.scheduler "auto": DDIM
    pipeline.set_progress_bar_config(disable=True)
    [theirs] = pipeline(
        prompt="a red circle",
        image=_image(),
        mask_image=mask,
        control_image=Image.open(control),
        height=32,
        width=32,
        num_inference_steps=config.sample.steps,
        guidance_scale=config.sample.guidance_scale,
        generator=torch.Generator("cpu").manual_seed(config.sample.seed),
    ).images
    ours = np.asarray(Image.open(out / "samples" / "000.png").convert("RGB"), np.int16)
    assert np.abs(ours - np.asarray(theirs, np.int16)).max() == 0
    assert '"max_pixel_difference": 0' in (out / "parity.json").read_text()


def test_an_inpainting_bases_controlnet_reads_the_noisy_latents_alone(micro_base):
    """`Family.denoise` with a ControlNet on an inpainting UNet is the ControlNet inpainting pipeline's step: the
    ControlNet reads the noisy latents (not the mask and masked image beside them) and the control image in [0, 1], and
    its residuals add to the UNet reading all nine channels."""
    components = load_components(ModelConfig(base=str(micro_base("sd_inpaint"))))
    family = components.family
    controlnet = family.controlnet.build(components)
    with torch.no_grad():  # zero convolutions out would add nothing: give them weights
        for block in (*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block):
            block.weight.normal_(0, 0.1)
    components.controlnet = controlnet
    generator = torch.Generator().manual_seed(0)
    noisy, masked = (torch.randn(2, 4, 8, 8, generator=generator) for _ in range(2))
    mask = (torch.rand(2, 1, 32, 32, generator=generator) > 0.5).to(torch.uint8)
    states = torch.randn(2, 8, components.denoiser.config.cross_attention_dim, generator=generator)
    pixels = torch.rand(2, 3, 32, 32, generator=generator) * 2 - 1
    timesteps = torch.tensor([10, 500])
    conditioning = {"encoder_hidden_states": states, "inpaint_mask": mask, "masked_latents": masked}
    with torch.no_grad():
        control = family.controlnet.control_input(components, pixels)
        ours = family.denoise(components, noisy, timesteps, conditioning | {"control": control}, None)
        down, mid = controlnet(noisy, timesteps, states, controlnet_cond=(pixels + 1) / 2, return_dict=False)
        small_mask = torch.nn.functional.interpolate(mask.float(), size=(8, 8))
        inputs = torch.cat([noisy, small_mask, components.latent_normalization.apply(masked)], dim=1)
        expected = components.denoiser(
            inputs, timesteps, states, down_block_additional_residuals=down, mid_block_additional_residual=mid
        ).sample
        plain = family.denoise(components, noisy, timesteps, conditioning, None)
    torch.testing.assert_close(ours, expected)
    assert not torch.allclose(ours, plain, atol=1e-4)  # the residuals changed the prediction


def test_a_grid_names_an_inpainting_bases_image_and_mask_then_the_controlnets_control():
    image, mask, control = (Image.new("RGB", (4, 4)) for _ in range(3))
    assert [name for name, _ in _control_panels([image, mask, control], ("image", "mask"))] == [
        "image",
        "mask",
        "control",
    ]
    assert [name for name, _ in _control_panels([image, mask])] == ["control 1", "control 2"]
    assert [name for name, _ in _control_panels([image], ())] == ["control"]
