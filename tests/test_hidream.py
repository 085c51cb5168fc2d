"""HiDream-I1 beyond the conformance suite and the loss-parity test: its mixture of experts trained on its own training
path (the same prediction as inference, with gradients through the chosen experts), and its files as diffusers and
ai-toolkit / ComfyUI name them."""

from __future__ import annotations

import pytest
import torch
from diffusers import HiDreamImagePipeline, HiDreamImageTransformer2DModel
from diffusers.loaders.single_file_utils import CHECKPOINT_KEY_NAMES
from safetensors.torch import load_file, save_file

from difftune.adapters import export
from difftune.adapters.files import module_names_of, read_adapter
from difftune.config import ModelConfig
from difftune.families import FAMILIES, load_components
from difftune.training.train import train

FAMILY = FAMILIES["hidream"]
PROMPTS = ["a red circle", "a blue square with a longer caption"]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("hidream", seed=2))


def test_the_experts_train_on_their_training_path_with_the_inference_prediction(base):
    """In training mode the transformer routes tokens through its experts with gradients (`force_inference_output`
    off) and returns patches; difftune's prediction there equals inference's, for a non-square image too (padded to
    the transformer's longest sequence), and a routed expert's weights get a gradient, which the diffusers script's
    `force_inference_output=True` (its experts under `no_grad`) never gives."""
    components = load_components(ModelConfig(base=base))
    denoiser = components.denoiser
    with torch.no_grad():
        conditioning = FAMILY.conditioning.encode_prompts(
            components, FAMILY.conditioning.tokenize(components.tokenizers, PROMPTS)
        )
    noisy = torch.randn(2, 16, 8, 4, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([300.0, 850.0])
    with torch.no_grad():
        inference = FAMILY.denoise(components, noisy, timesteps, conditioning, None)
    expert = denoiser.double_stream_blocks[0].block.ff_i.experts[0].w1.weight
    denoiser.train()
    training = FAMILY.denoise(components, noisy, timesteps, conditioning, None)
    torch.testing.assert_close(training, inference, rtol=1e-4, atol=1e-5)
    training.square().mean().backward()
    assert expert.grad is not None and expert.grad.abs().sum() > 0

    # Loaded as the script loads it: in training mode too, the image as inference returns it, and no expert gradient.
    components.denoiser = HiDreamImageTransformer2DModel.from_pretrained(
        base, subfolder="transformer", force_inference_output=True
    ).train()
    script = FAMILY.denoise(components, noisy, timesteps, conditioning, None)
    torch.testing.assert_close(script, inference, rtol=1e-4, atol=1e-5)
    script.square().mean().backward()
    assert components.denoiser.double_stream_blocks[0].block.ff_i.experts[0].w1.weight.grad is None


def test_files_are_named_as_diffusers_and_comfyui_read_them(make_config, base, tmp_path):
    """A single file carries the key diffusers' reader detects HiDream by; a LoRA saved as ai-toolkit and ComfyUI
    save it (the transformer's names after `diffusion_model.`) is read as difftune's own file, and diffusers' loader
    reads it as the same change."""
    components = load_components(ModelConfig(base=base))
    assert CHECKPOINT_KEY_NAMES["hidream"] in FAMILY.layout.to_single_file(components)

    trained = train(
        make_config(
            model__base=base,
            train__output_dir=str(tmp_path / "run"),
            train__max_steps=2,
            optim__learning_rate=2e-2,
            sample__prompts=[],
        )
    ).trained_path
    ours = load_file(trained)
    lone = {"diffusion_model." + key.removeprefix("transformer."): value for key, value in ours.items()}
    save_file(lone, tmp_path / "lone.safetensors")
    tensors, _, _ = read_adapter(tmp_path / "lone.safetensors", lambda metadata: module_names_of(components))
    assert tensors.keys() == ours.keys() and all(torch.equal(tensors[key], ours[key]) for key in ours)

    def drawn(adapter) -> torch.Tensor:
        pipeline = HiDreamImagePipeline.from_pretrained(base, dtype=torch.float32)
        pipeline.set_progress_bar_config(disable=True)
        pipeline.load_lora_weights(adapter)
        return pipeline(
            "a purple circle",
            height=32,
            width=32,
            num_inference_steps=2,
            guidance_scale=3.0,
            max_sequence_length=32,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
        ).images

    torch.testing.assert_close(drawn(str(tmp_path / "lone.safetensors")), drawn(str(trained)), rtol=0, atol=1e-5)
    assert export.convert_adapter(trained, tmp_path / "kohya.safetensors", "kohya").is_file()


@pytest.mark.parametrize("height, width", [(32, 32), (32, 48)])
def test_samples_are_drawn_at_the_size_asked(base, height, width):
    # HiDreamImagePipeline scales any size to its default's area (1024 x 1024 with the published VAE's factor 8);
    # difftune's drawing sets that default to the size asked, so a sample comes out as asked.
    components = load_components(ModelConfig(base=base))
    pipeline = FAMILY.drawing.assemble_pipeline(components)
    generator = torch.Generator().manual_seed(0)
    arguments = FAMILY.drawing.sampling_arguments(components, 1.0, "") | {
        "num_inference_steps": 1,
        "generator": generator,
    }
    (image,) = FAMILY.drawing.draw(pipeline, components.family_options, "a red circle", [], height, width, **arguments)
    assert image.size == (width, height)
