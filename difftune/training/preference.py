"""Preference tuning: Diffusion-DPO (Wallace et al., "Diffusion Model Alignment Using Direct Preference Optimization").

A preference pair is an image of the data (the chosen one, for its caption) and its control image (the rejected one:
the edit pairs' layout, so one folder layout serves both). Both are noised at the same timestep with the same noise;
the objective's own per-sample loss (epsilon, v or flow matching, as the family trains) is taken with the adapter on
(the model) and off (the reference: the base itself, so no second copy sits in memory), and the loss is

    -log sigmoid(-beta / 2 * ((model(chosen) - model(rejected)) - (reference(chosen) - reference(rejected))))

as diffusers' `examples/research_projects/diffusion_dpo` computes it; for flow families the same expression over the
flow-matching loss is SimpleTuner's flow DPO. The rejected image's latents are its posterior's mode (a pair's control
is cached as its mean), the chosen one's a posterior draw as in any run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from difftune.adapters.trained import adapters_switched_off
from difftune.data.dataset import check_one_control_each
from difftune.errors import DifftuneError


def dpo_loss(
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    model: torch.nn.Module,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    beta: float,
    chosen_weight: float = 0.0,
    reference_loss_of: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Diffusion-DPO's per-sample loss (B,), plus `chosen_weight` x the objective's own loss on the chosen image.
    `loss_of(latents)`: the objective's per-sample loss of the model on `latents` at the batch's timesteps and
    noise; `chosen` and `rejected`: the pairs' latents (B, C, ...). The reference is `model` (every module holding a
    trained adapter) with its adapters off, through `reference_loss_of` where the reference reads its inputs anew
    (captions through text encoders whose adapters are off), else through `loss_of`."""
    chosen_loss = loss_of(chosen)
    model_gap = chosen_loss - loss_of(rejected)
    reference_loss_of = reference_loss_of or loss_of
    with torch.no_grad(), adapters_switched_off(model):
        reference_gap = reference_loss_of(chosen) - reference_loss_of(rejected)
    return -F.logsigmoid(-0.5 * beta * (model_gap - reference_gap)) + chosen_weight * chosen_loss


def check_preference_pairs(examples: list, family, key: str = "data.path") -> None:
    """Every example a pair of a chosen image and one rejected image, on a base that reads no control images itself
    (an edit base's controls are its input, not a rejected image; a base whose prompts read references would read the
    rejected image with the caption)."""
    if (
        family.edit_base or family.conditioning.prompts_see_controls
    ):  # Qwen-Image-Layered's control is the image it splits
        raise DifftuneError(
            f'preference.method = "dpo": {family.description} bases read control images as their input; preference '
            "tuning takes text-to-image and video bases"
        )
    check_one_control_each(examples, key, "rejected image", 'preference.method = "dpo"')
