"""Concept sliders (Gandikota et al., "Concept Sliders"; ai-toolkit's `concept_slider`): a LoRA whose signed scale
moves one attribute. On a training image noised at a timestep, the frozen base (the LoRA switched off) predicts for
the slider's `target`, `positive` and `negative` prompts; the LoRA at scale +1 is taught to predict, for `target`,
the base's prediction plus `guidance` x (positive - negative), and at scale -1 the base's minus it. The images are
only places in the noise process; their captions are not read.
"""

from __future__ import annotations

import torch

from difftune.adapters.trained import adapters_switched_off, lora_scaled

PROMPTS = ("target", "positive", "negative")


def expanded(conditioning: dict[str, torch.Tensor], batch: int) -> dict[str, torch.Tensor]:
    """One prompt's conditioning (each tensor with a batch of 1) for `batch` samples."""
    return {name: value.expand(batch, *value.shape[1:]) for name, value in conditioning.items()}


def slider_loss(
    components,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    noise: torch.Tensor,
    prompts: dict[str, dict[str, torch.Tensor]],
    geometry: torch.Tensor,
    guidance: float,
) -> torch.Tensor:
    """The slider's per-sample loss (B,): the mean square error of the LoRA's prediction for `target` at scale +1
    and at -1 from the base's, moved by +- `guidance` x (positive - negative), averaged over the two scales.
    `prompts`: each of `PROMPTS`' encoded conditioning, a batch of one."""
    family, batch = components.family, latents.shape[0]
    noisy = family.objective.noised(components, latents, timesteps, noise)

    def predict(prompt: str) -> torch.Tensor:
        return family.denoise(components, noisy, timesteps, expanded(prompts[prompt], batch), geometry).float()

    with torch.no_grad(), adapters_switched_off(components.denoiser):
        neutral = predict("target")
        direction = guidance * (predict("positive") - predict("negative"))
    losses = []
    for sign in (1.0, -1.0):
        with lora_scaled(components.denoiser, sign):
            error = predict("target") - (neutral + sign * direction)
        losses.append(error.square().mean(dim=tuple(range(1, error.dim()))))
    return (losses[0] + losses[1]) / 2


def encoded_prompts(components, slider, device: torch.device) -> dict[str, dict[str, torch.Tensor]]:
    """Each of the slider's `PROMPTS` encoded once, before training, as a batch of one on `device` (the text encoders
    are frozen, and may leave memory once the captions are cached)."""
    from difftune.models.components import encoders_on

    conditioning = components.family.conditioning
    with encoders_on(device, list(components.text_encoders.values())):
        return {name: conditioning.encoded_texts(components, [getattr(slider, name)], device) for name in PROMPTS}
