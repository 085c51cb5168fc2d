"""Flow matching, the objective every flow family shares (Flux.1, Qwen-Image, and the families after them).

Rectified flow (Esser et al. 2024): x_t = (1 - sigma) x0 + sigma noise, and the denoiser predicts the velocity
noise - x0. sigma is drawn per sample by `loss.timestep_sampling`, then shifted by `loss.flow_shift` or by the
image size (`loss.flow_shift_by_resolution`: the base scheduler's own rule, what its pipeline asks for at that
size). The loss is weighted by diffusers' SD3 weightings. Timesteps outside this module are sigma x 1000, the
scale diffusers' flow-matching schedulers use, so fixed validation timesteps and the benchmark mean the same
points as for the UNet families.

`FlowMatching` is this objective; `FlowMatchingFamily` is a `Family` that holds it: a flow family writes its prompts,
its `denoise` (packing latents into its tokens) and its files, and inherits the rest. Its pipelines share the flow
families' guidance convention too (`FlowDrawing.sampling_arguments`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_loss_weighting_for_sd3
from pydantic import Field

from difftune.config import Config, LossConfig
from difftune.errors import DifftuneError
from difftune.families.common.drawing import Drawing
from difftune.families.common.family import Family
from difftune.families.common.loading import FamilyOptions
from difftune.families.common.objective import Objective, draw_fractions, draw_noise, per_sample_error
from difftune.memory.transfer import to_device
from difftune.models.components import Components

FLOW_WEIGHTINGS = ("uniform", "sigma_sqrt", "cosmap")  # flow-matching weightings (diffusers' SD3 ones)


def shifted(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's time shift, sigma -> s sigma / (1 + (s - 1) sigma); at s = exp(mu) it is Flux's resolution shift."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def resolution_shift(scheduler_config, image_tokens: int) -> float:
    """The shift the base's scheduler samples `image_tokens` with: exp(mu), mu linear in the token count between
    its (base, max) sequence lengths and shifts, what `FluxPipeline` and `QwenImagePipeline` ask their scheduler
    for at this size; a scheduler without dynamic shifting (Z-Image's, SD3's) has one `shift` for every size."""
    if not scheduler_config.get("use_dynamic_shifting", False):
        return float(scheduler_config.get("shift", 1.0))
    base_len, max_len = scheduler_config.get("base_image_seq_len", 256), scheduler_config.get("max_image_seq_len", 4096)
    base_shift, max_shift = scheduler_config.get("base_shift", 0.5), scheduler_config.get("max_shift", 1.15)
    mu = base_shift + (max_shift - base_shift) * (image_tokens - base_len) / (max_len - base_len)
    return math.exp(mu)


def scheduler_resolution_shift(components: Components, image_tokens: int) -> float:
    """`resolution_shift` of the base's own scheduler (the training schedule keeps its config)."""
    return resolution_shift(components.noise_scheduler.config, image_tokens)


def flow_error(
    prediction: torch.Tensor,
    target: torch.Tensor,
    timesteps: torch.Tensor,
    config: LossConfig,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mean error per sample (B,) of a velocity `prediction` at `timesteps` (`per_sample_error`, whose Huber
    losses read each sample's noise level and noise-to-signal ratio)."""
    sigma = timesteps.float() / 1000
    return per_sample_error(prediction, target, config, mask, lambda: (sigma, sigma / (1 - sigma).clamp(min=1e-6)))


def anchored_guidance(guidance_scale: float, negative_prompt: str) -> dict:
    """The guidance arguments of pipelines that guide as pos + s (pos - neg) (Z-Image's, Krea 2's): difftune's
    `sample.guidance_scale` w means neg + w (pos - neg) for every family, which is s = w - 1 (none at w <= 1)."""
    arguments = {"guidance_scale": max(guidance_scale - 1, 0.0)}
    return arguments | ({"negative_prompt": negative_prompt} if guidance_scale > 1 and negative_prompt else {})


class FlowMatching(Objective):
    """Rectified flow over the family's latents. `resolution_shift` is the shift `loss.flow_shift_by_resolution`
    draws an image's noise levels with, from its token count: the base scheduler's rule (`resolution_shift`, the
    module's), unless the family's pipeline asks for another (the family passes its own)."""

    def __init__(self, resolution_shift: Callable[[Components, int], float] | None = None):
        self.resolution_shift = resolution_shift or scheduler_resolution_shift

    def training_scheduler(self, scheduler):
        # Kept as saved: its config holds the resolution-shift constants that sampling and `loss` both use.
        return FlowMatchEulerDiscreteScheduler.from_config(scheduler.config)

    def problems(self, config: Config) -> list[str]:
        loss, problems = config.loss, []
        if loss.prediction_type != "auto":
            problems.append(
                f'loss.prediction_type = "{loss.prediction_type}": flow matching predicts the velocity; use "auto"'
            )
        if loss.weighting not in ("auto", *FLOW_WEIGHTINGS):
            problems.append(
                f'loss.weighting = "{loss.weighting}": is for the UNet families; use auto, {", ".join(FLOW_WEIGHTINGS)}'
            )
        if loss.zero_terminal_snr:
            problems.append(
                "loss.zero_terminal_snr: flow matching reaches pure noise at sigma = 1 already; leave it off"
            )
        return problems

    def draw_timesteps_and_noise(self, components, generators, latents, config: LossConfig):
        if config.flow_shift_by_resolution:
            shift = self.resolution_shift(components, components.family.image_tokens(latents))
        else:
            shift = config.flow_shift
        sigmas = shifted(draw_fractions(generators, config), shift)
        for i, generator in enumerate(generators):
            # A denoiser that serves part of the schedule (a Wan 2.2 expert) redraws outside it, from the sample's own
            # generator: the drawn distribution cut to its range, its shape kept (musubi-tuner's
            # `--preserve_distribution_shape`), not squeezed into it. Where the schedule is split between modules
            # (both experts), the batch's later samples redraw onto the first's side: each sample's level still
            # follows the whole distribution, and a step runs one module.
            while not self.trains_noise_level(components, float(sigmas[i])) or not self.same_denoiser(
                components, float(sigmas[0]), float(sigmas[i])
            ):
                sigmas[i] = shifted(draw_fractions([generator], config), shift)[0]
        return to_device(sigmas, latents.device) * 1000, *draw_noise(generators, latents, config)

    def noised(self, components, latents, timesteps, noise):
        sigmas = (timesteps.float() / 1000).view(-1, *[1] * (latents.dim() - 1))  # an image's or a clip's latents
        return (1 - sigmas) * latents + sigmas * noise

    def sampling_timesteps(self, components, latents, steps):
        # The pipelines' sigmas (1 down to 1 / steps, then 0), shifted as the base's scheduler shifts this size
        shift = self.resolution_shift(components, components.family.image_tokens(latents))
        return shifted(torch.linspace(1, 0, steps + 1, device=latents.device), shift) * 1000

    def sampler_step(self, components, schedule, index, noisy, prediction, noise_level, config):
        """Flow-GRPO's SDE step: the ODE's marginals kept with noise of scale a sqrt(sigma / (1 - sigma)) (a:
        `noise_level`), its mean Euler's step plus the drift that noise asks for; at sigma = 1, where that scale is
        infinite, it is read at the schedule's next sigma, as Flow-GRPO does. At a = 0: the Euler step."""
        sigma, below = schedule[index] / 1000, schedule[index + 1] / 1000
        step = below - sigma  # negative
        scale = noise_level * (sigma / (1 - torch.where(sigma >= 1, schedule[1] / 1000, sigma))).sqrt()
        drift = scale**2 / (2 * sigma)
        mean = noisy * (1 + drift * step) + prediction * (1 + drift * (1 - sigma)) * step
        return mean, scale * (-step).sqrt()

    def loss(self, components, latents, timesteps, noise, conditioning, geometry, config, input_noise=None, mask=None):
        noisy = self.noised(components, latents, timesteps, noise if input_noise is None else input_noise)
        prediction = components.family.denoise(components, noisy, timesteps, conditioning, geometry)
        return self.weighted(flow_error(prediction, noise - latents, timesteps, config, mask), timesteps, config)

    def weighted(self, per_sample: torch.Tensor, timesteps: torch.Tensor, config: LossConfig) -> torch.Tensor:
        """Per-sample errors (B,) weighted by their noise levels as `loss.weighting` says (uniform under "auto")."""
        weighting = "uniform" if config.weighting == "auto" else config.weighting
        return per_sample * compute_loss_weighting_for_sd3(weighting, timesteps.float() / 1000).to(per_sample.device)


class SamplerShiftFlowMatching(FlowMatching):
    """Flow matching for a base whose pipeline samples with a multistep solver on flow sigmas shifted by one
    `flow_shift` at every size (Wan's UniPC, Sana's DPM-Solver): training draws its noise levels, and difftune's samples
    are drawn, through an Euler flow scheduler of that shift."""

    def training_scheduler(self, scheduler):
        shift = scheduler.config.get("flow_shift") or scheduler.config.get("shift", 1.0)
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=scheduler.config.num_train_timesteps, shift=shift)


class FlowOptions(FamilyOptions):
    guidance: float = Field(
        1.0,
        ge=0,
        description="Bases with a guidance embedding (guidance-distilled, as FLUX.1-dev and FLUX.2-dev): the "
        "guidance value training conditions on. 1 is what kohya's FLUX.1 LoRA examples pass (`--guidance_scale 1.0`); "
        "diffusers' Flux, Kontext and FLUX.2 scripts default to 3.5. Bases without one ignore it.",
    )


class FlowDrawing(Drawing):
    """A flow family's drawing: the flow-matching Euler sampler and the guidance arguments the flow pipelines share."""

    default_sampler = "euler"
    samplers = {"euler": FlowMatchEulerDiscreteScheduler}

    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """A guidance-distilled base takes the scale as its guidance embedding; one without that gets true
        classifier-free guidance (a second, negative pass) when the scale is above 1. Both the Flux and the
        Qwen-Image pipelines name these arguments so."""
        arguments = {"max_sequence_length": self.family.max_sequence_length(components)}
        if components.denoiser.config.guidance_embeds:
            return arguments | {"guidance_scale": guidance_scale, "negative_prompt": negative_prompt or None}
        if guidance_scale > 1 and self.reads_input_control(components):
            raise DifftuneError(
                f"sample.guidance_scale = {guidance_scale}: {self.family.input_control.pipeline_class.__name__} guides "
                "through the base's guidance embedding alone, which this base lacks; set it to 1"
            )
        if guidance_scale > 1:
            return arguments | {"true_cfg_scale": guidance_scale, "negative_prompt": negative_prompt or ""}
        return arguments


class FlowMatchingFamily(Family):
    """A family trained by rectified flow, over latents its denoiser reads as 2x2 patches (`patch_size`)."""

    patch_size = 2  # latent pixels per token side: what the resolution shift counts tokens by
    block_lists = ("transformer_blocks", "single_transformer_blocks")  # double-stream, then single-stream
    drawing = FlowDrawing()

    options_model = FlowOptions
    objective = FlowMatching()

    def guidance(self, components: Components, batch: int, device) -> torch.Tensor | None:
        """The guidance embedding's input (B,) for a guidance-distilled transformer (`model.family_options.guidance`),
        else None."""
        if not components.denoiser.config.get("guidance_embeds"):
            return None
        return torch.full((batch,), float(components.family_options.guidance), device=device)

    def monitored_blocks(self, denoiser: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """The transformer's blocks, list by list in `block_lists`' order (the order it runs them)."""
        blocks = {}
        for blocks_name in self.block_lists:
            blocks |= {
                match.group(1): module
                for name, module in denoiser.named_modules()
                if (match := re.search(rf"(?:^|\.)({blocks_name}\.\d+)$", name))
            }
        return blocks

    def offloadable_blocks(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """The transformer's blocks, double-stream then single-stream."""
        return list(self.monitored_blocks(denoiser).values())

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_channels // self.patch_size**2  # a token is a patch

    def image_tokens(self, latents: torch.Tensor) -> int:
        """The tokens the resolution shift counts for one sample of `latents` (B, C, ...): all of them (a clip's are
        all its frames', as `LTX2Pipeline` counts them; the other video families' schedulers shift alike at every
        size), unless the family's pipeline counts otherwise."""
        return latents[0, 0].numel() // self.patch_size**2

    def max_sequence_length(self, components: Components) -> int:
        """The text tokens the pipeline reads (its `max_sequence_length`): the tokens training reads, its conditioning's
        `padded_text_tokens` where it pads every caption to them."""
        if self.conditioning.padded_text_tokens is None:
            raise NotImplementedError
        return self.conditioning.padded_text_tokens
