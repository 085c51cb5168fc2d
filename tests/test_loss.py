import pytest
import torch
from diffusers.training_utils import compute_snr

from difftune.config import LossConfig
from difftune.families.objective import (
    debiased_weights,
    diffusion_loss,
    draw_noise,
    draw_timesteps_and_noise,
    min_snr_weights,
    per_sample_mse,
    soft_min_snr_weights,
)
from difftune.toy.tiny import build_noise_scheduler


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
    torch.testing.assert_close(per_sample_mse(prediction, target, mask), torch.tensor([1.0, 5.0]))
    torch.testing.assert_close(per_sample_mse(prediction, target), torch.tensor([5.0, 5.0]))
    assert per_sample_mse(prediction, target, torch.zeros(2, 1, 4, 4)).abs().max() == 0


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
    torch.testing.assert_close(per_sample_mse(prediction, target), ((prediction - target) ** 2).flatten(1).mean(1))
    mask = torch.zeros(2, 1, 4, 5, 6)
    mask[:, :, 1:3] = 1  # two frames of four count
    expected = ((prediction - target) ** 2)[:, :, 1:3].flatten(1).mean(1)
    torch.testing.assert_close(per_sample_mse(prediction, target, mask), expected)


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

    from difftune.families.flow import FlowMatching, FlowMatchingFamily

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
