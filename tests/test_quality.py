"""The shapes judge, the tiny-base builder, the committed base's quality, and fine-tuning on its held-out concept."""

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import (
    AutoencoderKLQwenImage,
    AutoencoderTiny,
    ChromaPipeline,
    Flux2KleinPipeline,
    FluxPipeline,
    LTX2Pipeline,
    QwenImage21Pipeline,
    QwenImagePipeline,
    StableDiffusion3Pipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UniPCMultistepScheduler,
    WanPipeline,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from difftune.cli import main
from difftune.config import ModelConfig, load_config
from difftune.families import load_components
from difftune.files import pipeline_index
from difftune.toy.judge import (
    EvalSettings,
    accuracy,
    clip_accuracy,
    judge,
    judge_clip,
    judged_samples,
    prompts_for,
    shape_mask,
)
from difftune.toy.micro import tiny_base_of
from difftune.toy.tiny import COLORS, DIRECTIONS, SHAPES, inpaint_cases, moving_shape_clips, shape_images
from difftune.toy.tiny_base import (
    SEEN_COLORS,
    Recipe,
    build_base,
    clip_tensors,
    color_distances,
    continue_denoiser,
    copy_into_borrowers,
    link_borrowed_files,
    posterior_means,
    psnr,
    refresh_clip_decoder,
    render_tensors,
    train_vae,
)
from difftune.toy.tones import TIMBRES
from difftune.training.train import train

from conftest import REPO

BASE = REPO / "models" / "tiny-sd"
SDXL_BASE = REPO / "models" / "tiny-sdxl"
FLUX_BASE = REPO / "models" / "tiny-flux"
QWEN_BASE = REPO / "models" / "tiny-qwen_image"
QWEN21_BASE = REPO / "models" / "tiny-qwen_image21"
Z_IMAGE_BASE = REPO / "models" / "tiny-z_image"
KLEIN_BASE = REPO / "models" / "tiny-flux2_klein"
FLUX3_BASE = REPO / "models" / "tiny-flux3"
CHROMA_BASE = REPO / "models" / "tiny-chroma"
SD3_BASE = REPO / "models" / "tiny-sd3"
KONTEXT_BASE = REPO / "models" / "tiny-flux_kontext"
QWEN_EDIT_BASE = REPO / "models" / "tiny-qwen_image_edit_plus"
INPAINT_BASE = REPO / "models" / "tiny-sd_inpaint"
WAN_BASE = REPO / "models" / "tiny-wan"
LTX2_BASE = REPO / "models" / "tiny-ltx2"
TURBO_BASE = REPO / "models" / "tiny-z_image_turbo"
SOUND_BASE = REPO / "models" / "tiny-ace_step"


def test_the_judge_names_color_and_shape_of_renders():
    renders = shape_images(750, seed=11)  # 50 of every color/shape pair, random sizes, places, backgrounds
    rows = [dict(zip(("color", "shape"), judge(image), strict=True), prompt=caption) for image, caption in renders]
    scores = accuracy(rows)
    assert scores["color"] >= 0.99 and scores["shape"] >= 0.99, scores


def test_the_clip_judge_names_each_frame_and_the_motion_of_renders():
    """Every frame of the moving-shape clips (tiny.moving_shape_clips: 8 px over 5 frames) judged as a still, and the
    way it moves named; a clip that stands still moves no way."""
    clips = moving_shape_clips(240, seed=12)  # 4 of every color/shape/direction
    rows = [
        dict(zip(("colors", "shapes", "direction"), judge_clip(frames), strict=True), prompt=caption)
        for frames, caption in clips
    ]
    scores = clip_accuracy(rows)
    assert scores["color"] >= 0.99 and scores["shape"] >= 0.99 and scores["direction"] == 1.0, scores
    still = [clips[0][0][0]] * 5
    assert judge_clip(still) == (["red"] * 5, ["circle"] * 5, None)


def test_the_fill_cases_mask_a_shape_and_ask_for_another_color_and_shape():
    """Each inpainting case masks its image's whole shape and some background around it, never all of the image, and
    asks for a color and a shape the image does not have: what is drawn can only come from the prompt."""
    import numpy as np

    for image, mask, prompt in inpaint_cases(24, seed=3, source_colors=SEEN_COLORS):
        inside = np.asarray(mask) > 127
        color, shape = judge(image)
        _, asked_color, asked_shape = prompt.split()
        assert color != asked_color and shape != asked_shape, prompt
        assert not (shape_mask(image) & ~inside).any() and 0.1 < inside.mean() < 1


def test_the_fill_judge_scores_a_fill_in_the_mask_and_refuses_one_that_moves_the_rest(micro_base, monkeypatch):
    """`inpaint_score` through an inpainting family's drawing, its draws replaced: a fill of the asked shape and color
    in the mask's box on the image's own background scores 1 on everything; the same fill with the background
    darkened by 20 levels is not kept; the image given back unchanged is neither the color nor the shape asked."""
    import numpy as np
    from PIL import Image, ImageDraw

    from difftune.toy.judge import inpaint_score

    def fill(image, mask, prompt, background_shift=0):
        _, color, shape = prompt.split()
        pixels = np.asarray(image, dtype=np.int16)
        border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
        background = tuple(int(v) for v in np.clip(np.median(border, axis=0) + background_shift, 0, 255))
        drawn = Image.new("RGB", image.size, background)
        left, top, right, bottom = mask.getbbox()
        box = (left + 3, top + 3, right - 4, bottom - 4)
        draw = ImageDraw.Draw(drawn)
        if shape == "square":
            draw.rectangle(box, fill=COLORS[color])
        elif shape == "circle":
            draw.ellipse(box, fill=COLORS[color])
        else:
            draw.polygon([((box[0] + box[2]) / 2, box[1]), (box[2], box[3]), (box[0], box[3])], fill=COLORS[color])
        return drawn

    components = load_components(ModelConfig(base=str(micro_base("sd_inpaint"))))
    settings = EvalSettings(samples_per_prompt=2, steps=1)
    drawing = type(components.family.drawing)
    for how, expected in (
        (lambda image, mask, prompt: fill(image, mask, prompt), {"all": 1.0}),
        (lambda image, mask, prompt: fill(image, mask, prompt, -20), {"both": 1.0, "kept": 0.0}),
        (lambda image, mask, prompt: image, {"both": 0.0}),
    ):
        monkeypatch.setattr(
            drawing,
            "draw",
            lambda self, pipeline, options, prompt, controls, *_, how=how, **__: [how(*controls, prompt)],
        )
        scores = inpaint_score(components, SEEN_COLORS, "purple", settings)
        assert scores["concept"]["fills"] == 2 * len(SHAPES)
        for key, value in expected.items():
            assert scores["seen"][key] == value and scores["concept"][key] == value, (key, scores)


def test_the_judge_sees_no_shape_on_a_blank_image():
    from PIL import Image

    assert judge(Image.new("RGB", (32, 32), (230, 225, 240))) == (None, None)


def test_the_judge_abstains_on_colored_noise():
    """What an untrained model draws: smooth blobs of many colors. The judge must not name shapes there by chance."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    noise = [
        Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).resize((32, 32), Image.BILINEAR)
        for _ in range(200)
    ]
    named = [judge(image) != (None, None) for image in noise]
    assert np.mean(named) <= 0.1, np.mean(named)


def test_vae_training_improves_reconstruction():
    images = render_tensors(64, seed=5)
    untrained, trained = train_vae(images, steps=0), train_vae(images, steps=40, batch_size=16)
    with torch.no_grad():
        before = psnr(untrained.decode(untrained.encode(images).latent_dist.mean).sample, images)
        after = psnr(trained.decode(trained.encode(images).latent_dist.mean).sample, images)
    assert after > before + 3, (before, after)


def test_the_color_term_puts_the_colors_in_the_first_latent_channels():
    """`train_vae(color_weight=...)`: the posterior means' first three channels learn the renders' colors pooled to
    the latents' size (Qwen-Image's kind, as its tiny base is trained); without the term they hold no such thing."""
    images = render_tensors(64, seed=5)

    def color_error(vae) -> float:
        with torch.no_grad():
            means = vae.encode(images[:, :, None]).latent_dist.mean[:, :3, 0]
        return torch.nn.functional.mse_loss(means, torch.nn.functional.avg_pool2d(images, 4)).item()

    plain, colored = (
        train_vae(images, steps=40, batch_size=16, kind="causal_video", color_weight=weight) for weight in (0.0, 1.0)
    )
    assert color_error(colored) < 0.2 < color_error(plain), (color_error(colored), color_error(plain))  # 0.07, 0.71


@pytest.mark.parametrize(
    "base",
    [BASE, FLUX_BASE, KLEIN_BASE, QWEN_BASE, QWEN21_BASE],
    ids=["tiny-sd", "tiny-flux", "tiny-flux2_klein", "tiny-qwen_image", "tiny-qwen_image21"],
)
def test_committed_autoencoders_keep_every_two_colors_apart(base):
    """No two colors' renders lie much closer in the normalised latents than the others (scores.json: the closest
    pairs are 0.26 (tiny-qwen_image21's blue and purple) to 0.52 apart, the rest up to 1.4): tiny-qwen_image's first
    autoencoder put purple 0.079 from blue, within its posterior's noise, and its default job drew purple squares
    blue."""
    vae = load_components(ModelConfig(base=str(base))).vae
    distances = color_distances(vae)
    assert min(distances.values()) >= 0.25, distances


def test_every_bundled_base_is_built_from_its_familys_tiny_base():
    """models/tiny-<family> for each family that says how its tiny base is built (`TINY_BASE`), the edit and
    inpainting bases its `edit_recipe` and `inpaint_recipe` make, and the turbo base distilled from tiny-z_image; the
    card of each names the family's own pipeline class."""
    from difftune.toy.tiny_base import TINY_BASES

    edits = {family for family, spec in TINY_BASES.items() if spec.edit_recipe}
    inpaints = {family for family, spec in TINY_BASES.items() if spec.inpaint_recipe}
    bundled = {path.name for path in (REPO / "models").iterdir() if pipeline_index(path) is not None}
    made_from_others = {KONTEXT_BASE.name, QWEN_EDIT_BASE.name, INPAINT_BASE.name, TURBO_BASE.name}
    made_from_others.add(SOUND_BASE.name)  # the sound base: tones, not shapes (scripts/make_tiny_sound_base.py)
    assert {f"tiny-{family}" for family in TINY_BASES} == bundled - made_from_others
    assert edits == {"flux", "qwen_image"}  # tiny-flux_kontext's and tiny-qwen_image_edit_plus's sources
    assert inpaints == {"sd"}  # tiny-sd_inpaint's
    for family, spec in TINY_BASES.items():
        card = (REPO / "models" / f"tiny-{family}" / "README.md").read_text()
        assert spec.architecture.split("\n")[0] in card, family
        if spec.autoencoders_from:
            assert pipeline_index(REPO / "models" / spec.autoencoders_from) is not None
    assert "`ZImagePipeline`" in (TURBO_BASE / "README.md").read_text()
    assert "`AceStepPipeline`" in (SOUND_BASE / "README.md").read_text()


@pytest.mark.slow
def test_build_base_writes_an_fp16_pipeline_with_taesd(tmp_path):
    recipe = Recipe(
        family="sd",
        autoencoder_images=64,
        vae_steps=3,
        vae_decoder_steps=3,
        taesd_steps=3,
        autoencoder_batch=8,
        train_images_per_prompt=1,
        validation_images_per_prompt=1,
        steps=2,
        batch_size=4,
    )
    facts = build_base(tmp_path / "base", tmp_path / "work", recipe)
    assert set(facts["autoencoders"]) >= {"vae_psnr_db", "taesd_psnr_db", "taesd_latent_rmse"}
    with safe_open(tmp_path / "base" / "unet" / "diffusion_pytorch_model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    pipeline = StableDiffusionPipeline.from_pretrained(tmp_path / "base", safety_checker=None, dtype=torch.float32)
    assert pipeline.unet.config.block_out_channels == [32, 64, 64]
    taesd = AutoencoderTiny.from_pretrained(tmp_path / "base" / "taesd")
    assert taesd.config.latent_channels == pipeline.vae.config.latent_channels


def _small_recipe(family: str) -> Recipe:
    """The family's tiny-base recipe (its own autoencoder trained) at a few steps of each stage on 64 renders: a build
    that runs in seconds."""
    small = {"steps": 2, "vae_steps": 3, "vae_decoder_steps": 3, "taesd_steps": 3}
    return Recipe(
        autoencoder_images=64,
        autoencoder_batch=8,
        train_images_per_prompt=1,
        validation_images_per_prompt=1,
        batch_size=4,
        family=family,
        **tiny_base_of(family).recipe | small,
    )


def _small_clip_recipe(family: str) -> Recipe:
    """A video family's tiny-base recipe at two steps of each stage on 16 clips, one a prompt to train on."""
    small = {
        "steps": 2,
        "vae_steps": 2,
        "vae_decoder_steps": 2,
        "batch_size": 4,
        "train_images_per_prompt": 1,
        "validation_images_per_prompt": 1,
    }
    return Recipe(autoencoder_images=32, autoencoder_batch=8, family=family, **tiny_base_of(family).recipe | small)


@pytest.mark.slow
def test_build_sdxl_base_reuses_the_autoencoders(tmp_path):
    recipe = Recipe(train_images_per_prompt=1, validation_images_per_prompt=1, steps=2, batch_size=4, family="sdxl")
    facts = build_base(tmp_path / "base", tmp_path / "work", recipe, autoencoders_from=BASE)
    assert facts["seconds"]["autoencoders"] < 60  # loaded, not trained
    pipeline = StableDiffusionXLPipeline.from_pretrained(tmp_path / "base", dtype=torch.float32)
    assert pipeline.unet.config.addition_embed_type == "text_time"
    assert pipeline.config.force_zeros_for_empty_prompt is False  # trained with empty-caption dropout
    for name in ("vae", "taesd"):
        with (
            safe_open(tmp_path / "base" / name / "diffusion_pytorch_model.safetensors", "pt") as ours,
            safe_open(BASE / name / "diffusion_pytorch_model.safetensors", "pt") as theirs,
        ):
            assert all(torch.equal(ours.get_tensor(k), theirs.get_tensor(k)) for k in theirs.keys())


@pytest.mark.slow
def test_build_flux_base_trains_its_own_shifted_16_channel_autoencoders(tmp_path):
    build_base(tmp_path / "base", tmp_path / "work", _small_recipe("flux"))
    pipeline = FluxPipeline.from_pretrained(tmp_path / "base", dtype=torch.float32)
    assert pipeline.vae.config.latent_channels == 16 and pipeline.vae.config.shift_factor != 0
    assert pipeline.transformer.config.num_layers == 2 and not pipeline.transformer.config.guidance_embeds
    assert AutoencoderTiny.from_pretrained(tmp_path / "base" / "taesd").config.latent_channels == 16
    assert type(pipeline.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"


@pytest.mark.slow
def test_build_flux2_klein_base_trains_its_own_batch_normalised_autoencoder(tmp_path):
    build_base(tmp_path / "base", tmp_path / "work", _small_recipe("flux2_klein"))
    pipeline = Flux2KleinPipeline.from_pretrained(tmp_path / "base", dtype=torch.float32)
    init = Flux2KleinPipeline.from_pretrained(tmp_path / "work" / "init", dtype=torch.float32)
    # The batch norm holds its own patched latents' statistics, as training FLUX.2's autoencoder leaves them.
    latents = posterior_means(pipeline.vae, render_tensors(64, seed=100))
    assert latents.shape[1] == 4 * pipeline.vae.config.latent_channels
    torch.testing.assert_close(pipeline.vae.bn.running_mean, latents.mean(dim=(0, 2, 3)), rtol=0.05, atol=0.02)
    # The language model stays at its random init (fp16 in the saved base); the caption length is the tokenizer's.
    weight = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(
        pipeline.text_encoder.state_dict()[weight], init.text_encoder.state_dict()[weight], rtol=1e-3, atol=1e-3
    )
    assert pipeline.tokenizer.model_max_length == 48
    assert AutoencoderTiny.from_pretrained(tmp_path / "base" / "taesd").config.latent_channels == 32


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sd3", "chroma"])
def test_build_sd3_and_chroma_bases_reuse_tiny_fluxs_autoencoders(family, tmp_path):
    """Their recipes' transformer sizes, their pipelines' schedulers, and the text encoders their full fine-tune
    trains: SD3's two CLIPs (never T5, which its pipeline's loader never adapts), Chroma's T5."""
    recipe = Recipe(
        train_images_per_prompt=1,
        validation_images_per_prompt=1,
        batch_size=4,
        family=family,
        **tiny_base_of(family).recipe | {"steps": 2},
    )
    facts = build_base(tmp_path / "base", tmp_path / "work", recipe, autoencoders_from=FLUX_BASE)
    assert facts["seconds"]["autoencoders"] < 60  # loaded, not trained
    pipeline_class = StableDiffusion3Pipeline if family == "sd3" else ChromaPipeline
    built, init = (
        pipeline_class.from_pretrained(path, dtype=torch.float32)
        for path in (tmp_path / "work" / "run" / "model", tmp_path / "work" / "init")
    )
    blocks = len(built.transformer.transformer_blocks) + len(
        getattr(built.transformer, "single_transformer_blocks", [])
    )
    assert blocks == (recipe.dit_layers if family == "sd3" else sum(recipe.flux_layers))
    trained = {
        name: any(
            not torch.equal(a, b)
            for a, b in zip(getattr(built, name).parameters(), getattr(init, name).parameters(), strict=True)
        )
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3")
        if hasattr(built, name)
    }
    assert trained == (
        {"text_encoder": True, "text_encoder_2": True, "text_encoder_3": False}
        if family == "sd3"
        else {"text_encoder": True}
    )
    scheduler = pipeline_class.from_pretrained(tmp_path / "base", dtype=torch.float32).scheduler.config
    assert scheduler.use_dynamic_shifting == (family == "chroma") and (family == "chroma" or scheduler.shift == 3.0)


def test_build_qwen_image_base_trains_its_own_wan_autoencoder_and_language_model(tmp_path):
    build_base(tmp_path / "base", tmp_path / "work", _small_recipe("qwen_image"))
    pipeline = QwenImagePipeline.from_pretrained(tmp_path / "base", dtype=torch.float32)
    assert pipeline.tokenizer.tokenize("a purple square") == ["a", "Ġpurple", "Ġsquare"]  # a token per caption word
    init = QwenImagePipeline.from_pretrained(tmp_path / "work" / "init", dtype=torch.float32)
    # Per-channel statistics of its own latents, as Wan's autoencoder states them.
    latents = posterior_means(pipeline.vae, render_tensors(64, seed=100))
    assert len(pipeline.vae.config.latents_mean) == 16 and pipeline.transformer.config.num_layers == 4
    torch.testing.assert_close(
        torch.tensor(pipeline.vae.config.latents_std), latents.std(dim=(0, 2, 3)), rtol=0.05, atol=0.02
    )
    # The language model is trained with the transformer (a full fine-tune with adapter.text_encoder; the EMA weights
    # saved as the base barely move in 2 steps, the trained ones do).
    trained = QwenImagePipeline.from_pretrained(tmp_path / "work" / "run" / "model", dtype=torch.float32)
    weight = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(trained.text_encoder.state_dict()[weight], init.text_encoder.state_dict()[weight])
    assert AutoencoderTiny.from_pretrained(tmp_path / "base" / "taesd").config.latent_channels == 16
    assert pipeline.scheduler.config.shift_terminal == 0.02  # Qwen-Image's own scheduler config


def test_build_qwen_image21_base_trains_its_own_rgba_autoencoder_at_16x(tmp_path):
    """tiny-qwen_image21's autoencoder reads the renders as opaque RGBA and puts a 32 px render in 2 x 2 latents of 64
    channels (the real one's 16x and width), its statistics its latents' per channel; TAESD encodes to the same
    latents at 16x; the transformer reads 64-channel tokens; the language model stays at its random init."""
    build_base(tmp_path / "base", tmp_path / "work", _small_recipe("qwen_image21"))
    pipeline = QwenImage21Pipeline.from_pretrained(tmp_path / "base", dtype=torch.float32)
    assert pipeline.vae.config.in_channels == 4 and pipeline.transformer.config.in_channels == 64
    renders = render_tensors(16, seed=100)
    latents = posterior_means(pipeline.vae, renders)
    assert latents.shape == (16, 64, 2, 2)
    opaque = torch.cat([renders, torch.ones_like(renders[:, :1])], dim=1)  # what it read: RGBA, alpha 1
    torch.testing.assert_close(latents, pipeline.vae.encode(opaque[:, :, None]).latent_dist.mean[:, :, 0])
    latents = posterior_means(pipeline.vae, render_tensors(64, seed=100))
    torch.testing.assert_close(
        torch.tensor(pipeline.vae.config.latents_std), latents.std(dim=(0, 2, 3)), rtol=0.05, atol=0.02
    )
    taesd = AutoencoderTiny.from_pretrained(tmp_path / "base" / "taesd")
    assert taesd.encode(renders).latents.shape == (16, 64, 2, 2)
    trained = QwenImage21Pipeline.from_pretrained(tmp_path / "work" / "run" / "model", dtype=torch.float32)
    init = QwenImage21Pipeline.from_pretrained(tmp_path / "work" / "init", dtype=torch.float32)
    weight = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(trained.text_encoder.state_dict()[weight], init.text_encoder.state_dict()[weight])  # frozen
    weight = "transformer_blocks.0.attn.to_q.weight"
    assert not torch.equal(trained.transformer.state_dict()[weight], init.transformer.state_dict()[weight])


def test_build_wan_base_teaches_tiny_qwen_images_autoencoder_time_and_trains_on_clips(tmp_path):
    """tiny-wan's autoencoder starts from tiny-qwen_image's (stills) and trains on moving-shape clips; its statistics
    are its clip latents' per channel; no TAESD (AutoencoderTiny reads images alone); its transformer learns from
    5-frame clips (a training window's latents have 3 frames) with UMT5 frozen, sampled by Wan's UniPC."""
    recipe = _small_clip_recipe("wan")
    facts = build_base(tmp_path / "base", tmp_path / "work", recipe, QWEN_BASE)
    pipeline = WanPipeline.from_pretrained(tmp_path / "base", dtype=torch.float32)
    lender = AutoencoderKLQwenImage.from_pretrained(QWEN_BASE / "vae", dtype=torch.float32)
    assert pipeline.vae.state_dict().keys() == lender.state_dict().keys()
    latents = posterior_means(pipeline.vae, clip_tensors(16, seed=100), batch_size=16)
    assert latents.shape == (16, 16, 3, 8, 8)
    torch.testing.assert_close(
        torch.tensor(pipeline.vae.config.latents_std), latents.std(dim=(0, 2, 3, 4)), rtol=0.1, atol=0.05
    )
    assert set(facts["autoencoders"]) == {"vae_psnr_db", "first_frame_psnr_db", "later_frames_psnr_db"}
    assert not (tmp_path / "base" / "taesd").exists() and pipeline.transformer.config.num_layers == 4
    assert isinstance(pipeline.scheduler, UniPCMultistepScheduler) and pipeline.scheduler.config.flow_shift == 3.0
    clips = sorted((tmp_path / "work" / "train").glob("*.mkv"))
    assert len(clips) == len(SEEN_COLORS) * len(SHAPES) * len(DIRECTIONS)
    trained = WanPipeline.from_pretrained(tmp_path / "work" / "run" / "model", dtype=torch.float32)
    init = WanPipeline.from_pretrained(tmp_path / "work" / "init", dtype=torch.float32)
    weight = "encoder.block.0.layer.0.SelfAttention.q.weight"
    assert torch.equal(trained.text_encoder.state_dict()[weight], init.text_encoder.state_dict()[weight])  # frozen


def test_build_ltx2_base_trains_its_own_video_autoencoder_from_scratch_and_its_transformer_on_clips(tmp_path):
    """tiny-ltx2 has no lender: its autoencoder (LTX-2's kind at 4x in space and time, 16 channels) trains on clips
    from its random init, its statistics its clip latents' per channel (buffers, as LTX-2's keeps them); no TAESD; its
    transformer learns from 5-frame clips (2 latent frames) with Gemma 3 and the connectors frozen."""
    recipe = _small_clip_recipe("ltx2")
    facts = build_base(tmp_path / "base", tmp_path / "work", recipe)
    pipeline = LTX2Pipeline.from_pretrained(tmp_path / "base", dtype=torch.float32)
    latents = posterior_means(pipeline.vae, clip_tensors(16, seed=100), batch_size=16)
    assert latents.shape == (16, 16, 2, 8, 8)
    torch.testing.assert_close(pipeline.vae.latents_std, latents.std(dim=(0, 2, 3, 4)), rtol=0.1, atol=0.05)
    assert set(facts["autoencoders"]) == {"vae_psnr_db", "first_frame_psnr_db", "later_frames_psnr_db"}
    assert not (tmp_path / "base" / "taesd").exists() and pipeline.transformer.config.num_layers == 4
    trained = LTX2Pipeline.from_pretrained(tmp_path / "work" / "run" / "model", dtype=torch.float32)
    init = LTX2Pipeline.from_pretrained(tmp_path / "work" / "init", dtype=torch.float32)
    for part in ("text_encoder", "connectors"):  # frozen
        for name, weight in getattr(init, part).state_dict().items():
            assert torch.equal(getattr(trained, part).state_dict()[name], weight), (part, name)
    block = "transformer_blocks.0.attn1.to_q.weight"
    assert not torch.equal(trained.transformer.state_dict()[block], init.transformer.state_dict()[block])

    # `make_tiny_base.py --refresh-decoder`: the built base's decoder trains again alone; its encoder, and so every
    # latent its transformer learned from, stays as it was, and so do the statistics and the transformer.
    (tmp_path / "base" / "scores.json").write_text(json.dumps(facts))
    refreshed = refresh_clip_decoder(tmp_path / "base", tmp_path / "work", replace(recipe, vae_decoder_steps=3))
    after = LTX2Pipeline.from_pretrained(tmp_path / "base", dtype=torch.float32)
    torch.testing.assert_close(posterior_means(after.vae, clip_tensors(16, seed=100), batch_size=16), latents)
    assert torch.equal(after.vae.latents_std, pipeline.vae.latents_std)
    assert all(
        torch.equal(weight, pipeline.vae.encoder.state_dict()[name])
        for name, weight in after.vae.encoder.state_dict().items()
    )
    assert any(
        not torch.equal(w, pipeline.vae.decoder.state_dict()[n]) for n, w in after.vae.decoder.state_dict().items()
    )
    assert torch.equal(after.transformer.state_dict()[block], pipeline.transformer.state_dict()[block])
    assert refreshed["recipe"]["vae_decoder_steps"] == 3 and "autoencoder_decoder" in refreshed["seconds"]
    assert refreshed["autoencoders"]["vae_psnr_db"] != facts["autoencoders"]["vae_psnr_db"]

    # `make_tiny_base.py --continue-steps`: the built base's transformer trains on from its saved weights; the
    # autoencoder and the frozen parts stay, and the facts number the new validation losses on from the build's.
    (tmp_path / "base" / "scores.json").write_text(json.dumps(refreshed))
    continued = continue_denoiser(tmp_path / "base", tmp_path / "work", recipe, steps=2)
    longer = LTX2Pipeline.from_pretrained(tmp_path / "base", dtype=torch.float32)
    assert not torch.equal(longer.transformer.state_dict()[block], after.transformer.state_dict()[block])
    for part in ("vae", "text_encoder", "connectors"):
        for name, weight in getattr(after, part).state_dict().items():
            assert torch.equal(getattr(longer, part).state_dict()[name], weight), (part, name)
    assert continued["continued"] == [{"steps": 2, "learning_rate": recipe.learning_rate / 2}]
    steps = [row["step"] for row in continued["validation_loss"]]
    assert steps == sorted(steps) and len(steps) > len(facts["validation_loss"]), steps
    assert continued["seconds"]["autoencoder_decoder"] == refreshed["seconds"]["autoencoder_decoder"]


# The bases whose default job CI runs are held to more than this by that job's test (its base's seen prompts >= 0.95
# at 8 samples per prompt): these are the bundled bases CI runs no job on.
@pytest.mark.parametrize("base", [KLEIN_BASE], ids=["tiny-flux2_klein"])
def test_committed_base_draws_the_seen_prompts(base):
    # Measured at 8 samples per prompt in each base's scores.json; the floors sit well under it.
    components = load_components(ModelConfig(base=str(base)))
    assert components.denoiser.dtype == torch.float32  # fp16 files, loaded as fp32
    rows = judged_samples(components, prompts_for(SEEN_COLORS), EvalSettings(samples_per_prompt=2))
    scores = accuracy(rows)
    assert scores["color"] >= 0.75 and scores["shape"] >= 0.6, scores


# The jobs that are not a shipped config run as it is and judged at the eval's defaults (20 steps, guided at 3): their
# config, its overrides, and the eval's arguments. A turbo base is judged as it is drawn: 4 steps, unguided.
TURBO_EVAL = ["--steps", "4", "--guidance-scale", "1"]
JOB_RUNS = {
    "tiny_turbo_lora": ("tiny_turbo_lora", [], TURBO_EVAL),
    "tiny_turbo_lora_without_training_adapter": ("tiny_turbo_lora", ["model.training_adapter="], TURBO_EVAL),
}


def job_report(job: str, base: str, folder: str) -> dict:
    """The default job `configs/<job>.toml` run as shipped (no samples), or as `JOB_RUNS` says, then `difftune eval` of
    its adapter on `base` (8 samples per prompt): the report it writes. In a process of its own, on one thread: another
    job runs beside it (`job_reports`)."""
    torch.set_num_threads(1)
    config_name, overrides, eval_arguments = JOB_RUNS.get(job, (job, [], []))
    config = load_config(
        REPO / "configs" / f"{config_name}.toml",
        [
            *overrides,
            f"train.output_dir={folder}/run",
            "log.progress_bar=false",
            "log.tensorboard=false",
            "sample.prompts=[]",
        ],
    )
    result = train(config)
    arguments = ["--base", base, "--adapter", str(result.trained_path), "--samples-per-prompt", "8", *eval_arguments]
    assert main(["eval", *arguments, "--out", f"{folder}/eval.json"]) == 0
    return json.loads(Path(f"{folder}/eval.json").read_text())


@pytest.fixture(scope="module")
def job_reports(request, tmp_path_factory) -> dict:
    """The default jobs this session's tests ask for (their `job, base` and `compared_job` parameters), run two at a
    time, each in a process of its own on one thread: CI's two cores train two tiny jobs in about 0.65 of the time they
    take one after the other on both (150 steps of the Z-Image job: 10.4 s on one thread, 8.0 s on two). {job: its
    report's future}"""
    wanted = {
        item.callspec.params[key]: str(item.callspec.params["base"])
        for item in request.session.items
        if "job_reports" in item.fixturenames and hasattr(item, "callspec")
        for key in ("job", "compared_job")  # a test's job, and the one it is compared with
        if key in item.callspec.params
    }
    folder = tmp_path_factory.mktemp("jobs")
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        running = {job: pool.submit(job_report, job, base, str(folder / job)) for job, base in wanted.items()}
        for future in running.values():  # all done before the pool closes; each test reads (or raises) its own
            future.exception()
    return running


@pytest.mark.slow
# Not tiny-flux2_klein: its job meets every target at seeds 0 and 1 with no sample to spare, and draws purple squares
# at 0.875 at seed 2.
# SDXL's, Qwen-Image's, Z-Image's, SD3's, FLUX.3's and Chroma's default jobs are the quality sweep (`pytest -m sweep
# tests/test_quality.py`, a few minutes on 2 cores), outside CI's 45 minutes: their objectives are the jobs CI runs
# (SD's noise prediction; the flow matching of Flux.1, Qwen-Image 2.1, Kontext, Qwen-Image-Edit, Wan and LTX-2), and
# docs/benchmarks.md has their rows from scripts/bench_quality.py.
@pytest.mark.parametrize(
    "job, base",
    [
        pytest.param("tiny_lora", BASE, id="tiny-sd"),
        pytest.param("flux_lora", FLUX_BASE, id="tiny-flux"),
        pytest.param("qwen_image21_lora", QWEN21_BASE, id="tiny-qwen_image21"),
        pytest.param("flux3_lora", FLUX3_BASE, id="tiny-flux3", marks=pytest.mark.sweep),
        pytest.param("chroma_lora", CHROMA_BASE, id="tiny-chroma", marks=pytest.mark.sweep),
        pytest.param("sdxl_lora", SDXL_BASE, id="tiny-sdxl", marks=pytest.mark.sweep),
        pytest.param("qwen_image_lora", QWEN_BASE, id="tiny-qwen_image", marks=pytest.mark.sweep),
        pytest.param("z_image_lora", Z_IMAGE_BASE, id="tiny-z_image", marks=pytest.mark.sweep),
        pytest.param("sd3_lora", SD3_BASE, id="tiny-sd3", marks=pytest.mark.sweep),
    ],
)
def test_fine_tuning_teaches_the_held_out_color(job_reports, job, base):
    """Each default job against the targets docs/benchmarks.md publishes, scored as published (8 samples per prompt):
    base seen prompts >= 0.95 color and shape, purple <= 0.15 before and >= 0.90 for every shape after, forgetting
    <= 0.05. The UNet-only LoRA that docs/benchmarks.md measured (forgetting 0.25) fails here."""
    report = job_reports[job].result()
    before, after = report["before"], report["after"]
    assert before["seen"]["color"] >= 0.95 and before["seen"]["shape"] >= 0.95, before["seen"]
    assert before["concept"]["both"] <= 0.15
    assert all(after["concept_by_shape"][shape]["both"] >= 0.90 for shape in SHAPES), after["concept_by_shape"]
    assert report["forgetting"] <= 0.05, report["forgetting"]
    assert set(COLORS) > set(SEEN_COLORS)


@pytest.mark.slow
@pytest.mark.parametrize(
    "job, base, every_shape",
    [("wan_lora", WAN_BASE, False), ("ltx2_lora", LTX2_BASE, True)],
    ids=["tiny-wan", "tiny-ltx2"],
)
def test_the_video_jobs_teach_purple_from_clips(job_reports, job, base, every_shape):
    """Each video default job against the issue's targets, scored as published (8 clips per color and shape, 2 per
    direction; docs/benchmarks.md): the base draws the seen colors, shapes and directions >= 0.90 and purple <= 0.15;
    after the job purple (color and shape, every frame) >= 0.90 for every shape (Wan's, an earlier family's: on average
    over the shapes; its squares are drawn at 0.825), the direction kept >= 0.90, forgetting (seen color and shape per
    frame, and seen directions) <= 0.05."""
    report = job_reports[job].result()
    before, after = report["before"], report["after"]
    assert report["scored"] == "clips" and after["concept"]["clips"] == 2 * len(DIRECTIONS) * len(SHAPES)
    assert min(before["seen"][score] for score in ("color", "shape", "direction")) >= 0.90, before["seen"]
    assert before["concept"]["both"] <= 0.15, before["concept"]
    assert after["concept"]["both"] >= 0.90 and after["concept"]["direction"] >= 0.90, after["concept"]
    if every_shape:  # the issue's target for LTX-2's job
        assert all(after["concept_by_shape"][shape]["both"] >= 0.90 for shape in SHAPES), after["concept_by_shape"]
    seen = after["seen"]
    assert report["forgetting"] <= 0.05 and seen["direction"] >= before["seen"]["direction"] - 0.05, seen


@pytest.mark.slow
@pytest.mark.parametrize("job, base", [("flux_kontext_edit", KONTEXT_BASE), ("qwen_image_edit", QWEN_EDIT_BASE)])
def test_fine_tuning_teaches_the_held_out_edit(job_reports, job, base):
    """Each edit default job against the issue's targets, scored as published (8 fixed pairs per color and shape):
    the edit base does the seen edits >= 0.90 and never the held-out one; after the job the held-out edit >= 0.90
    with the shape kept >= 0.90 and in place, and the seen edits drop <= 0.05."""
    report = job_reports[job].result()
    before, after = report["before"], report["after"]
    assert report["scored"] == "edits" and after["concept"]["edits"] == 8 * len(SHAPES)
    assert before["seen"]["both"] >= 0.90 and before["concept"]["color"] <= 0.15, before
    assert after["concept"]["both"] >= 0.90 and after["concept"]["shape"] >= 0.90, after["concept"]
    assert after["concept"]["place"] >= 0.90, after["concept"]
    assert report["forgetting"] <= 0.05, report["forgetting"]


@pytest.mark.slow
@pytest.mark.parametrize("job, base", [("tiny_inpaint_lora", INPAINT_BASE)], ids=["tiny-sd_inpaint"])
def test_fine_tuning_teaches_the_held_out_fill(job_reports, job, base):
    """The inpainting default job, scored as published (8 fixed fills per color and shape; docs/benchmarks.md): the
    inpainting base fills the seen colors' shapes >= 0.95, inside the mask; after the job purple >= 0.90 for every
    shape, inside the mask >= 0.90, the seen fills drop <= 0.05, and the rest of the image is kept about as well as the
    base keeps it (mean difference outside the mask within 3 levels of the base's: 10.7 against 8.8 measured). Not
    held: the rest kept within 12 levels in every fill (the base: 0.75 of its fills), and purple <= 0.15 before (the
    base fills triangles purple-ish at 0.88 from the unseen word)."""
    report = job_reports[job].result()
    before, after = report["before"], report["after"]
    assert report["scored"] == "fills" and after["concept"]["fills"] == 8 * len(SHAPES)
    assert before["seen"]["both"] >= 0.95 and before["seen"]["inside"] >= 0.95, before["seen"]
    assert all(after["concept_by_shape"][shape]["both"] >= 0.90 for shape in SHAPES), after["concept_by_shape"]
    assert after["concept"]["inside"] >= 0.90, after["concept"]
    assert after["concept"]["kept_difference"] <= before["seen"]["kept_difference"] + 3, (after, before)
    assert report["forgetting"] <= 0.05, report["forgetting"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "job, base, compared_job",
    [("tiny_turbo_lora", TURBO_BASE, "tiny_turbo_lora_without_training_adapter")],
    ids=["tiny-z_image_turbo"],
)
def test_the_training_adapter_keeps_the_turbo_bases_few_step_drawing(job_reports, job, base, compared_job):
    """The turbo default job, judged as the turbo is drawn (4 unguided steps, 8 samples per prompt;
    docs/benchmarks.md): the turbo base draws the seen prompts >= 0.95 and never purple; over its training adapter, with
    the turbo's own drawings of the seen prompts beside the purple renders, the job draws purple >= 0.85 (0.875-1.00
    measured at seeds 0-2) and the seen prompts drop <= 0.06 (0.010-0.042; one sample of 96 is 0.010); the same run
    without the training adapter drops them by 0.02 more at least (0.052-0.083). Not held: purple >= 0.90 for every
    shape (a circle and a square of 8 misshapen in 4 steps at seed 0, three squares at seed 2)."""
    report, without = job_reports[job].result(), job_reports[compared_job].result()
    before, after = report["before"], report["after"]
    assert report["settings"]["steps"] == 4 and report["settings"]["guidance_scale"] == 1.0
    assert before["seen"]["both"] >= 0.95 and before["concept"]["both"] <= 0.15, before
    assert after["concept"]["both"] >= 0.85, after["concept_by_shape"]
    assert report["forgetting"] <= 0.06, report["forgetting"]
    assert without["forgetting"] >= report["forgetting"] + 0.02, (without["forgetting"], report["forgetting"])


@pytest.mark.slow
@pytest.mark.parametrize("job, base", [("tiny_ace_step_lora", SOUND_BASE)], ids=["tiny-ace_step"])
def test_the_sound_job_teaches_the_held_out_pitch(job_reports, job, base):
    """The sound default job, judged by the tone judge as published (8 one-second sounds per prompt;
    docs/benchmarks.md): the sound base plays the heard pitches' prompts in pitch >= 0.95, in pitch and timbre >= 0.80
    (its autoencoder makes a middle buzz as a hum: 0.83 measured), and the shrill prompts' pitch <= 0.15; after the
    job, shrill in pitch and timbre >= 0.90 in each timbre (1.00 measured) and the heard prompts drop <= 0.05."""
    report = job_reports[job].result()
    before, after = report["before"], report["after"]
    assert report["scored"] == "sounds" and after["concept"]["sounds"] == 8 * len(TIMBRES)
    assert before["seen"]["pitch"] >= 0.95 and before["seen"]["both"] >= 0.80, before["seen"]
    assert before["concept"]["pitch"] <= 0.15, before["concept"]
    assert all(after["concept_by_timbre"][timbre]["both"] >= 0.90 for timbre in TIMBRES), after["concept_by_timbre"]
    assert report["forgetting"] <= 0.05, report["forgetting"]


def test_bundled_bases_link_the_files_they_share_and_rebuilds_leave_borrowers_their_copy(tmp_path):
    lender, borrower = tmp_path / "tiny-a", tmp_path / "tiny-b"
    for base in (lender, borrower):
        (base / "vae").mkdir(parents=True)
        save_file({"w": torch.arange(4.0)}, base / "vae" / "model.safetensors")
        save_file({"w": torch.full((4,), float(base.name == "tiny-b"))}, base / "unet.safetensors")
    link_borrowed_files(borrower, tmp_path)
    shared = borrower / "vae" / "model.safetensors"
    assert shared.is_symlink() and shared.resolve() == (lender / "vae" / "model.safetensors").resolve()
    assert not (borrower / "unet.safetensors").is_symlink()  # its own bytes
    assert torch.equal(load_file(shared)["w"], torch.arange(4.0))
    copy_into_borrowers(lender, tmp_path)  # what a rebuild of the lender does first
    save_file({"w": torch.zeros(4)}, lender / "vae" / "model.safetensors")
    assert not shared.is_symlink() and torch.equal(load_file(shared)["w"], torch.arange(4.0))


@pytest.mark.parametrize("base", sorted(path.name for path in (REPO / "models").glob("tiny-*")))
def test_each_bundled_base_loads_in_its_pipeline_as_published_folders_do(base, monkeypatch):
    """diffusers' own `from_pretrained` of the pipeline class the folder names reads every bundled base, processors
    included (a Qwen-VL processor's video processor settings, which transformers reads wherever torchvision is
    installed), and no JSON keeps a build's folder (`_name_or_path`: Wan's memory plan followed it to the hub)."""
    import diffusers
    from transformers.video_processing_utils import BaseVideoProcessor

    folder = REPO / "models" / base
    for path in folder.glob("**/*.json"):
        text = path.read_text()
        assert '"_name_or_path"' not in text and "output/" not in text, path
    for path in folder.glob("*/processor_config.json"):
        if "VL" in json.loads(path.read_text())["processor_class"]:
            settings, _ = BaseVideoProcessor.get_video_processor_dict(str(path.parent))
            assert settings["video_processor_type"].endswith("VideoProcessor"), path
    monkeypatch.chdir(REPO)  # a modular index names its parts' folder from the checkout's root
    index = pipeline_index(folder)
    if (folder / "model_index.json").is_file():
        pipeline = getattr(diffusers, index["_class_name"]).from_pretrained(folder, dtype=torch.float32)
    else:
        pipeline = diffusers.ModularPipeline.from_pretrained(str(folder))
        pipeline.load_components(torch_dtype=torch.float32)
    parts = {name for name, spec in index.items() if not name.startswith("_") and isinstance(spec, list) and spec[0]}
    assert parts and all(getattr(pipeline, name, None) is not None for name in parts), parts
