import math

import pytest
import torch
from diffusers.training_utils import compute_snr

from difftune.config import LossConfig
from difftune.families.common.objective import (
    debiased_weights,
    diffusion_loss,
    draw_noise,
    draw_timesteps_and_noise,
    elementwise_error,
    huber_thresholds,
    min_snr_weights,
    per_sample_error,
    soft_min_snr_weights,
)
from difftune.toy.tiny import build_noise_scheduler

L2 = LossConfig()


def test_min_snr_weights_closed_form():
    snr = torch.tensor([0.5, 1.0, 5.0, 10.0, 100.0])
    # epsilon: min(snr, 5) / snr
    expected_eps = torch.tensor([1.0, 1.0, 1.0, 0.5, 0.05])
    # v-prediction: min(snr, 5) / (snr + 1)
    expected_v = torch.tensor([0.5 / 1.5, 1.0 / 2.0, 5.0 / 6.0, 5.0 / 11.0, 5.0 / 101.0])
    torch.testing.assert_close(min_snr_weights(snr, 5.0, "epsilon"), expected_eps)
    torch.testing.assert_close(min_snr_weights(snr, 5.0, "v_prediction"), expected_v)
    # zero SNR (zero-terminal schedules): the epsilon weight's limit, 1, not 0/0
    assert min_snr_weights(torch.tensor([0.0]), 5.0, "epsilon").item() == 1.0


def test_soft_min_snr_and_debiased_weights_closed_form():
    snr = torch.tensor([0.01, 1.0, 5.0, 100.0, 1e6])
    # soft-min-SNR: x0 weight snr*g/(snr+g), over snr (epsilon) or snr + 1 (v)
    soft_x0 = snr * 5 / (snr + 5)
    torch.testing.assert_close(soft_min_snr_weights(snr, 5.0, "epsilon"), soft_x0 / snr)
    torch.testing.assert_close(soft_min_snr_weights(snr, 5.0, "v_prediction"), soft_x0 / (snr + 1))
    # it lies below the hard minimum and meets it far from gamma
    hard = min_snr_weights(snr, 5.0, "epsilon")
    assert torch.all(soft_min_snr_weights(snr, 5.0, "epsilon") <= hard + 1e-6)
    assert soft_min_snr_weights(torch.tensor([1e-4]), 5.0, "epsilon").item() == pytest.approx(1.0, abs=1e-4)
    assert soft_min_snr_weights(torch.tensor([0.0]), 5.0, "epsilon").item() == 1.0
    # debiased: 1/sqrt(snr) and 1/(snr+1), snr capped at 1000 (kohya)
    capped = snr.clamp(max=1000)
    torch.testing.assert_close(debiased_weights(snr, "epsilon"), 1 / capped.sqrt())
    torch.testing.assert_close(debiased_weights(snr, "v_prediction"), 1 / (capped + 1))
    assert torch.isfinite(debiased_weights(torch.tensor([0.0]), "epsilon")).all()


@pytest.mark.parametrize("weighting", ["soft_min_snr", "debiased"])
def test_weightings_reach_the_loss(weighting):
    scheduler = build_noise_scheduler()
    latents, noise = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8)
    timesteps = torch.tensor([10, 500, 990])
    config = LossConfig(prediction_type="epsilon", weighting=weighting)
    loss = diffusion_loss(_oracle(torch.zeros_like(noise)), scheduler, latents, timesteps, noise, config)
    snr = compute_snr(scheduler, timesteps)
    weights = (
        soft_min_snr_weights(snr, 5.0, "epsilon") if weighting == "soft_min_snr" else debiased_weights(snr, "epsilon")
    )
    torch.testing.assert_close(loss, noise.pow(2).mean(dim=(1, 2, 3)) * weights)


def test_masked_mse_is_the_mean_over_the_mask():
    prediction, target = torch.zeros(2, 4, 4, 4), torch.ones(2, 4, 4, 4)
    target[:, :, :, 2:] = 3.0  # right half: error 9, left half: error 1
    mask = torch.zeros(2, 1, 4, 4)
    mask[0, :, :, :2] = 1.0  # sample 0 trains on the left half alone
    mask[1] = 0.5  # sample 1: everywhere, at half weight
    torch.testing.assert_close(per_sample_error(prediction, target, L2, mask), torch.tensor([1.0, 5.0]))
    torch.testing.assert_close(per_sample_error(prediction, target, L2), torch.tensor([5.0, 5.0]))
    assert per_sample_error(prediction, target, L2, torch.zeros(2, 1, 4, 4)).abs().max() == 0


def test_snr_from_the_scheduler():
    scheduler = build_noise_scheduler()
    timesteps = torch.tensor([0, 250, 999])
    alpha_bar = scheduler.alphas_cumprod[timesteps]
    torch.testing.assert_close(compute_snr(scheduler, timesteps), alpha_bar / (1 - alpha_bar))


def _oracle(output):
    """A denoiser that returns a fixed tensor, to check targets and weights exactly."""
    return lambda noisy, timesteps: output


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_loss_targets_and_weights(prediction):
    scheduler = build_noise_scheduler()
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(3, 4, 8, 8, generator=generator)
    noise = torch.randn(3, 4, 8, 8, generator=generator)
    timesteps = torch.tensor([10, 500, 990])
    target = noise if prediction == "epsilon" else scheduler.get_velocity(latents, noise, timesteps)
    config = LossConfig(prediction_type=prediction, weighting="min_snr", snr_gamma=5.0)

    exact = diffusion_loss(_oracle(target), scheduler, latents, timesteps, noise, config)
    assert exact.shape == (3,)
    assert torch.count_nonzero(exact) == 0

    zero = diffusion_loss(_oracle(torch.zeros_like(target)), scheduler, latents, timesteps, noise, config)
    weights = min_snr_weights(compute_snr(scheduler, timesteps), 5.0, prediction)
    torch.testing.assert_close(zero, target.pow(2).mean(dim=(1, 2, 3)) * weights)

    uniform = LossConfig(prediction_type=prediction, weighting="uniform")
    plain = diffusion_loss(_oracle(torch.zeros_like(target)), scheduler, latents, timesteps, noise, uniform)
    torch.testing.assert_close(plain, target.pow(2).mean(dim=(1, 2, 3)))


def test_auto_prediction_type_follows_the_scheduler():
    scheduler = build_noise_scheduler()
    scheduler.register_to_config(prediction_type="v_prediction")
    latents, noise = torch.ones(1, 4, 8, 8), torch.zeros(1, 4, 8, 8)
    timesteps = torch.tensor([500])
    velocity = scheduler.get_velocity(latents, noise, timesteps)
    loss = diffusion_loss(_oracle(velocity), scheduler, latents, timesteps, noise, LossConfig(weighting="uniform"))
    assert loss.item() == 0.0


def test_noise_is_per_sample_whatever_the_batch():
    seeds = [11, 22, 33]
    latents = torch.zeros(3, 4, 8, 8)
    config = LossConfig(noise_offset=0.1, input_perturbation=0.1)
    together = draw_timesteps_and_noise([torch.Generator().manual_seed(s) for s in seeds], latents, 1000, config)
    for i, seed in enumerate(seeds):
        alone = draw_timesteps_and_noise([torch.Generator().manual_seed(seed)], latents[:1], 1000, config)
        assert torch.equal(alone[0], together[0][i : i + 1])
        assert torch.equal(alone[1], together[1][i : i + 1])
        assert torch.equal(alone[2], together[2][i : i + 1])
    assert together[0].min() >= 0 and together[0].max() < 1000


# Clips: latents (B, C, T, h, w). Every piece of the objective works on them as on an image's (B, C, h, w).


def test_a_clips_noise_offset_is_one_value_per_sample_and_channel_over_every_frame():
    latents = torch.zeros(2, 3, 4, 5, 6)
    generators = [torch.Generator().manual_seed(s) for s in (0, 1)]
    plain, _ = draw_noise(generators, latents, LossConfig())
    generators = [torch.Generator().manual_seed(s) for s in (0, 1)]
    offset, _ = draw_noise(generators, latents, LossConfig(noise_offset=0.5))
    shift = offset - plain
    assert shift.shape == latents.shape and shift.abs().sum() > 0
    torch.testing.assert_close(shift, shift[:, :, :1, :1, :1].expand_as(shift))  # constant over T, h, w
    assert not torch.allclose(shift[:, 0], shift[:, 1])  # per channel
    # A sample's clip noise does not depend on the batch it is in.
    alone, _ = draw_noise([torch.Generator().manual_seed(1)], latents[:1], LossConfig(noise_offset=0.5))
    torch.testing.assert_close(alone[0], offset[1])


def test_a_clips_mse_and_mask_reduce_over_frames_too():
    prediction, target = torch.randn(2, 3, 4, 5, 6), torch.randn(2, 3, 4, 5, 6)
    torch.testing.assert_close(
        per_sample_error(prediction, target, L2), ((prediction - target) ** 2).flatten(1).mean(1)
    )
    mask = torch.zeros(2, 1, 4, 5, 6)
    mask[:, :, 1:3] = 1  # two frames of four count
    expected = ((prediction - target) ** 2)[:, :, 1:3].flatten(1).mean(1)
    torch.testing.assert_close(per_sample_error(prediction, target, L2, mask), expected)


def test_an_image_mask_covers_every_frame_of_a_clips_latents():
    from difftune.training.train import latent_mask

    mask = torch.zeros(1, 1, 8, 8)
    mask[..., :4, :] = 1
    weights = latent_mask(mask, (3, 4, 4), 0.0)
    assert weights.shape == (1, 1, 3, 4, 4)
    torch.testing.assert_close(weights, latent_mask(mask, (4, 4), 0.0)[:, :, None].expand(1, 1, 3, 4, 4))
    clip_mask = torch.ones(1, 1, 4, 8, 8)
    clip_mask[:, :, 2:] = 0
    torch.testing.assert_close(latent_mask(clip_mask, (2, 4, 4), 0.25)[0, 0, :, 0, 0], torch.tensor([1.0, 0.25]))


def test_the_flow_matching_loss_on_a_clip_is_the_formula():
    """`FlowMatching.loss` on (B, C, T, h, w): (1 - s) x + s noise in, noise - x the target, per sample."""
    from types import SimpleNamespace

    from difftune.families.common.flow import FlowMatching, FlowMatchingFamily

    class Identity(FlowMatchingFamily):
        def denoise(self, components, noisy, timesteps, conditioning, geometry):
            return noisy * 2

    latents, noise = torch.randn(2, 4, 3, 4, 4), torch.randn(2, 4, 3, 4, 4)
    timesteps = torch.tensor([250.0, 900.0])
    components = SimpleNamespace(family=Identity())  # the objective reaches the denoiser through them
    loss = FlowMatching().loss(components, latents, timesteps, noise, {}, None, LossConfig())
    sigmas = (timesteps / 1000).view(-1, 1, 1, 1, 1)
    expected = ((2 * ((1 - sigmas) * latents + sigmas * noise) - (noise - latents)) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(loss, expected)


def test_each_loss_type_scores_an_error_as_kohyas_conditional_loss():
    """l1 is torch's; pseudo-Huber 2c(sqrt(e^2 + c^2) - c) is the squared error far under c and 2c|e| far over it
    (outliers pull linearly); smooth_l1 is it over c; each sample reads its own c."""
    prediction = torch.zeros(2, 1, 1, 3)
    target = torch.tensor([1e-3, 1.0, 100.0]).expand(2, 1, 1, 3)
    thresholds = torch.tensor([0.1, 0.5])
    l1 = elementwise_error(prediction, target, LossConfig(type="l1"))
    torch.testing.assert_close(l1, torch.nn.functional.l1_loss(prediction, target, reduction="none"))
    huber = elementwise_error(prediction, target, LossConfig(type="huber"), thresholds)
    assert huber[0, 0, 0, 0] == pytest.approx(1e-6, rel=1e-3)  # e^2 under c
    assert huber[0, 0, 0, 2] == pytest.approx(2 * 0.1 * 100 - 2 * 0.1**2, rel=1e-3)  # 2c|e| - 2c^2 over it
    assert huber[1, 0, 0, 2] == pytest.approx(2 * 0.5 * 100 - 2 * 0.5**2, rel=1e-3)  # the second sample's c
    smooth = elementwise_error(prediction, target, LossConfig(type="smooth_l1"), thresholds)
    torch.testing.assert_close(smooth, huber / thresholds.view(2, 1, 1, 1))
    expected = 2 * 0.1 * (torch.sqrt(target[0] ** 2 + 0.01) - 0.1)
    torch.testing.assert_close(huber[0], expected)


def test_the_huber_schedules_are_kohyas():
    """`snr`: 1 on clean latents, falling to huber_c with the noise-to-signal ratio; `exponential`: huber_c to the
    schedule's fraction (kohya's exp(-alpha t), alpha = -ln(c) / steps); `constant`: huber_c."""
    fraction = torch.tensor([0.0, 0.5, 1.0])
    noise_to_signal = torch.tensor([0.0, 1.0, 1e6])
    snr = huber_thresholds(LossConfig(huber_c=0.1), fraction, noise_to_signal)
    torch.testing.assert_close(snr, torch.tensor([1.0, 0.9 / 4 + 0.1, 0.1]))
    exponential = huber_thresholds(LossConfig(huber_c=0.1, huber_schedule="exponential"), fraction, noise_to_signal)
    steps = torch.tensor([0.0, 500.0, 1000.0])
    torch.testing.assert_close(exponential, torch.exp(-(-math.log(0.1) / 1000) * steps))
    constant = huber_thresholds(LossConfig(huber_c=0.2, huber_schedule="constant"), fraction, noise_to_signal)
    torch.testing.assert_close(constant, torch.full((3,), 0.2))


@pytest.mark.parametrize("family", ["sd", "flux"])
@pytest.mark.parametrize("kind", ["l1", "huber", "smooth_l1"])
def test_a_familys_loss_scores_its_prediction_by_the_loss_type(micro_base, family, kind):
    """The objective's per-sample loss with `loss.type` is that error of the family's own prediction against its
    target, c from the schedule at each sample's timestep (DDPM's alphas_cumprod; flow matching's sigma), under the
    weighting and a mask: a UNet family's Min-SNR and a flow family's none."""
    from difftune.config import ModelConfig
    from difftune.families import load_components

    components = load_components(ModelConfig(base=str(micro_base(family))))
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(2, components.family.latent_channels(components.denoiser), 8, 8, generator=generator)
    noise = torch.randn(latents.shape, generator=generator)
    timesteps = torch.tensor([100, 700])
    conditioning = components.family.conditioning.encode_prompts(
        components, components.family.conditioning.tokenize(components.tokenizers, ["a red circle", "a blue square"])
    )
    geometry = torch.tensor([[32, 32, 0, 0, 32, 32]] * 2)
    mask = torch.ones(2, 1, 8, 8)
    mask[:, :, :, 4:] = 0
    config = LossConfig(type=kind, huber_c=0.2)
    with torch.no_grad():
        loss = components.family.objective.loss(
            components, latents, timesteps, noise, conditioning, geometry, config, mask=mask
        )
        if family == "flux":
            sigma = timesteps / 1000
            noisy = (1 - sigma.view(-1, 1, 1, 1)) * latents + sigma.view(-1, 1, 1, 1) * noise
            prediction = components.family.denoise(components, noisy, timesteps, conditioning, geometry)
            target, weights, noise_to_signal = noise - latents, torch.ones(2), sigma / (1 - sigma)
        else:
            scheduler = components.noise_scheduler
            noisy = scheduler.add_noise(latents, noise, timesteps)
            prediction = components.family.denoise(components, noisy, timesteps, conditioning, geometry)
            target, weights = noise, min_snr_weights(compute_snr(scheduler, timesteps), 5.0, "epsilon")
            alpha_bar = scheduler.alphas_cumprod[timesteps]
            noise_to_signal = ((1 - alpha_bar) / alpha_bar).sqrt()
    c = (1 - 0.2) / (1 + noise_to_signal) ** 2 + 0.2
    error = (prediction - target)[..., :4]
    if kind == "l1":
        expected = error.abs()
    else:
        expected = 2 * (torch.sqrt(error**2 + c.view(-1, 1, 1, 1) ** 2) - c.view(-1, 1, 1, 1))
        expected = expected * c.view(-1, 1, 1, 1) if kind == "huber" else expected
    torch.testing.assert_close(loss, expected.mean(dim=(1, 2, 3)) * weights, rtol=1e-4, atol=1e-6)
