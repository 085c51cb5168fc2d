"""Wan VACE beyond the conformance suite: the control latents the transformer reads, made as `WanVACEPipeline` makes
them (a text-to-video clip, and one with a reference image: equal predictions), reference images trained from edit
pairs and drawn by the pipeline with the adapter as difftune draws them, the VACE model's single files told from Wan's,
and the adapter on the Wan blocks alone unless the VACE blocks are named (then in the original model's names)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import WanVACEPipeline
from PIL import Image
from safetensors.torch import load_file, save_file

from difftune.adapters.kohya import family_from_kohya, family_to_kohya
from difftune.adapters.trained import derived_lora_configs
from difftune.config import ModelConfig
from difftune.data.dataset import image_to_tensor
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, family_of, load_components
from difftune.training.train import _controls, train

FAMILY = FAMILIES["wan_vace"]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("wan_vace", seed=2))


def _reference() -> Image.Image:
    image = Image.new("RGB", (32, 32), (240, 230, 60))
    image.paste((120, 40, 200), (6, 10, 26, 22))
    return image


def _recorded_call(holder) -> dict:
    """The keyword arguments and output of the first call of `holder`'s transformer (a pipeline's, or components'
    denoiser)."""
    transformer = getattr(holder, "transformer", None) or holder.denoiser
    record, forward = {}, transformer.forward

    def recording(**kwargs):
        output = forward(**kwargs)
        record.setdefault("inputs", kwargs)
        record.setdefault("output", output[0])
        return output

    transformer.forward = recording
    return record


@pytest.mark.parametrize("references", [0, 1, 2])
def test_the_control_latents_are_the_pipelines_and_so_is_the_prediction(base, references):
    """The pipeline's first step, unguided, over 5 frames with 0-2 reference images: difftune's `denoise`, given the
    pipeline's noisy latents and text states, its own zeros clip (`pixel_conditioning`) and the references encoded as
    training encodes an edit pair's controls, builds the same control latents and predicts the same."""
    pipeline = WanVACEPipeline.from_pretrained(base, dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    record = _recorded_call(pipeline)
    images = [_reference(), _reference().transpose(Image.Transpose.ROTATE_90)][:references]
    pipeline(
        prompt="a square moving left",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=1,
        guidance_scale=1.0,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        **({"reference_images": images} if images else {}),
    )
    inputs = record["inputs"]
    components = load_components(ModelConfig(base=base))
    clip = torch.zeros(1, 3, 5, 32, 32)  # its values are not read: a clip of its size
    conditioning = FAMILY.conditioning.pixel_conditioning(components, clip)
    batch = {"control_pixels": [image_to_tensor(image)[None] for image in images]}
    conditioning |= {"encoder_hidden_states": inputs["encoder_hidden_states"]}
    if images:
        conditioning["control_latents"] = _controls(components, batch, torch.device("cpu"), as_latents=True)
    assert inputs["hidden_states"].shape[2] == references + 3  # the references, then 5 frames at the temporal factor 2
    built = _recorded_call(components)  # what difftune gives the same transformer
    ours = FAMILY.denoise(components, inputs["hidden_states"], inputs["timestep"], conditioning, None)
    torch.testing.assert_close(
        built["inputs"]["control_hidden_states"], inputs["control_hidden_states"], rtol=0, atol=1e-6
    )
    torch.testing.assert_close(ours, record["output"], rtol=1e-5, atol=1e-5)


def test_references_train_from_edit_pairs_and_the_pipeline_draws_the_adapter_as_the_run(base, make_config, tmp_path):
    """Images with a reference each (the edit pairs' layout): the reference's frame trains before the image's (the
    loss covers both: a batch's latents have two frames), and the run's sample with a reference is what
    `WanVACEPipeline` draws with `load_lora_weights` and the same reference, within 2 levels (and otherwise without
    the adapter)."""
    data = tmp_path / "data"
    (data / "control").mkdir(parents=True)
    for index, color in enumerate([(200, 40, 40), (40, 200, 60)]):
        image = Image.new("RGB", (32, 32), (250, 250, 250))
        image.paste(color, (8, 8, 24, 24))
        image.save(data / f"{index}.png")
        (data / f"{index}.txt").write_text("a square like the reference")
        _reference().save(data / "control" / f"{index}.png")
    _reference().save(tmp_path / "reference.png")
    entry = {"prompt": "a square like the reference", "controls": [str(tmp_path / "reference.png")]}
    trained_latents = []
    conditioning = FAMILY.conditioning
    original = type(conditioning).trained_latents

    def recorded(self, latents, conditioning):
        trained_latents.append(original(self, latents, conditioning))
        return trained_latents[-1]

    type(conditioning).trained_latents = recorded
    try:
        result = train(
            make_config(
                model__base=base,
                data__path=str(data),
                adapter__text_encoder=False,
                train__max_steps=2,
                optim__learning_rate=2e-2,
                sample__prompts=[entry],
                sample__steps=3,
                sample__guidance_scale=1.0,
                sample__resolution=32,
            )
        )
    finally:
        type(conditioning).trained_latents = original
    assert [tuple(latents.shape[1:3]) for latents in trained_latents] == [(16, 2)] * 2  # the reference, the image
    ours = np.asarray(Image.open(tmp_path / "run" / "samples" / "000.png").convert("RGB"), dtype=np.int16)

    pipeline = WanVACEPipeline.from_pretrained(base, dtype=torch.float32)
    pipeline.load_lora_weights(str(result.trained_path.parent), weight_name=result.trained_path.name)
    pipeline.set_progress_bar_config(disable=True)
    arguments = FAMILY.drawing.sampling_arguments(load_components(ModelConfig(base=base)), 1.0, "")
    arguments |= {"prompt": entry["prompt"], "reference_images": [_reference()], "height": 32, "width": 32}
    arguments |= {"num_frames": 1, "num_inference_steps": 3}

    def drawn(output_type: str) -> np.ndarray:
        generator = torch.Generator("cpu").manual_seed(0)
        return pipeline(**arguments, generator=generator, output_type=output_type).frames[0]

    assert np.abs(ours - np.round(drawn("np")[0] * 255)).max() <= 2
    adapted = drawn("latent")
    pipeline.disable_lora()
    assert np.abs(adapted - drawn("latent")).max() > 1e-3  # the adapter changed what is drawn


def test_vace_files_are_told_from_wans_and_written_in_the_original_layout(base, micro_base, tmp_path):
    """A VACE transformer's single file is the VACE family's (diffusers' own mark, `vace_blocks.0.after_proj.bias`),
    a Wan one's Wan's; naming Wan for a VACE file is refused. Its VACE blocks' input and output layers are the
    original model's `before_proj` and `after_proj`."""
    files = {}
    for name, folder in (("wan_vace", base), ("wan", str(micro_base("wan", seed=2)))):
        files[name] = tmp_path / f"{name}.safetensors"
        save_file(FAMILIES[name].layout.to_single_file(load_components(ModelConfig(base=folder))), files[name])
        assert family_of(ModelConfig(base=str(files[name]))) is FAMILIES[name]
    keys = set(load_file(files["wan_vace"]))
    assert {"vace_blocks.0.before_proj.weight", "vace_blocks.1.after_proj.bias", "vace_patch_embedding.weight"} <= keys
    assert not any(key.startswith("vace_blocks.") and ".head." in key for key in keys)
    with pytest.raises(DifftuneError, match="wan_vace"):
        family_of(ModelConfig(base=str(files["wan_vace"]), family="wan"))


def test_the_adapter_goes_on_the_wan_blocks_and_named_vace_layers_keep_their_original_names(base):
    """The default targets are the Wan blocks' alone (the file a Wan LoRA); a VACE block's layers, when named, are
    written in the kohya layout under the original model's names."""
    components = load_components(ModelConfig(base=base))
    targets = FAMILY.targets.targets_of("transformer", components.denoiser)
    assert targets and all(target.startswith("blocks.") for target in targets)
    assert "blocks.1.attn1.to_q" in targets
    modules = ["vace_blocks.1.proj_out", "vace_blocks.0.attn1.to_q"]
    generator = torch.Generator().manual_seed(0)
    lora = {
        f"transformer.{module}.lora_{factor}.weight": torch.randn(shape, generator=generator)
        for module in modules
        for factor, shape in (("A", (2, 32)), ("B", (32, 2)))
    }
    configs = derived_lora_configs(
        {"transformer": dict.fromkeys(modules, 2)}, {"transformer": dict.fromkeys(modules, 2.0)}, {"transformer": False}
    )
    kohya = family_to_kohya(FAMILY, lora, configs)
    assert {key.split(".")[0] for key in kohya} == {
        "lora_unet_vace_blocks_1_after_proj",
        "lora_unet_vace_blocks_0_self_attn_q",
    }
    names = {"transformer": [name for name, _ in components.denoiser.named_modules()]}
    back, _ = family_from_kohya(FAMILY, kohya, names)
    assert back.keys() == lora.keys() and all(torch.equal(back[key], lora[key]) for key in lora)
