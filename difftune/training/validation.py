"""Validation loss: a fixed held-out set scored at fixed timesteps with fixed noise; and the run's best results.

Everything random is drawn once, so two evaluations of the same weights give the same number and
runs with different settings are scored on the same problem. The loss is the plain (unweighted) MSE
of the model's prediction target, whatever weighting training uses. On the bundled shapes bases each
validation can also judge samples (`validation.eval_concept`), as `difftune eval` does.

`BestResults` keeps the result of the lowest validation loss (and of the highest judged score) as the run goes,
so a run too long for its data still leaves its best point behind, and counts validations without an
improvement for early stopping. Its record travels in checkpoints, so a resumed run knows its best so far.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from functools import partial
from importlib.metadata import entry_points
from pathlib import Path
from typing import Protocol

import torch

from difftune.config import Config, ValidationConfig
from difftune.data.dataset import (
    CaptionedImages,
    control_sizes,
    derive_seed,
    report_bad_files,
    scan_examples,
    training_sizes,
)
from difftune.errors import DifftuneError
from difftune.models.autoencoders import encode_latents, encode_posterior, reference_latents
from difftune.models.components import Components, eval_mode

VALIDATION_STREAM = 2


JUDGES = "difftune.judges"  # the entry-point group a judge is registered under (pyproject.toml)


class Judge(Protocol):
    """Scores a model's own samples of a concept, for `validation.eval_concept`. The library knows no judge: one is
    registered under the `difftune.judges` entry points by the package that has one (difftune's shapes judge, in
    `toy/`), and found by the concepts it judges."""

    concepts: tuple[str, ...]

    def scores(self, components: Components, concept: str, samples_per_prompt: int) -> tuple[float, float]:
        """The fractions of judged samples right for the concept's prompts, and for the prompts the base already
        knew (forgetting)."""


def judge_of(concept: str) -> Judge:
    """The installed judge of `concept`."""
    judges = [entry.load() for entry in entry_points(group=JUDGES)]
    for judge in judges:
        if concept in judge.concepts:
            return judge
    known = [name for judge in judges for name in judge.concepts]
    raise DifftuneError(
        f"validation.eval_concept = {concept!r}: not a concept an installed judge scores (the shapes "
        f"bases' colors: {', '.join(known) or 'none installed'}); or empty: no judged samples"
    )


class Validator:
    """With `data.buckets`, each held-out image is scored at its own bucket size, as training would see it; images
    of one size (and, for edit pairs, one count and size of controls) are batched together."""

    def __init__(self, components: Components, config: Config, device: torch.device):
        self.eval_concept, self.eval_samples = config.validation.eval_concept, config.validation.eval_samples_per_prompt
        self.judge = judge_of(self.eval_concept) if self.eval_concept else None
        data = config.data.model_copy(
            update={
                "path": config.validation.path,
                "crop": "center",
                "random_flip": False,
                "caption_dropout": 0.0,
                "shuffle_tags": False,
                "tag_dropout": 0.0,
                "masks": "off",
                "control_path": "",
                "repeats": 1,
                "loss_weight": 1.0,
                "datasets": [],
            }  # prefix and suffix stay: the captions as trained; controls in its own `control`
        )
        family = components.family
        examples, bad_files = scan_examples(
            data,
            "validation.path",
            family.conditioning.frame_windows(data, components),
            layers=family.conditioning.trains_layers,
        )
        report_bad_files(bad_files, None)
        family.conditioning.check_controls(examples, "validation.path")
        sizes = training_sizes(examples, data)
        rule = partial(family.conditioning.control_size, options=components.family_options)
        dataset = CaptionedImages(
            examples,
            data,
            family.conditioning.tokenizer(components),
            config.validation.seed,
            sizes=sizes,
            control_sizes=control_sizes(examples, sizes, rule),
            sees_controls=family.conditioning.prompts_see_controls,
        )
        items = [dataset[(0, i)] for i in range(len(examples))]
        # A run that trains its clips' sound scores it too: each clip's sound under its window, as the cache holds it.
        sounds = [
            family.conditioning.sound_conditioning(components, [(example.path, example.frames)])
            if family.conditioning.trains_sound(components)
            else {}
            for example in examples
        ]
        seed = config.validation.seed
        timesteps = [
            t for t in config.validation.timesteps if family.objective.trains_noise_level(components, t / 1000)
        ]
        if not timesteps:
            raise DifftuneError(
                f"validation.timesteps {config.validation.timesteps}: none is a noise level this run trains (a Wan 2.2 "
                "expert serves part of the schedule); list some of its own"
            )
        noise_generator = torch.Generator().manual_seed(derive_seed(VALIDATION_STREAM, seed, len(items)))
        by_size: dict[tuple, list[int]] = {}
        for i, item in enumerate(items):
            control_shapes = [control.shape for control in item.get("control_pixels", [])]
            shapes = (item["pixel_values"].shape, *control_shapes, *(value.shape for value in sounds[i].values()))
            by_size.setdefault(tuple(map(tuple, shapes)), []).append(i)
        # One group per image size, each with every (image, timestep) pair and its own fixed noise: (N * T, C, h, w).
        self.groups = []

        def per_pair(tensors: list[torch.Tensor]) -> torch.Tensor:
            """One image's tensors -> one row per (image, timestep) pair, on the device."""
            return torch.stack(tensors).to(device).repeat_interleave(len(timesteps), dim=0)

        for indices in by_size.values():
            generators = [torch.Generator().manual_seed(derive_seed(VALIDATION_STREAM, seed, i)) for i in indices]
            pixels = torch.stack([items[i]["pixel_values"] for i in indices]).to(device)
            controls = [
                torch.stack([items[i]["control_pixels"][k] for i in indices]).to(device)
                for k in range(len(items[indices[0]].get("control_pixels", [])))
            ]  # per control: (N, 3, h, w)
            # On `device` wherever the autoencoder waits (in host memory once the latent cache is filled).
            with torch.no_grad():
                latents = (
                    encode_latents(components.vae, pixels, generators)
                    .float()
                    .repeat_interleave(len(timesteps), dim=0)
                    .to(device)
                )
                from_pixels = {
                    name: value.repeat_interleave(len(timesteps), dim=0).to(device)
                    for name, value in family.conditioning.pixel_conditioning(components, pixels).items()
                }
                control_latents = [
                    reference_latents(encode_posterior(components.vae, control)[0], components.latent_normalization)
                    .repeat_interleave(len(timesteps), dim=0)
                    .to(device)
                    for control in controls
                ]
                conditioning = {"control_latents": control_latents} if control_latents else {}
                latents = family.conditioning.trained_latents(
                    latents, conditioning
                )  # a layered base's: the image and its layers
                control_latents = conditioning.pop("control_latents", [])
                from_pixels |= conditioning  # what the family made of the controls (the image a layered base splits)
            noise = torch.randn(latents.shape, generator=noise_generator).to(device)
            if sounds[indices[0]]:
                from_pixels |= {
                    name: torch.cat([sounds[i][name] for i in indices])
                    .repeat_interleave(len(timesteps), dim=0)
                    .to(device)
                    for name in sounds[indices[0]]
                }
                sound_shape = from_pixels["sound_latents"].shape
                from_pixels["sound_noise"] = torch.randn(sound_shape, generator=noise_generator).to(device)
            self.groups.append(
                {
                    "latents": latents,
                    # Per image, not per pair: `loss` encodes each caption in a batch once, not once per timestep.
                    "token_ids": {
                        name: torch.stack([items[i]["token_ids"][name] for i in indices]).to(device)
                        for name in items[0]["token_ids"]
                    },
                    "image_of_pair": torch.arange(len(indices)).repeat_interleave(len(timesteps)),
                    "geometry": per_pair([items[i]["geometry"] for i in indices]),
                    "timesteps": torch.tensor(timesteps * len(indices), device=device),
                    "noise": noise,
                    "control_latents": control_latents,
                    "from_pixels": from_pixels,
                }
            )
        self.loss_config = config.loss.model_copy(
            update={"weighting": "uniform", "noise_offset": 0.0, "input_perturbation": 0.0}
        )
        self.batch_size = config.train.batch_size
        self.size = len(items)
        # Each batch's encoded captions, in host memory, while no text encoder trains (they are the same every pass:
        # an 8B language model need not read them again at each validation).
        self.encoded: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def loss(self, components: Components) -> float:
        """Mean loss over every (image, timestep) pair, with the components' current weights."""
        family, total, count = components.family, 0.0, 0
        text_trains = any(
            parameter.requires_grad
            for encoder in components.text_encoders.values()
            for parameter in encoder.parameters()
        )
        with eval_mode(components.denoiser, *components.text_encoders.values()):
            for number, group in enumerate(self.groups):
                for start in range(0, len(group["latents"]), self.batch_size):
                    part = slice(start, start + self.batch_size)
                    images, pair_rows = group["image_of_pair"][part].unique(return_inverse=True)
                    if text_trains or (number, start) not in self.encoded:
                        token_ids = {name: ids[images.to(ids.device)] for name, ids in group["token_ids"].items()}
                        encoded = family.conditioning.encode_prompts(components, token_ids)
                        if not text_trains:
                            self.encoded[number, start] = {name: value.cpu() for name, value in encoded.items()}
                    else:
                        device = group["latents"].device
                        encoded = {name: value.to(device) for name, value in self.encoded[number, start].items()}
                    conditioning = {name: value[pair_rows.to(value.device)] for name, value in encoded.items()}
                    conditioning |= {name: value[part] for name, value in group["from_pixels"].items()}
                    if group["control_latents"]:
                        conditioning["control_latents"] = [controls[part] for controls in group["control_latents"]]
                    per_sample = family.objective.loss(
                        components,
                        group["latents"][part],
                        group["timesteps"][part],
                        group["noise"][part],
                        conditioning,
                        group["geometry"][part],
                        self.loss_config,
                    )
                    total += per_sample.sum().item()
                    count += len(per_sample)
        return total / count

    def judged_scores(self, components: Components) -> dict[str, float]:
        """With `validation.eval_concept`: the fractions of judged samples right in color and shape, for the
        concept's prompts and for the seen colors' (forgetting), and their mean, the score kept at its best."""
        if self.judge is None:
            return {}
        with eval_mode(components.denoiser, *components.text_encoders.values()):
            concept, seen = self.judge.scores(components, self.eval_concept, self.eval_samples)
        return {"eval_concept": concept, "eval_seen": seen, "eval_score": (concept + seen) / 2}


BEST_FILE = "best.json"
# metric -> (the result's variant suffix, whether higher is better)
KEPT = {"val_loss": ("_best", False), "eval_score": ("_best_eval", True)}


class BestResults:
    """The best value of each kept metric so far, its step and the file written for it; and the validations since
    the validation loss last improved. `save(variant)` writes the current result as that variant, returns its path."""

    def __init__(self, config: ValidationConfig, output_dir: Path):
        self.config = config
        self.path = Path(output_dir) / BEST_FILE
        self.records: dict[str, dict] = {}  # metric -> {"step", "value", "file"}
        self.since_improved = 0

    def observe(self, step: int, values: dict, save: Callable[[str], Path]) -> None:
        for metric, (variant, higher) in KEPT.items():
            if metric not in values:
                continue
            value, best = values[metric], self.records.get(metric)
            margin = self.config.min_delta if metric == "val_loss" else 0.0
            better = best is None or (value > best["value"] if higher else value < best["value"] - margin)
            if metric == "val_loss":
                self.since_improved = 0 if better else self.since_improved + 1
            if better:
                written = save(variant) if self.config.keep_best else None
                self.records[metric] = {"step": step, "value": value, "file": written.name if written else None}
        self._write()

    @property
    def exhausted(self) -> bool:
        """Early stopping's verdict: `early_stop_patience` validations in a row without an improvement."""
        patience = self.config.early_stop_patience
        return bool(patience) and self.since_improved >= patience

    def summary(self) -> list[str]:
        return describe_best(self.records)

    def state_dict(self) -> dict:
        return {"records": self.records, "since_improved": self.since_improved}

    def load_state_dict(self, state: dict) -> None:
        self.records, self.since_improved = state["records"], state["since_improved"]
        self._write()

    def _write(self) -> None:
        staging = self.path.with_suffix(".tmp")
        staging.write_text(
            json.dumps(self.state_dict() | {"early_stopped": self.exhausted}, indent=1), encoding="utf-8"
        )
        os.replace(staging, self.path)


def describe_best(records: dict[str, dict]) -> list[str]:
    """One line per kept metric: its best value, the step and the file kept for it."""
    return [
        f"best {metric} {record['value']:.6g} at step {record['step']}"
        + (f": {record['file']}" if record["file"] else "")
        for metric, record in records.items()
    ]


def read_best(output_dir: Path) -> dict[str, dict]:
    """A run's best records so far (best.json); empty before its first validation."""
    path = Path(output_dir) / BEST_FILE
    return json.loads(path.read_text(encoding="utf-8"))["records"] if path.exists() else {}
