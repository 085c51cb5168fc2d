"""Reward fine-tuning (Flow-GRPO / DDPO's policy, DRaFT-K): the stochastic samplers against diffusers' schedulers and
the marginals they must keep, the policy's log-probabilities, and runs that draw, score and train."""

import importlib
import math

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler
from safetensors.torch import load_file

from difftune.config import LossConfig
from difftune.errors import DifftuneError
from difftune.families import load_components
from difftune.families.common.flow import FlowMatching
from difftune.families.common.objective import DDPM
from difftune.toy.judge import shapes_reward
from difftune.training.metrics import read_metrics
from difftune.training.reward import gaussian_log_prob, reward_batches
from difftune.training.train import train


class _Scheduled:
    """Components with nothing but a noise scheduler, as the objectives' sampler steps read them."""

    def __init__(self, scheduler):
        self.noise_scheduler = scheduler


SD_SCHEDULE = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "steps_offset": 1,
    "set_alpha_to_one": False,
    "clip_sample": False,
}


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("eta", [0.0, 1.0, 0.7])
def test_the_ddim_policy_step_is_diffusers_ddim_step(prediction, eta):
    """Every step of a 10-step schedule, from the same state, prediction and noise: diffusers' DDIM with this eta."""
    ddim = DDIMScheduler(**SD_SCHEDULE, prediction_type=prediction)
    components = _Scheduled(ddim)
    generator = torch.Generator().manual_seed(0)
    noisy = torch.randn(2, 4, 8, 8, generator=generator)
    schedule = DDPM().sampling_timesteps(components, noisy, 10)
    ddim.set_timesteps(10)
    torch.testing.assert_close(schedule[:-1], ddim.timesteps)
    for index in range(10):
        prediction_ = torch.randn(noisy.shape, generator=generator)
        noise = torch.randn(noisy.shape, generator=generator)
        mean, std = DDPM().sampler_step(components, schedule, index, noisy, prediction_, eta, LossConfig())
        expected = ddim.step(prediction_, schedule[index], noisy, eta=eta, variance_noise=noise).prev_sample
        torch.testing.assert_close(mean + std * noise, expected, rtol=1e-5, atol=1e-5)


def _flux_scheduler() -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096
    )


class _FlowFamily:
    @staticmethod
    def image_tokens(latents):
        return latents.shape[-1] * latents.shape[-2] // 4


@pytest.mark.parametrize("scheduler", [_flux_scheduler(), FlowMatchEulerDiscreteScheduler(shift=3.0)])
def test_the_flow_policy_at_noise_0_is_the_pipelines_euler_sampler(scheduler):
    """The schedule is the pipelines' (sigmas 1 .. 1/N, shifted as the scheduler shifts this size; Flux's by its
    image's tokens), and at noise level 0 each step is the scheduler's own Euler step."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    components = _Scheduled(scheduler)
    components.family = _FlowFamily()
    noisy = torch.randn(1, 16, 64, 64, generator=torch.Generator().manual_seed(1))
    schedule = FlowMatching().sampling_timesteps(components, noisy, 8)
    sigmas = [1 - k / 8 for k in range(8)]
    mu = calculate_shift(64 * 64 // 4) if scheduler.config.use_dynamic_shifting else None
    scheduler.set_timesteps(sigmas=sigmas, mu=mu)
    torch.testing.assert_close(schedule, scheduler.sigmas * 1000, rtol=1e-5, atol=1e-3)
    for index in range(8):
        velocity = torch.randn(noisy.shape, generator=torch.Generator().manual_seed(index))
        mean, std = FlowMatching().sampler_step(components, schedule, index, noisy, velocity, 0.0, LossConfig())
        expected = scheduler.step(velocity, scheduler.timesteps[index], noisy).prev_sample
        assert float(std) == 0
        torch.testing.assert_close(mean, expected, rtol=1e-5, atol=1e-5)
        noisy = expected


@pytest.mark.parametrize("objective", ["flow", "ddim"])
def test_the_stochastic_steps_keep_the_marginals_of_the_noise_process(objective):
    """Data that is one point x0 has an exact denoiser. From latents at one noise level, drawn as the process noises
    x0, stochastic steps (at a nonzero noise level) with the exact prediction must land on a later level's marginal:
    the mean and spread the process gives x0 there; a wrong drift or noise scale moves either. DDIM keeps them at any
    step size; Flow-GRPO's SDE is Euler-Maruyama of an SDE that keeps them, so it is taken in fine steps."""
    generator = torch.Generator().manual_seed(2)
    x0, count, noise_level = 0.7, 200_000, 0.8
    if objective == "flow":
        components = _Scheduled(FlowMatchEulerDiscreteScheduler(shift=3.0))
        components.family = _FlowFamily()
        objective_, steps = FlowMatching(), 600
        schedule = objective_.sampling_timesteps(components, torch.zeros(1, 4, 8, 8), steps).double()
        levels = [(1 - s, s) for s in (schedule / 1000).tolist()]  # (signal, noise) per step

        def exact(noisy, index):  # the velocity noise - x0, for x = (1 - s) x0 + s noise
            return (noisy - x0) / levels[index][1]
    else:
        components = _Scheduled(DDIMScheduler(**SD_SCHEDULE))
        objective_, steps = DDPM(), 6
        schedule = objective_.sampling_timesteps(components, torch.zeros(1), steps)
        alphas = components.noise_scheduler.alphas_cumprod.double()
        levels = [(alphas[int(t)].sqrt(), (1 - alphas[int(t)]).sqrt()) for t in schedule[:-1]]
        levels.append((alphas[0].sqrt(), (1 - alphas[0]).sqrt()))

        def exact(noisy, index):  # the noise, for x = sqrt(alpha) x0 + sqrt(1 - alpha) noise
            return (noisy - levels[index][0] * x0) / levels[index][1]

    first, last = (steps // 5, 3 * steps // 5) if objective == "flow" else (1, 5)
    signal, spread = levels[first]
    noisy = signal * x0 + spread * torch.randn(count, generator=generator, dtype=torch.float64)
    for index in range(first, last):
        mean, std = objective_.sampler_step(
            components, schedule, index, noisy, exact(noisy, index), noise_level, LossConfig()
        )
        assert float(std) > 0
        noisy = mean + std * torch.randn(count, generator=generator, dtype=torch.float64)
    signal, spread = levels[last]
    assert float(noisy.mean()) == pytest.approx(float(signal) * x0, abs=5e-3)
    assert float(noisy.std()) == pytest.approx(float(spread), rel=1e-2)


def test_the_log_probability_is_the_gaussians_averaged_over_a_samples_elements():
    generator = torch.Generator().manual_seed(3)
    mean, sample = torch.randn(3, 4, 5, 5, generator=generator), torch.randn(3, 4, 5, 5, generator=generator)
    std = torch.tensor(0.3)
    expected = torch.distributions.Normal(mean, std).log_prob(sample).mean(dim=(1, 2, 3))
    torch.testing.assert_close(gaussian_log_prob(sample, mean, std), expected)


def reward_settings(tmp_path, **overrides) -> dict:
    return {
        "reward.method": "grpo",
        "reward.scorer": "difftune.toy.judge:shapes_reward",
        "reward.prompts": ["a purple circle", "a red square", "a blue triangle"],
        "reward.group_size": 2,
        "reward.steps": 3,
        "reward.guidance_scale": 2.0,
        "reward.kl_weight": 0.1,
        "adapter.text_encoder": False,
        "train.batch_size": 2,
        "train.max_steps": 2,
        "optim.learning_rate": 1e-2,
        "train.output_dir": str(tmp_path / "reward"),
        **overrides,
    }


def test_a_grpo_run_draws_scores_and_trains_its_adapter(make_config, tmp_path):
    config = make_config(**reward_settings(tmp_path, **{"data.path": str(tmp_path / "no-images-here")}))
    result = train(config)
    rows = read_metrics(tmp_path / "reward")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert 0 <= row["reward"] <= 1 and row["reward_std"] >= 0 and row["kl"] >= 0 and math.isfinite(row["loss"])
    assert rows[0]["kl"] == 0  # the adapter starts at zero: the policy is the base
    assert rows[1]["kl"] > 0 and rows[0]["grad_norm"] > 0
    weights = load_file(result.trained_path)
    assert any(key.endswith("lora_B.weight") and value.abs().sum() > 0 for key, value in weights.items())


def test_a_resumed_reward_run_draws_and_trains_as_the_uninterrupted_one(make_config, tmp_path):
    settings = reward_settings(tmp_path, **{"train.max_steps": 4, "reward.updates_per_round": 2})
    whole = train(make_config(**settings))
    halves = settings | {"train.output_dir": str(tmp_path / "halves"), "checkpoint.every_steps": 2}
    train(make_config(**halves | {"train.max_steps": 2}))
    resumed = train(make_config(**halves | {"train.max_steps": 4}), resume="auto")
    expected, got = load_file(whole.trained_path), load_file(resumed.trained_path)
    assert expected.keys() == got.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)
    rewards = [[row["reward"] for row in read_metrics(path)] for path in (tmp_path / "reward", tmp_path / "halves")]
    assert rewards[0] == rewards[1]


def test_draft_trains_through_a_differentiable_scorer_and_refuses_one_without_gradients(make_config, tmp_path):
    config = make_config(**reward_settings(tmp_path, **{"reward.method": "draft", "reward.draft_last_steps": 2}))
    result = train(config)
    rows = read_metrics(tmp_path / "reward")
    # The loss is minus the score plus the KL to the base (each of the sample's steps), which is 0 while the
    # adapter is still zero and then grows.
    assert all(row["loss"] == pytest.approx(-row["reward"] + 0.1 * row["kl"], abs=1e-6) for row in rows)
    assert rows[0]["kl"] == 0 and rows[1]["kl"] > 0
    assert rows[0]["grad_norm"] > 0
    assert load_file(result.trained_path)
    refused = reward_settings(
        tmp_path,
        **{
            "reward.method": "draft",
            "reward.scorer": "tests.test_reward:judged_count",
            "train.output_dir": str(tmp_path / "refused"),
        },
    )
    with pytest.raises(DifftuneError, match="without gradients; it needs a differentiable scorer"):
        train(make_config(**refused))


SCORED: list[torch.Tensor] = []  # what `recorded_shapes_reward` was given, each call's images


def recorded_shapes_reward(images, prompts):
    SCORED.append(images.detach().clone())
    return shapes_reward(images, prompts)


@pytest.mark.parametrize("method", ["draft", "refl"])
def test_a_draft_sample_is_the_pipelines_own_at_noise_0_and_stochastic_above(make_config, tmp_path, method):
    """The first round (the adapter still zero: the base) scores what StableDiffusionPipeline draws with DDIM from
    the round's noise; at noise level 1 (DDIM's eta 1, DDPM's ancestral sampler) it draws other images. ReFL stopping
    at the last step scores the same: its jump to the image from there is DDIM's last step."""
    scored = importlib.import_module("tests.test_reward").SCORED  # the run imports the scorer by that name
    drawn = {}
    for level in (0.0, 1.0):
        overrides = {
            "reward.method": method,
            "reward.noise_level": level,
            "reward.scorer": "tests.test_reward:recorded_shapes_reward",
            "train.max_steps": 1,
            "train.output_dir": str(tmp_path / f"noise_{level}"),
        }
        config = make_config(**reward_settings(tmp_path, **overrides))
        scored.clear()
        train(config)
        drawn[level] = scored[0]
    prompts = next(reward_batches(config, 0, 0))["prompt"]
    components = load_components(config.model)
    # A round's noise: the run's seed, the process and the round's number (reward.py's _generator)
    seed = np.random.SeedSequence([config.train.seed, 0, 0]).generate_state(1)[0]
    noise = torch.randn(drawn[0.0].shape[0], 4, 8, 8, generator=torch.Generator().manual_seed(int(seed)))
    scheduler = DDIMScheduler.from_config(components.noise_scheduler.config, set_alpha_to_one=False)
    pipeline = components.pipeline(scheduler)
    expected = pipeline(
        prompts, latents=noise, num_inference_steps=3, guidance_scale=2.0, eta=0.0, output_type="pt"
    ).images
    torch.testing.assert_close(drawn[0.0], expected, rtol=1e-4, atol=1e-4)
    assert (drawn[1.0] - drawn[0.0]).abs().max() > 0.05


def test_refl_scores_the_image_predicted_from_an_earlier_step_and_trains_through_it(make_config, tmp_path):
    """ReFL stopping at a random one of all 3 steps: a round that stops early scores a blurrier image than the full
    sample (the prediction from a noisier state), and its loss is minus the score plus the anchor."""
    scored = importlib.import_module("tests.test_reward").SCORED
    images = {}
    for method in ("refl", "draft"):
        overrides = {
            "reward.method": method,
            "reward.refl_last_steps": 3,
            "reward.noise_level": 0.0,
            "reward.scorer": "tests.test_reward:recorded_shapes_reward",
            "train.max_steps": 8,
            "optim.learning_rate": 1e-12,  # the base each round: rounds differ by their noise and their stopping step
            "train.output_dir": str(tmp_path / method),
        }
        scored.clear()
        train(make_config(**reward_settings(tmp_path, **overrides)))
        images[method] = list(scored)
    differences = [float((refl - draft).abs().max()) for refl, draft in zip(*images.values(), strict=True)]
    assert min(differences) < 1e-4  # a round that stopped at the last step: DDIM's own sample
    assert max(differences) > 0.05  # one that stopped earlier
    rows = read_metrics(tmp_path / "refl")
    assert all(row["loss"] == pytest.approx(-row["reward"] + 0.1 * row["kl"], abs=1e-6) for row in rows)


def judged_count(images, prompts):
    """A scorer with no gradients: each image's count of bright pixels."""
    return [float((image > 0.5).sum()) for image in images]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"reward.scorer": "shapes_reward"}, "name the scoring function as module:function"),
        ({"reward.prompts": []}, "list the prompts to draw and score"),
        ({"adapter.kind": "none"}, "an adapter to switch off"),
        ({"adapter.text_encoder": True}, "the denoiser's adapter is tuned"),
        ({"preference.method": "dpo"}, 'preference.method = "dpo"'),
        ({"reward.method": "draft", "reward.draft_last_steps": 9}, "at most reward.steps"),
        ({"reward.method": "refl", "reward.refl_last_steps": 9}, "reward.refl_last_steps 9: at most reward.steps"),
        ({"reward.noise_level": 0}, "GRPO explores by the sampler's noise"),
    ],
)
def test_settings_a_reward_run_cannot_train_with_are_refused(make_config, tmp_path, overrides, message):
    with pytest.raises(DifftuneError, match=message):
        make_config(**reward_settings(tmp_path, **overrides))


def test_a_scorer_that_cannot_be_imported_or_miscounts_is_named(make_config, tmp_path):
    config = make_config(**reward_settings(tmp_path, **{"reward.scorer": "difftune.toy.judge:no_such_scorer"}))
    with pytest.raises(DifftuneError, match="reward.scorer = 'difftune.toy.judge:no_such_scorer': cannot import it"):
        train(config)
    config = make_config(**reward_settings(tmp_path, **{"reward.scorer": "tests.test_reward:one_score"}))
    with pytest.raises(DifftuneError, match=r"returned scores of shape \(1,\) for 4 images"):
        train(config)


def one_score(images, prompts):
    return [1.0]


def test_shapes_reward_ranks_the_asked_color_and_shape_above_the_rest_with_gradients():
    import numpy as np

    from difftune.toy.judge import shapes_reward
    from difftune.toy.tiny import render_shape

    def pixels(shape, color):
        image = render_shape(shape, color, np.random.default_rng(0))
        return torch.tensor(np.asarray(image), dtype=torch.float32).permute(2, 0, 1) / 255

    images = torch.stack(
        [pixels("circle", "purple"), pixels("circle", "blue"), pixels("circle", "green"), pixels("square", "purple")]
    )
    images.requires_grad_(True)
    scores = shapes_reward(images, ["a purple circle"] * 4)
    assert scores[0] > 0.95 and scores[0] > scores[1] > scores[2] and scores[3] < 0.55
    scores.sum().backward()
    assert images.grad.abs().sum() > 0


@pytest.fixture(scope="module")
def micro_clip(tmp_path_factory):
    """A micro CLIP model saved as a folder, with a tokenizer and a 32 px image processor."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizer

    folder = tmp_path_factory.mktemp("clip")
    tokenizer = CLIPTokenizer.from_pretrained("models/tiny-sd/tokenizer")
    small = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2}
    config = CLIPConfig(
        text_config=small | {"vocab_size": tokenizer.vocab_size, "max_position_embeddings": 77},
        vision_config=small | {"image_size": 32, "patch_size": 8},
        projection_dim=16,
    )
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def test_clip_score_is_clips_own_similarity_with_gradients_to_the_images(micro_clip):
    from PIL import Image
    from transformers import CLIPModel, CLIPProcessor

    from difftune.rewards import clip_score

    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    images = (images * 255).round() / 255  # as PIL images hold them
    prompts = ["a purple circle", "a red square", "a blue triangle"]
    processor, model = CLIPProcessor.from_pretrained(micro_clip), CLIPModel.from_pretrained(micro_clip).eval()
    pil = [Image.fromarray((image * 255).round().byte().permute(1, 2, 0).numpy()) for image in images]
    inputs = processor(text=prompts, images=pil, return_tensors="pt", padding=True)
    with torch.no_grad():
        output = model(**inputs)
    expected = torch.nn.functional.cosine_similarity(output.image_embeds, output.text_embeds, dim=-1)
    images.requires_grad_(True)
    scores = clip_score(images, prompts, model=str(micro_clip))
    torch.testing.assert_close(scores.detach(), expected, rtol=1e-4, atol=1e-4)
    scores.sum().backward()
    assert images.grad.abs().sum() > 0


def test_clip_pixels_resize_and_crop_as_clips_processor(micro_clip):
    from PIL import Image
    from transformers import CLIPImageProcessor

    from difftune.rewards import clip_pixels

    processor = CLIPImageProcessor.from_pretrained(micro_clip)
    images = torch.zeros(1, 3, 48, 64)
    images[..., 12:36, 20:44] = 1.0  # a bright square in the middle of a wider image
    pil = Image.fromarray((images[0] * 255).byte().permute(1, 2, 0).numpy())
    expected = processor(images=pil, return_tensors="pt").pixel_values
    got = clip_pixels(images, processor)
    assert got.shape == expected.shape == (1, 3, 32, 32)
    error = (got - expected).abs().mean()
    assert error < 0.1  # torch's bicubic against PIL's (5/255 apart), on the same crop
    assert (clip_pixels(images[..., :, 8:], processor) - expected).abs().mean() > 3 * error  # another crop: far


def test_a_clip_model_that_is_not_there_is_named(tmp_path):
    from difftune.rewards import clip_score

    with pytest.raises(DifftuneError, match="reward.scorer_options.model .*: cannot load a CLIP model"):
        clip_score(torch.zeros(1, 3, 32, 32), ["a"], model=str(tmp_path / "missing"))


def test_the_plan_counts_the_drawn_images_and_their_states(make_config, tmp_path):
    """One GRPO step trains a denoising step of every drawn image (twice with guidance): the activations of a batch of
    batch_size x group_size (x 2); the round's states are (steps + 1) latents of each image, in fp32. DRaFT holds its
    last K steps."""
    from difftune.training import plan

    step = "activations and gradients"

    def planned(**overrides):
        return plan.plan_memory(make_config(**overrides), "cuda").device

    settings = reward_settings(tmp_path, **{"reward.guidance_scale": 1.0, "reward.group_size": 4})
    plain = planned(**{"adapter.text_encoder": False, "train.batch_size": 8})
    grpo = planned(**settings)
    assert grpo[step] == plain[step]  # 2 prompts x 4 images
    assert planned(**settings | {"reward.guidance_scale": 2.0})[step] > 1.6 * grpo[step]
    latents = 4 * (32 // 4) ** 2  # the micro base's latents at 32 px
    assert grpo["drawn states (reward)"] == (3 + 1) * 2 * 4 * latents * 4
    draft = planned(**settings | {"reward.method": "draft", "reward.draft_last_steps": 2})
    assert draft[step] == planned(**{"adapter.text_encoder": False, "train.batch_size": 4})[step]
    assert "drawn states (reward)" not in draft or not draft["drawn states (reward)"]
    refl = planned(**settings | {"reward.method": "refl", "reward.refl_last_steps": 3})
    assert refl[step] == planned(**{"adapter.text_encoder": False, "train.batch_size": 2})[step]  # one step's


@pytest.mark.parametrize("method", ["grpo", "draft", "refl"])
def test_a_flow_family_trains_from_rewards(make_config, tiny_flux_base, tmp_path, method):
    """Flux's micro base: its sampler's SDE (Flow-GRPO's own family), DRaFT's Euler steps at its resolution shift, or
    ReFL's jump from a step to the image (Euler's to sigma 0)."""
    config = make_config(**reward_settings(tmp_path, **{"model.base": str(tiny_flux_base), "reward.method": method}))
    result = train(config)
    rows = read_metrics(tmp_path / "reward")
    assert len(rows) == 2 and all(math.isfinite(row["reward"]) and row["grad_norm"] > 0 for row in rows)
    assert any(value.abs().sum() > 0 for key, value in load_file(result.trained_path).items() if "lora_B" in key)


def test_each_epoch_draws_every_prompt_once_and_a_resumed_run_the_same_rounds(make_config, tmp_path):
    from itertools import islice

    prompts = [f"a prompt {k}" for k in range(5)]
    config = make_config(**reward_settings(tmp_path, **{"reward.prompts": prompts, "reward.updates_per_round": 2}))
    batches = list(islice(reward_batches(config, 0, 0), 10))  # 5 rounds of 2 prompts: two epochs
    assert [batch["round"] for batch in batches] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert all(batches[k]["prompt"] == batches[k + 1]["prompt"] for k in range(0, 10, 2))  # a round's updates
    drawn = [prompt for batch in batches[::2] for prompt in batch["prompt"]]
    assert sorted(drawn[:5]) == sorted(drawn[5:]) == prompts and drawn[:5] != drawn[5:]
    assert [batch["epoch"].item() for batch in batches[::2]] == [0, 0, 0, 1, 1]  # by each round's first prompt
    resumed = list(islice(reward_batches(config, 7, 0), 3))  # from step 7, as a checkpoint there resumes
    assert [(b["round"], b["update"], b["prompt"]) for b in resumed] == [
        (b["round"], b["update"], b["prompt"]) for b in batches[7:10]
    ]
    other = [batch["prompt"] for batch in islice(reward_batches(config, 0, 1), 10)]
    assert other != [batch["prompt"] for batch in batches]  # another process draws its own order
