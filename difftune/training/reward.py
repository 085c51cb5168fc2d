"""Reward fine-tuning: the adapter learns from scores of the images it draws, not from images it is given.

`grpo` is Flow-GRPO (Liu et al., "Flow-GRPO: Training Flow Matching Models via Online RL", 2025) and, for the epsilon
and v families, DDPO (Black et al. 2023) with GRPO's advantages. Each round draws `group_size` images for each of
`train.batch_size` prompts with the family's sampler made stochastic (`Objective.sampler_step`: Flow-GRPO's SDE, or
DDIM with eta), keeping every state and each step's log-probability. The scorer scores them; an image's advantage is
its score against its prompt's group (mean and spread), so no value model is needed. Training then raises the
log-probability of each drawn step in proportion to its image's advantage, the ratio to the drawing policy clipped
as PPO's, and a KL term holds each step's mean near the base's (the adapter switched off: no second copy).
Log-probabilities are means over the latent's elements, as Flow-GRPO takes them.

`draft` is DRaFT-K (Clark et al., "Directly Fine-Tuning Diffusion Models on Differentiable Rewards", 2024): a
sample whose last `draft_last_steps` steps and decode keep their graph, and the loss is minus the score, so a scorer
with gradients (a CLIP similarity) trains the adapter directly. The sample is drawn by the same sampler at
`noise_level` (0: deterministic, as the paper's), so the adapter trains on the states an ancestral sampler (DDPM's)
passes as well. `refl` is ReFL (Xu et al., "ImageReward", 2023): the sample stops at a random one of its last
`refl_last_steps` steps and jumps from there to the image in one deterministic step, the scorer's gradient through
that prediction. `kl_weight` anchors both to the base at every step of the sample, so what the scorer has no gradient
for is kept.

A round's randomness comes from the run's seed and the round's number: a run resumed at a round's start draws what
the uninterrupted run drew.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from difftune.adapters.trained import adapters_switched_off
from difftune.config import Config, RewardConfig
from difftune.errors import DifftuneError
from difftune.models.autoencoders import decode_latents, downsampling, latent_channels
from difftune.models.components import Components


def load_scorer(reward: RewardConfig) -> Callable[[torch.Tensor, list[str]], torch.Tensor]:
    """`reward.scorer` (`module:function`) imported, bound to `reward.scorer_options`: images (B, 3, H, W) in [0, 1]
    and B prompts -> B scores, as a float tensor on the images' device."""
    module_name, _, function_name = reward.scorer.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise DifftuneError(
            f"reward.scorer = {reward.scorer!r}: cannot import it ({error}); name a function as module:function, "
            "its module importable here"
        ) from error

    def scored(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        scores = torch.as_tensor(function(images, prompts, **reward.scorer_options))
        if scores.shape != (len(prompts),):
            raise DifftuneError(
                f"reward.scorer {reward.scorer}: returned scores of shape {tuple(scores.shape)} for {len(prompts)} "
                "images; return one number per image"
            )
        return scores.to(images.device, torch.float32)

    return scored


def reward_batches(config: Config, start: int, process: int) -> Iterator[dict]:
    """The loop's batches, from optimizer step `start` on: each names its round (`updates_per_round` steps share one)
    and the round's `train.batch_size` prompts, drawn without replacement until every prompt has been drawn (an epoch),
    each epoch in an order of its own."""
    reward, count = config.reward, len(config.reward.prompts)

    def prompt(index: int) -> str:
        order = np.random.default_rng([config.train.seed, process, index // count]).permutation(count)
        return reward.prompts[order[index % count]]

    for step in itertools.count(start):
        round_, update = divmod(step, reward.updates_per_round)
        first = round_ * config.train.batch_size
        prompts = [prompt(first + k) for k in range(config.train.batch_size)]
        epoch = torch.tensor([first // count])
        yield {"round": round_, "update": update, "prompt": prompts, "path": prompts, "epoch": epoch}


@dataclass
class Round:
    """One round's drawn images: `states[k]` the latents before step k (`states[0]` the noise, `states[-1]` the
    image), each step's log-probability of its draw, and each image's score and advantage."""

    number: int
    conditioning: dict[str, torch.Tensor]  # the prompts' (with guidance, the empty prompt's after them: `_encoded`)
    schedule: torch.Tensor  # (steps + 1,) timesteps
    states: torch.Tensor  # (steps + 1, B, C, h, w)
    log_probs: torch.Tensor  # (steps, B)
    scores: torch.Tensor  # (B,)
    advantages: torch.Tensor  # (B,)
    trained_steps: list[int]


class RewardTraining:
    """A reward run's step: `loss` draws (or reuses) the round, computes its loss and runs the backward itself
    (one denoising step's graph at a time), returning the loss and the step's reward metrics."""

    def __init__(self, components: Components, config: Config, device: torch.device, process: int):
        self.config, self.device, self.process = config, device, process
        self.scorer = load_scorer(config.reward)
        self.round: Round | None = None
        side = config.data.largest_resolution()
        size = side // downsampling(components.vae)
        self.latent_shape = (latent_channels(components.vae), size, size)
        self.geometry = torch.tensor([side, side, 0, 0, side, side])

    def loss(self, components: Components, batch: dict, backward: Callable[[torch.Tensor], None]) -> tuple:
        reward = self.config.reward
        if reward.method in ("draft", "refl"):
            return self._draft(components, batch["prompt"], batch["round"], backward)
        if self.round is None or self.round.number != batch["round"]:
            self.round = self._draw(components, batch["prompt"], batch["round"])
        drawn = self.round
        total = torch.zeros((), device=self.device)
        kl_total = torch.zeros((), device=self.device)
        for step in drawn.trained_steps:
            noisy = drawn.states[step]
            mean, std = self._policy_step(components, drawn.schedule, step, noisy, drawn.conditioning)
            log_prob = gaussian_log_prob(drawn.states[step + 1], mean, std)
            ratio = torch.exp(log_prob - drawn.log_probs[step])
            clipped = ratio.clamp(1 - reward.clip_range, 1 + reward.clip_range)
            policy = torch.maximum(-drawn.advantages * ratio, -drawn.advantages * clipped).mean()
            kl = torch.zeros((), device=self.device)
            if reward.kl_weight:
                kl = self._kl_to_base(components, drawn.schedule, step, noisy, drawn.conditioning, mean, std)
            loss = (policy + reward.kl_weight * kl) / len(drawn.trained_steps)
            backward(loss)
            total += loss.detach()
            kl_total += kl.detach() / len(drawn.trained_steps)
        return total, self._metrics(drawn.scores) | {"kl": kl_total}

    @torch.no_grad()
    def _draw(self, components: Components, prompts: list[str], number: int) -> Round:
        """`group_size` images of each prompt, drawn by the stochastic sampler with the adapter on; scored."""
        reward = self.config.reward
        group = [prompt for prompt in prompts for _ in range(reward.group_size)]
        generator = self._generator(number)
        conditioning = self._encoded(components, group)
        schedule, states, log_probs = self._sample(components, conditioning, len(group), generator)
        images = self._decoded(components, states[-1])
        scores = self.scorer(images, group)
        grouped = scores.view(len(prompts), reward.group_size)
        advantages = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-4)
        steps = reward.steps
        trained = list(range(steps))
        if reward.trained_steps and reward.trained_steps < steps:
            trained = sorted(torch.randperm(steps, generator=generator)[: reward.trained_steps].tolist())
        return Round(number, conditioning, schedule, states, log_probs, scores, advantages.flatten(), trained)

    def _sample(self, components, conditioning, batch: int, generator: torch.Generator):
        """The stochastic sampler's states and log-probabilities, from noise to the image's latents."""
        state, schedule = self._noise_and_schedule(components, batch, generator)
        states, log_probs = [state], []
        for step in range(len(schedule) - 1):
            mean, std = self._policy_step(components, schedule, step, state, conditioning)
            state = mean + std * torch.randn(mean.shape, generator=generator).to(self.device)
            states.append(state)
            log_probs.append(gaussian_log_prob(state, mean, std))
        return schedule, torch.stack(states), torch.stack(log_probs)

    def _noise_and_schedule(self, components, batch: int, generator: torch.Generator):
        """A sample's starting noise (`batch` latents) and the timesteps its `reward.steps` pass."""
        state = torch.randn((batch, *self.latent_shape), generator=generator).to(self.device)
        return state, components.family.objective.sampling_timesteps(components, state, self.config.reward.steps)

    def _policy_step(self, components, schedule, step: int, noisy, conditioning):
        """The stochastic step's mean and deviation from `noisy` at `reward.noise_level`."""
        prediction = self._predict(components, noisy, schedule[step], conditioning)
        return components.family.objective.sampler_step(
            components, schedule, step, noisy, prediction, self.config.reward.noise_level, self.config.loss
        )

    def _kl_to_base(self, components, schedule, step: int, noisy, conditioning, mean, std) -> torch.Tensor:
        """The KL divergence of the stochastic step (`mean`, `std`) from the base's at `noisy`, the adapter switched
        off: the squared distance of their means over 2 std^2, averaged over each image's elements and the images."""
        with torch.no_grad(), adapters_switched_off(components.denoiser):
            base_mean, _ = self._policy_step(components, schedule, step, noisy, conditioning)
        return (((mean - base_mean) ** 2).mean(dim=tuple(range(1, mean.dim()))) / (2 * std**2)).mean()

    def _predict(self, components, noisy, timestep, conditioning) -> torch.Tensor:
        """The denoiser's prediction, guided (classifier-free, the empty prompt as the negative) when asked: both halves
        in one call, so a distributed denoiser runs one forward per backward."""
        guided = self.config.reward.guidance_scale > 1
        inputs = torch.cat([noisy, noisy]) if guided else noisy
        batch = inputs.shape[0]
        timesteps = timestep.expand(batch).to(self.device)
        geometry = self.geometry.expand(batch, -1)
        prediction = components.family.denoise(components, inputs, timesteps, conditioning, geometry).float()
        if not guided:
            return prediction
        prompted, unguided = prediction.chunk(2)
        return unguided + self.config.reward.guidance_scale * (prompted - unguided)

    def _encoded(self, components: Components, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The prompts' text conditioning; with guidance, the empty prompt's for each after them (one batch, so the
        two halves are padded alike)."""
        captions = prompts + ([""] * len(prompts) if self.config.reward.guidance_scale > 1 else [])
        return components.family.conditioning.encoded_texts(components, captions, self.device)

    def _decoded(self, components: Components, latents: torch.Tensor) -> torch.Tensor:
        vae = components.vae
        return ((decode_latents(vae, latents.to(vae.dtype)).float() + 1) / 2).clamp(0, 1)

    def _draft(self, components, prompts: list[str], number: int, backward) -> tuple:
        """DRaFT-K: the last K steps and the decode with their graphs, minus the mean score the loss. ReFL: the sample
        stops at a random one of its last `refl_last_steps` steps, which jumps to the image in one deterministic step
        (the sampler's step to the schedule's end at noise 0, the prediction's clean image) with its graph, so the
        scorer trains the steps that decide what an image becomes, not the last alone. With `kl_weight`, every step of
        the sample also pays the squared distance of its prediction from the base's, so what the reward does not ask
        for (a shape the scorer has no gradient for) stays as the base draws it: a step outside the graph pays it in a
        backward of its own. The distance weighs the steps as the denoising loss does, not as the policy's KL, whose
        last, nearly noiseless steps would outweigh the rest by a hundredfold and hold back the very step DRaFT-1
        trains."""
        reward, objective = self.config.reward, components.family.objective
        generator = self._generator(number)
        conditioning = self._encoded(components, prompts)
        state, schedule = self._noise_and_schedule(components, len(prompts), generator)
        last, first_in_graph = reward.steps - 1, reward.steps - reward.draft_last_steps
        if reward.method == "refl":
            last -= int(torch.randint(reward.refl_last_steps, (), generator=generator))
            first_in_graph = last
        kl_in_graph, kl_total = state.new_zeros(()), state.new_zeros(())
        for step in range(last + 1):
            in_graph = step >= first_in_graph
            with torch.set_grad_enabled(in_graph or reward.kl_weight > 0):
                prediction = self._predict(components, state, schedule[step], conditioning)
                if reward.kl_weight:
                    with torch.no_grad(), adapters_switched_off(components.denoiser):
                        base_prediction = self._predict(components, state, schedule[step], conditioning)
                    kl = F.mse_loss(prediction, base_prediction) / reward.steps
                    kl_total += kl.detach()
                    if in_graph:
                        kl_in_graph = kl_in_graph + kl
                    else:
                        backward(reward.kl_weight * kl)
                        prediction = prediction.detach()
                if reward.method == "refl" and step == last:
                    jump = schedule[[step, -1]]
                    state, _ = objective.sampler_step(components, jump, 0, state, prediction, 0.0, self.config.loss)
                    break
                mean, std = objective.sampler_step(
                    components, schedule, step, state, prediction, reward.noise_level, self.config.loss
                )
                state = mean + std * torch.randn(mean.shape, generator=generator).to(self.device)
        scores = self.scorer(self._decoded(components, state), prompts)
        if not scores.requires_grad:
            raise DifftuneError(
                f'reward.method = "{reward.method}": reward.scorer {reward.scorer} returned scores without gradients; '
                'it needs a differentiable scorer (or use reward.method = "grpo")'
            )
        loss = -scores.mean() + reward.kl_weight * kl_in_graph
        backward(loss)
        metrics = self._metrics(scores.detach()) | {"kl": kl_total}
        return loss.detach() + reward.kl_weight * (kl_total - kl_in_graph.detach()), metrics

    def _generator(self, number: int) -> torch.Generator:
        """Round `number`'s randomness (its noise, its draws, its trained steps) on this process."""
        seed = np.random.SeedSequence([self.config.train.seed, self.process, number]).generate_state(1)[0]
        return torch.Generator().manual_seed(int(seed))

    @staticmethod
    def _metrics(scores: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"reward": scores.mean(), "reward_std": scores.std() if scores.numel() > 1 else scores.new_zeros(())}


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """The log-density of `sample` under N(mean, std^2), averaged over each sample's elements (B,)."""
    std = torch.as_tensor(std, device=mean.device, dtype=mean.dtype)
    log_density = -((sample - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * np.log(2 * np.pi)
    return log_density.mean(dim=tuple(range(1, log_density.dim())))
