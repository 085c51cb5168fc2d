"""Validation loss: a fixed held-out set scored at fixed timesteps with fixed noise.

Everything random is drawn once, so two evaluations of the same weights give the same number and
runs with different settings are scored on the same problem. The loss is the plain (unweighted) MSE
of the model's prediction target, whatever weighting training uses.
"""

from __future__ import annotations

from functools import partial

import torch

from difftune.config import Config
from difftune.data import CaptionedImages, derive_seed, report_bad_files, scan_examples
from difftune.models import Components, encode_latents, eval_mode

VALIDATION_STREAM = 2


class Validator:
    """With `data.buckets`, each held-out image is scored at its own bucket size, as training would see it; images
    of one size are batched together."""

    def __init__(self, components: Components, config: Config, device: torch.device):
        data = config.data.model_copy(
            update={"path": config.validation.path, "crop": "center", "random_flip": False, "caption_dropout": 0.0}
        )
        examples, bad_files = scan_examples(data)
        report_bad_files(bad_files, None)
        family = components.family
        dataset = CaptionedImages(examples, data, partial(family.tokenize, components.tokenizers), config.validation.seed)
        items = [dataset[(0, i)] for i in range(len(examples))]
        seed, timesteps = config.validation.seed, config.validation.timesteps
        noise_generator = torch.Generator().manual_seed(derive_seed(VALIDATION_STREAM, seed, len(items)))
        by_size: dict[tuple, list[int]] = {}
        for i, item in enumerate(items):
            by_size.setdefault(tuple(item["pixel_values"].shape), []).append(i)
        # One group per image size, each with every (image, timestep) pair and its own fixed noise: (N * T, C, h, w).
        self.groups = []

        def per_pair(tensors: list[torch.Tensor]) -> torch.Tensor:
            """One image's tensors -> one row per (image, timestep) pair, on the device."""
            return torch.stack(tensors).to(device).repeat_interleave(len(timesteps), dim=0)

        for indices in by_size.values():
            generators = [torch.Generator().manual_seed(derive_seed(VALIDATION_STREAM, seed, i)) for i in indices]
            pixels = torch.stack([items[i]["pixel_values"] for i in indices]).to(device)
            with torch.no_grad():
                latents = encode_latents(components.vae, pixels, generators).float().repeat_interleave(len(timesteps), dim=0)
            self.groups.append({
                "latents": latents,
                "token_ids": {name: per_pair([items[i]["token_ids"][name] for i in indices]) for name in items[0]["token_ids"]},
                "geometry": per_pair([items[i]["geometry"] for i in indices]),
                "timesteps": torch.tensor(timesteps * len(indices), device=device),
                "noise": torch.randn(latents.shape, generator=noise_generator).to(device),
            })
        self.loss_config = config.loss.model_copy(update={"weighting": "uniform", "noise_offset": 0.0, "input_perturbation": 0.0})
        self.batch_size = config.train.batch_size
        self.size = len(items)

    @torch.no_grad()
    def loss(self, components: Components) -> float:
        """Mean loss over every (image, timestep) pair, with the components' current weights."""
        family, total, count = components.family, 0.0, 0
        with eval_mode(components.denoiser, *components.text_encoders.values()):
            for group in self.groups:
                for start in range(0, len(group["latents"]), self.batch_size):
                    part = slice(start, start + self.batch_size)
                    token_ids = {name: ids[part] for name, ids in group["token_ids"].items()}
                    per_sample = family.loss(
                        components, group["latents"][part], group["timesteps"][part], group["noise"][part],
                        family.encode_prompts(components, token_ids), group["geometry"][part], self.loss_config,
                    )
                    total += per_sample.sum().item()
                    count += len(per_sample)
        return total / count
