"""HunyuanVideo 1.5 image-to-video beyond the conformance suite: the first frame's condition and SigLIP image states
made as `HunyuanVideo15ImageToVideoPipeline` makes them from the image it animates (bit for bit), the transformer fed
as the pipeline's loop feeds it, clips trained cached as uncached, samples refused without their image, and the plan
counting the image encoder."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import ClassifierFreeGuidance, HunyuanVideo15ImageToVideoPipeline
from PIL import Image

from difftune.config import Config, ModelConfig, SampleConfig
from difftune.data.clips import write_clip
from difftune.data.dataset import image_to_tensor
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, load_components
from difftune.training.plan import empty_components, plan_memory
from difftune.training.train import train

FAMILY = FAMILIES["hunyuan_video15_i2v"]


@pytest.fixture(scope="module")
def base(micro_base):
    return str(micro_base("hunyuan_video15_i2v"))


def _frame() -> Image.Image:
    frame = Image.new("RGB", (32, 32), (30, 160, 220))
    frame.paste((240, 40, 40), (8, 8, 20, 20))
    return frame


def test_the_first_frame_is_read_as_the_pipeline_gives_it_the_image(base):
    """The pipeline encodes the image it animates to its latents' mode (the first latent frame of a clip of zeros,
    with a mask) and to SigLIP's last states; difftune makes the same from the training window's first frame, bit for
    bit, and one unguided step of the pipeline from pure noise equals the noise less difftune's velocity."""
    components = load_components(ModelConfig(base=base))
    pipeline = HunyuanVideo15ImageToVideoPipeline.from_pretrained(base, dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    frame = _frame()
    clip = torch.cat([image_to_tensor(frame)[None, :, None], torch.rand(1, 3, 4, 32, 32) * 2 - 1], dim=2)
    noise = torch.randn(1, 16, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = FAMILY.conditioning.pixel_conditioning(components, clip)
        theirs_states = pipeline.encode_image(frame, 1, "cpu", torch.float32)
        theirs_condition, theirs_mask = pipeline.prepare_cond_latents_and_mask(
            noise, frame, 1, 32, 32, torch.float32, "cpu"
        )
        conditions = FAMILY.conditions(components, noise, ours)
        pipeline.guider = ClassifierFreeGuidance(guidance_scale=1.0, enabled=False)
        pipeline.target_size = 32  # draw the image's own 32 x 32
        drawn = pipeline(
            image=frame,
            prompt="a red square",
            num_frames=5,
            num_inference_steps=1,
            sigmas=[1.0],
            latents=noise,
            output_type="latent",
        ).frames
        conditioning = FAMILY.conditioning.encode_prompts(
            components, FAMILY.conditioning.tokenize(components.tokenizers, ["a red square"])
        )
        velocity = FAMILY.denoise(components, noise, torch.tensor([1000.0]), conditioning | ours, None)
        text_to_video = FAMILIES["hunyuan_video15"].denoise(
            components, noise, torch.tensor([1000.0]), conditioning, None
        )
    assert torch.equal(ours["image_embeds"], theirs_states)
    torch.testing.assert_close(conditions["clip"], torch.cat([theirs_condition, theirs_mask], dim=1), rtol=0, atol=1e-6)
    torch.testing.assert_close(drawn, noise - velocity, rtol=0, atol=1e-5)
    assert (velocity - text_to_video).abs().max() > 1e-3  # the frame is read


def test_clips_train_cached_as_uncached(make_config, base, tmp_path):
    """The first frame's latents and image states are cached beside each window's posterior: the same losses."""
    data = tmp_path / "data"
    data.mkdir()
    for name in ("left", "right"):
        frames = [Image.new("RGB", (32, 32), (200, 12 * i, 40 if name == "left" else 160)) for i in range(9)]
        write_clip(data / f"{name}.mkv", frames, lossless=True)
        (data / f"{name}.txt").write_text(f'a square moving {name}, a sign that says "{name}"')
    losses = []
    for cached in (False, True):
        run = tmp_path / f"run-{cached}"
        train(
            make_config(
                model__base=base,
                data__path=str(data),
                data__target_frames=[5],
                data__frame_extraction="chunk",
                data__random_flip=True,
                cache__dir=str(tmp_path / "cache"),
                cache__latents=cached,
                cache__text=cached,
                train__max_steps=4,
                train__output_dir=str(run),
                sample__prompts=[],
            )
        )
        lines = (run / "metrics.jsonl").read_text().splitlines()
        losses.append([json.loads(line)["loss"] for line in lines if '"loss"' in line])
    assert len(losses[0]) == 4 and losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_a_sample_without_its_image_is_refused_and_the_plan_counts_the_image_encoder(make_config, base, micro_base):
    """A sample prompt names the image it animates; the plan loads SigLIP's vision tower with the encoders: an I2V
    base's encoders are that tower's bytes more than its text-to-video one's (the micro I2V model is the micro
    text-to-video model's parts and a tower; the published tower's size is tested with the published configs)."""
    with pytest.raises(DifftuneError, match="animate one"):
        FAMILY.check_config(Config(model=ModelConfig(base=base), sample=SampleConfig(prompts=["a red square"])))

    def encoders(base: str) -> int:
        config = make_config(model__base=base, cache__latents=True, cache__text=True, sample__prompts=[])
        return plan_memory(config, "cpu").host_phases["loading and caching"]["encoders"]

    tower = empty_components(Config(model=ModelConfig(base=base))).pixel_encoders["image_encoder"]
    tower_bytes = sum(t.numel() * t.element_size() for t in (*tower.parameters(), *tower.buffers()))
    assert tower_bytes > 0
    assert encoders(base) - encoders(str(micro_base("hunyuan_video15"))) == tower_bytes
