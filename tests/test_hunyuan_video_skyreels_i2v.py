"""SkyReels V1 image-to-video beyond the conformance suite: the first frame's latents read beside the noisy clip as
`HunyuanSkyreelsImageToVideoPipeline` reads the image it animates, its single file read into HunyuanVideo's folder
at twice the channels in, its samples guided as the pipeline guides, and refused without their image."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from difftune.config import Config, ModelConfig, SampleConfig
from difftune.data.dataset import image_to_tensor
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components

FAMILY = FAMILIES["hunyuan_video_skyreels_i2v"]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("hunyuan_video_skyreels_i2v"))


def _frame() -> Image.Image:
    frame = Image.new("RGB", (32, 32), (30, 160, 220))
    frame.paste((240, 40, 40), (8, 8, 20, 20))
    return frame


def test_the_first_frame_is_read_as_the_pipeline_reads_the_image(base):
    """difftune encodes the window's first frame as the pipeline preprocesses and encodes the image (its posterior's
    mode); with the latents the pipeline drew from that posterior, one unguided step of the pipeline from pure noise
    equals the noise less difftune's velocity, which the frame changes."""
    components = load_components(ModelConfig(base=base))
    pipeline = components.pipeline()
    frame = _frame()
    clip = torch.cat([image_to_tensor(frame)[None, :, None], torch.rand(1, 3, 4, 32, 32) * 2 - 1], dim=2)
    noise = torch.randn(1, 16, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    prompt = "a red square"
    with torch.no_grad():
        ours = FAMILY.conditioning.pixel_conditioning(components, clip)
        image = pipeline.video_processor.preprocess(frame, height=32, width=32)
        posterior = components.vae.encode(image[:, :, None]).latent_dist
        drawn_latents = posterior.sample(torch.Generator().manual_seed(7))  # what the pipeline's generator draws
        drawn = pipeline(
            image=frame,
            prompt=prompt,
            height=32,
            width=32,
            num_frames=5,
            num_inference_steps=1,
            sigmas=[1.0],
            true_cfg_scale=1.0,
            guidance_scale=1.0,
            latents=noise,
            generator=torch.Generator().manual_seed(7),
            output_type="latent",
        ).frames
        conditioning = FAMILY.conditioning.encode_prompts(
            components, FAMILY.conditioning.tokenize(components.tokenizers, [prompt])
        )
        velocity = FAMILY.denoise(
            components, noise, torch.tensor([1000.0]), conditioning | {"first_frame_latents": drawn_latents}, None
        )
        without_frame = FAMILY.denoise(
            components, noise, torch.tensor([1000.0]), conditioning | {"first_frame_latents": 0 * drawn_latents}, None
        )
    assert torch.equal(image_to_tensor(frame)[None], image)
    torch.testing.assert_close(ours["first_frame_latents"], posterior.mode(), rtol=0, atol=1e-6)
    torch.testing.assert_close(drawn, noise - velocity, rtol=0, atol=1e-5)
    assert (velocity - without_frame).abs().max() > 1e-3


def test_a_single_file_is_read_into_hunyuan_videos_folder_at_twice_the_channels(base, micro_base, tmp_path):
    """Kijai's files hold the transformer alone in Tencent's layout, its keys HunyuanVideo's: with the family named
    and a HunyuanVideo folder for the rest, the transformer reads 32 channels in and holds the file's weights; with
    the family left to `auto`, a message says the file is another variant."""
    components = load_components(ModelConfig(base=base))
    save_file(FAMILY.layout.to_single_file(components), tmp_path / "skyreels_hunyuan_i2v.safetensors")
    again = load_components(
        ModelConfig(
            base=str(tmp_path / "skyreels_hunyuan_i2v.safetensors"),
            family="hunyuan_video_skyreels_i2v",
            single_file_config=(folder := str(micro_base("hunyuan_video"))),
        )
    )
    assert again.family is FAMILY and again.denoiser.config.in_channels == 32
    theirs = components.denoiser.state_dict()
    assert all(torch.equal(value, theirs[key]) for key, value in again.denoiser.state_dict().items())
    # Left to `auto`, the folder's pipeline class picks HunyuanVideo: the file does not fit it, and says so.
    with pytest.raises(DifftuneError, match=r"does not fit the HunyuanVideo transformer .* set model.family"):
        load_components(ModelConfig(base=str(tmp_path / "skyreels_hunyuan_i2v.safetensors"), single_file_config=folder))


def test_samples_guide_by_the_second_pass_and_name_their_image(base):
    """The embedding reads what training conditioned it on; `sample.guidance_scale` is the second pass's scale (the
    pipeline's `true_cfg_scale`, with the negative prompt); a sample prompt without its image is refused."""
    components = load_components(ModelConfig(base=base, family_options={"guidance": 1.0}))
    guided = FAMILY.drawing.sampling_arguments(components, 6.0, "")
    assert guided | {"max_sequence_length": None} == {
        "max_sequence_length": None,
        "guidance_scale": 1.0,
        "true_cfg_scale": 6.0,
        "negative_prompt": "",
    }
    assert "negative_prompt" not in FAMILY.drawing.sampling_arguments(components, 1.0, "")
    with pytest.raises(DifftuneError, match="animate one"):
        FAMILY.check_config(Config(model=ModelConfig(base=base), sample=SampleConfig(prompts=["a red square"])))
