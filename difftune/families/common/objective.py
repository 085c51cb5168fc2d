"""A family's objective, and the DDPM one: the denoising loss, one value per sample; weighting is a plain choice,
reduction is the loop's.

An `Objective` is what training minimises for a family, as k-diffusion's `Denoiser` wraps any model: how noise levels
and noise are drawn, how a sample is noised and what the family's denoiser (`Family.denoise`, reached through
`components.family`) is compared with. A family holds one (`Family.objective`); `DDPM` is the UNet families',
`flow.FlowMatching` the flow families'.

Timesteps, noise, noisy latents and targets all come from the model's own scheduler config
(`add_noise`, `get_velocity`). Min-SNR-gamma (Hang et al. 2023) weights a sample at timestep t by
min(SNR(t), gamma) / SNR(t) for epsilon prediction and min(SNR(t), gamma) / (SNR(t) + 1) for
v-prediction: both are min(SNR, gamma) over the SNR-weighting implied by the target, so the
x0-space weight is truncated at gamma either way. Soft-min-SNR (Crowson et al. 2024) swaps the hard
minimum for the smooth one, SNR * gamma / (SNR + gamma), over the same implied weighting. Debiased
estimation (Yu et al. 2024, as kohya's `--debiased_estimation_loss`) weights by 1 / sqrt(SNR) for epsilon
and 1 / (SNR + 1) for v-prediction, SNR capped at 1000 as kohya does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from diffusers import DDIMScheduler, DDPMScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_snr

from difftune.config import Config, LossConfig
from difftune.memory.transfer import host_randn, to_device
from difftune.models.components import Components


def prediction_type(config: LossConfig, noise_scheduler: DDPMScheduler) -> str:
    return noise_scheduler.config.prediction_type if config.prediction_type == "auto" else config.prediction_type


def training_noise_scheduler(noise_scheduler: DDPMScheduler, config: LossConfig) -> DDPMScheduler:
    """The model's schedule, or with `zero_terminal_snr` its betas rescaled so the last step is pure noise
    (and trailing timestep spacing, which samplers need to reach that step)."""
    if not config.zero_terminal_snr:
        return noise_scheduler
    return DDPMScheduler.from_config(noise_scheduler.config, rescale_betas_zero_snr=True, timestep_spacing="trailing")


def draw_fractions(generators: list[torch.Generator], config: LossConfig) -> torch.Tensor:
    """Per sample, from its own generator, a point u in (0, 1) of the noise schedule, drawn as `timestep_sampling`
    says: uniform, logit-normal (sigmoid of a normal) or SD3's "mode" density (Esser et al. 2024 sec. 3.1),
    through diffusers' own sampler."""
    return torch.cat(
        [
            compute_density_for_timestep_sampling(
                config.timestep_sampling,
                1,
                logit_mean=config.logit_mean,
                logit_std=config.logit_std,
                mode_scale=config.mode_scale,
                generator=generator,
            )
            for generator in generators
        ]
    )


def draw_noise(
    generators: list[torch.Generator], latents: torch.Tensor, config: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample, from its own generator: the target noise (B, C, h, w), or (B, C, T, h, w) for a clip, with the
    configured offset (one value per sample and channel, over every frame and pixel), and the noise the denoiser's
    input is made with (the target perturbed, if configured)."""
    noise = host_randn(latents.shape, generators, latents.device, latents.dtype)
    if config.noise_offset:
        per_channel = (*latents.shape[:2], *[1] * (latents.dim() - 2))
        offset = host_randn(per_channel, generators, latents.device, latents.dtype)
        noise = noise + config.noise_offset * offset
    input_noise = noise
    if config.input_perturbation:
        extra = host_randn(latents.shape, generators, latents.device, latents.dtype)
        input_noise = noise + config.input_perturbation * extra
    return noise, input_noise


def draw_timesteps_and_noise(
    generators: list[torch.Generator], latents: torch.Tensor, num_train_timesteps: int, config: LossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample, each from its own generator: a timestep (B,) in [0, num_train_timesteps), then `draw_noise`'s
    target and input noise."""
    if config.timestep_sampling == "uniform":
        timesteps = torch.cat([torch.randint(0, num_train_timesteps, (1,), generator=g) for g in generators])
    else:
        timesteps = (draw_fractions(generators, config) * num_train_timesteps).long().clamp(max=num_train_timesteps - 1)
    return to_device(timesteps, latents.device), *draw_noise(generators, latents, config)


def over_implied_weighting(x0_weight: torch.Tensor, snr: torch.Tensor, prediction: str) -> torch.Tensor:
    """A weight meant in x0 space (a function of SNR) as a weight on the target's MSE: epsilon's MSE is SNR times
    x0's, v's is SNR + 1 times."""
    if prediction == "v_prediction":
        return x0_weight / (snr + 1)
    # SNR -> 0 (a zero-terminal-SNR schedule's last step): both weightings here tend to SNR there, so 1, not 0/0.
    return torch.where(snr > 0, x0_weight / snr.clamp(min=torch.finfo(snr.dtype).tiny), torch.ones_like(snr))


def min_snr_weights(snr: torch.Tensor, gamma: float, prediction: str) -> torch.Tensor:
    """Per-sample Min-SNR-gamma weights for a batch of SNR values."""
    return over_implied_weighting(torch.clamp(snr, max=gamma), snr, prediction)


def soft_min_snr_weights(snr: torch.Tensor, gamma: float, prediction: str) -> torch.Tensor:
    """Per-sample soft-min-SNR weights: the harmonic soft minimum of SNR and gamma, SNR * gamma / (SNR + gamma)."""
    return over_implied_weighting(snr * gamma / (snr + gamma), snr, prediction)


DEBIASED_SNR_CAP = 1000.0  # kohya's: SNR at t = 0 is huge (inf on some schedules)


def debiased_weights(snr: torch.Tensor, prediction: str) -> torch.Tensor:
    """Per-sample debiased-estimation weights."""
    snr = snr.clamp(max=DEBIASED_SNR_CAP)
    if prediction == "v_prediction":
        return 1 / (snr + 1)
    return 1 / snr.clamp(min=1 / DEBIASED_SNR_CAP).sqrt()


# What the denoiser learns to predict: (scheduler, clean latents, noise, timesteps) -> target.
TARGETS = {
    "epsilon": lambda scheduler, latents, noise, timesteps: noise,
    "v_prediction": lambda scheduler, latents, noise, timesteps: scheduler.get_velocity(latents, noise, timesteps),
}

# Per-sample loss weights: (scheduler, timesteps, config, prediction type) -> (B,).
WEIGHTINGS = {
    "min_snr": lambda scheduler, timesteps, config, prediction: min_snr_weights(
        compute_snr(scheduler, timesteps), config.snr_gamma, prediction
    ),
    "soft_min_snr": lambda scheduler, timesteps, config, prediction: soft_min_snr_weights(
        compute_snr(scheduler, timesteps), config.snr_gamma, prediction
    ),
    "debiased": lambda scheduler, timesteps, config, prediction: debiased_weights(
        compute_snr(scheduler, timesteps), prediction
    ),
    "uniform": lambda scheduler, timesteps, config, prediction: torch.ones(len(timesteps)),
}
WEIGHTING_BY_DEFAULT = "min_snr"  # what `loss.weighting = "auto"` means for these (DDPM) families

# The denoiser's prediction for noisy latents at timesteps: (noisy (B, C, h, w), timesteps (B,)) -> (B, C, h, w).
Predict = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def huber_thresholds(config: LossConfig, fraction: torch.Tensor, noise_to_signal: torch.Tensor) -> torch.Tensor:
    """Each sample's c (B,) for `loss.type` huber / smooth_l1, by `loss.huber_schedule` (kohya's schedules), from
    where it is on the schedule: `fraction` of the way to noise (timestep / steps; flow matching's sigma) and the
    noise-to-signal ratio there (sqrt((1 - alpha_bar) / alpha_bar); flow matching's sigma / (1 - sigma))."""
    c = config.huber_c
    if config.huber_schedule == "snr":
        return (1 - c) / (1 + noise_to_signal.float()) ** 2 + c
    if config.huber_schedule == "exponential":
        return c ** fraction.float()
    return torch.full_like(fraction, c, dtype=torch.float32)


def elementwise_error(
    prediction: torch.Tensor, target: torch.Tensor, config: LossConfig, thresholds: torch.Tensor | None = None
) -> torch.Tensor:
    """Each element's error by `loss.type` (kohya's `conditional_loss`): squared, absolute, or pseudo-Huber with each
    sample's c (`thresholds`, (B,)): `huber` 2c(sqrt(e^2 + c^2) - c), which is e^2 for errors far under c and 2c|e|
    far over it; `smooth_l1` that over c."""
    error = prediction.float() - target.float()
    if config.type == "l2":
        return error.square()
    if config.type == "l1":
        return error.abs()
    c = thresholds.to(error).view(-1, *[1] * (error.dim() - 1))
    # 2(sqrt(e^2 + c^2) - c) written as 2e^2 / (sqrt(e^2 + c^2) + c), the same value: the difference of two nearly
    # equal numbers loses a small error's digits in fp32 (1e-3 under c = 0.1 came out 0.14% off, by CPU).
    pseudo_huber = 2 * error.square() / (torch.sqrt(error.square() + c.square()) + c)
    return c * pseudo_huber if config.type == "huber" else pseudo_huber


PSEUDO_HUBER = ("huber", "smooth_l1")  # the loss types with a threshold c per sample


def per_sample_error(
    prediction: torch.Tensor,
    target: torch.Tensor,
    config: LossConfig,
    mask: torch.Tensor | None = None,
    schedule_point: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """The mean error (`elementwise_error`) per sample (B,), over every other axis (an image's C, h, w; a clip's C,
    T, h, w). With `mask` (B, 1, h, w), or (B, 1, T, h, w), each latent pixel's error counts by its weight, and the
    result is divided by the mask's mean: a sample's loss is the mean over what it trains on, so a small mask does not
    scale its learning rate down (an all-zero mask trains nothing). `schedule_point()`: each sample's place on the
    schedule, `huber_thresholds`' fraction and noise-to-signal ratio, asked for only by the loss types with a c."""
    thresholds = huber_thresholds(config, *schedule_point()) if config.type in PSEUDO_HUBER else None
    error = elementwise_error(prediction, target, config, thresholds)
    axes = tuple(range(1, error.dim()))
    if mask is None:
        return error.mean(dim=axes)
    mask = mask.to(error)
    return (error * mask).mean(dim=axes) / mask.mean(dim=axes).clamp(min=1e-6)


def diffusion_loss(
    predict: Predict,
    noise_scheduler: DDPMScheduler,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    noise: torch.Tensor,
    config: LossConfig,
    input_noise: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weighted error (`loss.type`) between the denoiser's prediction and the target, per sample: shape (B,).
    The target is made from `noise`; the denoiser's input from `input_noise` when given (input perturbation); `mask`
    as in `per_sample_error`."""
    prediction = prediction_type(config, noise_scheduler)
    if prediction not in TARGETS:
        raise ValueError(f"prediction type {prediction!r} is not trainable here; use {' or '.join(TARGETS)}")
    noisy = noise_scheduler.add_noise(latents, noise if input_noise is None else input_noise, timesteps)
    target = TARGETS[prediction](noise_scheduler, latents, noise, timesteps)
    model_output = predict(noisy, timesteps)

    def schedule_point() -> tuple[torch.Tensor, torch.Tensor]:
        alpha_bar = noise_scheduler.alphas_cumprod.to(timesteps.device)[timesteps]
        return timesteps / noise_scheduler.config.num_train_timesteps, ((1 - alpha_bar) / alpha_bar).sqrt()

    per_sample = per_sample_error(model_output, target, config, mask, schedule_point)
    weighting = WEIGHTING_BY_DEFAULT if config.weighting == "auto" else config.weighting
    weights = WEIGHTINGS[weighting](noise_scheduler, timesteps, config, prediction)
    return per_sample * weights.to(per_sample.device)


class Objective:
    """What training minimises (a family holds one). Stateless: the model is `components`, its family's `denoise`."""

    def training_scheduler(self, scheduler):
        """The noise schedule training follows, from the pipeline's scheduler."""
        raise NotImplementedError

    def problems(self, config: Config) -> list[str]:
        """The loss settings this objective cannot train with, each named (`Family.check_config` refuses them)."""
        return []

    def trains_noise_level(self, components: Components, sigma: float) -> bool:
        """Whether this run trains the denoiser at noise level `sigma` (timestep / 1000): all of them, unless the
        denoiser serves part of the schedule (a Wan 2.2 expert); validation leaves the others out."""
        return True

    def same_denoiser(self, components: Components, sigma: float, other: float) -> bool:
        """Whether noise levels `sigma` and `other` run on the same module in one batch: always, unless the denoiser
        is several that each serve part of the schedule (Wan 2.2's two experts trained together)."""
        return True

    def draw_timesteps_and_noise(
        self, components: Components, generators: list[torch.Generator], latents: torch.Tensor, config: LossConfig
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per sample, from its own generator: timesteps (B,), the target noise and the input noise (B, C, h, w)."""
        raise NotImplementedError

    def stream_noise(
        self, components: Components, generators: list[torch.Generator], latents: torch.Tensor, conditioning: dict
    ) -> dict[str, torch.Tensor]:
        """Per sample, from its own generator after `draw_timesteps_and_noise`: the noise of what trains beside the
        `latents` in `conditioning` (a clip's sound), by name, to join it; nothing for an objective of latents
        alone."""
        return {}

    def noised(
        self, components: Components, latents: torch.Tensor, timesteps: torch.Tensor, noise: torch.Tensor
    ) -> torch.Tensor:
        """The denoiser's input: `latents` noised with `noise` at `timesteps` (B,) as this objective's process does."""
        raise NotImplementedError

    def loss(
        self,
        components: Components,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        noise: torch.Tensor,
        conditioning: dict,
        geometry: torch.Tensor,
        config: LossConfig,
        input_noise: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The per-sample loss (B,) of the denoiser on `latents` noised at `timesteps`; `mask` (B, 1, h, w) weights
        each latent pixel (`objective.per_sample_error`)."""
        raise NotImplementedError

    def sampling_timesteps(self, components: Components, latents: torch.Tensor, steps: int) -> torch.Tensor:
        """The (steps + 1,) timesteps a `steps`-step sample of `latents`' size passes: from pure noise, each step
        from one to the next (`sampler_step`), the last the image's."""
        raise NotImplementedError

    def sampler_step(
        self,
        components: Components,
        schedule: torch.Tensor,
        index: int,
        noisy: torch.Tensor,
        prediction: torch.Tensor,
        noise_level: float,
        config: LossConfig,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `index` of `schedule` as a stochastic sampler takes it (reward training's policy): the mean and the
        standard deviation of the next latents given `noisy` and the denoiser's `prediction`; at `noise_level` 0,
        the family's deterministic sampler (a zero deviation)."""
        raise NotImplementedError


class DDPM(Objective):
    """DDPM's noise process with epsilon or v targets (the UNet families): the schedule is the pipeline's own, read
    as DDPM's whichever sampler it was saved with; weighted by `WEIGHTINGS`."""

    def training_scheduler(self, scheduler):
        return DDPMScheduler.from_config(scheduler.config)

    def problems(self, config: Config) -> list[str]:
        flow_only = {
            "loss.weighting": config.loss.weighting not in ("auto", *WEIGHTINGS),
            "loss.flow_shift": config.loss.flow_shift != 1.0,
            "loss.flow_shift_by_resolution": config.loss.flow_shift_by_resolution,
        }
        return [
            f"{key}: for flow-matching families, leave it at its default" for key, set_ in flow_only.items() if set_
        ]

    def draw_timesteps_and_noise(self, components, generators, latents, config):
        return draw_timesteps_and_noise(
            generators, latents, components.noise_scheduler.config.num_train_timesteps, config
        )

    def noised(self, components, latents, timesteps, noise):
        return components.noise_scheduler.add_noise(latents, noise, timesteps)

    def sampling_timesteps(self, components, latents, steps):
        # DDIM's timesteps for this schedule (its spacing and offset), then the step below the last: DDIM's final one
        ddim = DDIMScheduler.from_config(components.noise_scheduler.config)
        ddim.set_timesteps(steps)
        below = ddim.timesteps[-1:] - ddim.config.num_train_timesteps // steps
        return torch.cat([ddim.timesteps, below]).to(latents.device)

    def sampler_step(self, components, schedule, index, noisy, prediction, noise_level, config):
        """DDIM's step with eta = `noise_level` (DDPO's policy; eta 0 is DDIM itself). Below timestep 0 the final
        alpha is the schedule's first (or 1 where the scheduler sets it so), as DDIM's."""
        scheduler = components.noise_scheduler
        alphas = scheduler.alphas_cumprod.to(noisy.device, torch.float32)
        step, below = int(schedule[index]), int(schedule[index + 1])
        final = torch.ones_like(alphas[0]) if scheduler.config.get("set_alpha_to_one", False) else alphas[0]
        alpha, alpha_below = alphas[step], alphas[below] if below >= 0 else final
        if prediction_type(config, scheduler) == "v_prediction":
            clean = alpha.sqrt() * noisy - (1 - alpha).sqrt() * prediction
            noise = alpha.sqrt() * prediction + (1 - alpha).sqrt() * noisy
        else:
            clean, noise = (noisy - (1 - alpha).sqrt() * prediction) / alpha.sqrt(), prediction
        variance = (1 - alpha_below) / (1 - alpha) * (1 - alpha / alpha_below)
        std = noise_level * variance.sqrt()
        mean = alpha_below.sqrt() * clean + (1 - alpha_below - std**2).clamp(min=0).sqrt() * noise
        return mean, std

    def loss(self, components, latents, timesteps, noise, conditioning, geometry, config, input_noise=None, mask=None):
        family = components.family
        return diffusion_loss(
            lambda noisy, t: family.denoise(components, noisy, t, conditioning, geometry),
            components.noise_scheduler,
            latents,
            timesteps,
            noise,
            config,
            input_noise,
            mask,
        )
