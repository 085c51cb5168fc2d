"""A family's adapter targets, a role it holds (`family.targets`): which parts and modules an adapter goes on, which
text encoders its pipeline's LoRA loader reads, and what of the adapter settings it refuses."""

from __future__ import annotations

from typing import NamedTuple

import torch

from difftune.config import Config
from difftune.families.common.loading import FamilyOptions
from difftune.families.common.role import Role
from difftune.models.components import Components


def targets_in_blocks(model: torch.nn.Module, targets: dict[str, list[str]]) -> list[str]:
    """Every block's `targets` by full name, per list of blocks (`{block list: its blocks' layers}`): what a family
    adapts where other blocks hold layers of the same names that its training never runs (FLUX.3's reference-image
    blocks, Z-Image Omni's SigLIP refiner), or where its block lists differ in layers (Kandinsky 5's)."""
    return [
        f"{blocks}.{index}.{target}"
        for blocks, layers in targets.items()
        for index in range(len(model.get_submodule(blocks)))
        for target in layers
    ]


class AdapterFile(NamedTuple):
    """One adapter file a run writes: its name's suffix, its tensors (diffusers' names) and peft configs, and the
    config it records."""

    suffix: str
    tensors: dict[str, torch.Tensor]
    lora_configs: dict
    config: Config


class AdapterTargets(Role):
    lora_text_encoders: tuple[str, ...] | None = None  # those its pipeline's LoRA loader reads adapters of (None: all)
    default_targets: dict[str, list[str]]  # part -> modules that get an adapter unless the config lists others
    trains_embeddings = False  # textual inversion is built for it (`adapter.kind = "embedding"`)
    # Family options a difftune file's recorded config keeps where it is loaded to draw: which part it adapts (Wan 2.2's
    # expert, `denoiser_part`), how long its sounds are (ACE-Step's seconds)
    recorded_options: tuple[str, ...] = ()

    def lora_loading_arguments(self, options: FamilyOptions) -> dict:
        """What the pipeline's `load_lora_weights` needs to put a file's denoiser adapter on `denoiser_part`."""
        return {}

    def combined_option(self, name: str, values: set) -> object | None:
        """The value of placement option `name` under which files recorded with `values` load together (Wan 2.2's
        "both" for a file of each expert), or None: they cannot."""
        return None

    def adapter_files(self, tensors: dict, lora_configs: dict, config: Config) -> list[AdapterFile]:
        """The files a run's trained adapter is written as: one, unless the denoiser is several parts that tools load
        a file each of (Wan 2.2's experts trained together), each named with its `adapter_file_suffixes`."""
        return [AdapterFile("", tensors, lora_configs, config)]

    def adapter_file_suffixes(self, config: Config) -> tuple[str, ...]:
        """The name suffixes of the files `adapter_files` writes."""
        return ("",)

    def adapter_problems(self, config: Config) -> list[str]:
        """What `check_config` refuses of the adapter for any family: text-encoder adapters its pipeline's LoRA
        loader would drop, and textual inversion where it is not built."""
        problems = []
        if config.adapter.text_encoder and config.adapter.is_adapter and not self.adapted_text_encoders():
            family = self.family
            problems.append(
                f"adapter.text_encoder: {family.pipeline_class.__name__}'s LoRA loader reads {family.denoiser_name} "
                "adapters alone (a text encoder adapter would be dropped where the file is used); set it to false, "
                'or fine-tune in full (adapter.kind = "none"), which saves the text encoder in the pipeline folder'
            )
        if config.adapter.learns_tokens and not self.trains_embeddings:
            problems.append(
                f'adapter.kind = "embedding": textual inversion is not built for {self.family.description}; '
                "train a LoRA"
            )
        if config.adapter.control_input and self.family.input_control is None:
            problems.append(
                f"adapter.control_input: {self.family.description} has no pipeline that reads control images as input "
                "channels (Flux.1 does: FluxControlPipeline)"
            )
        if config.adapter.trains_controlnet and self.family.controlnet is None:
            problems.append(
                f'adapter.kind = "controlnet": {self.family.description} has no ControlNet model in diffusers that '
                "difftune trains (SD 1.x/2.x, SDXL, SD3/3.5, Flux.1 and Qwen-Image do)"
            )
        return problems

    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        """The modules of `part` (the loaded `model`) an adapter goes on unless the config lists others: the
        family's `default_targets`, unless its names depend on the model's size."""
        return self.default_targets[part]

    def adapter_targets(self, components: Components, part: str) -> list[str]:
        """The modules of `part` a run's adapter goes on unless the config lists others: `targets_of` it, unless the
        run's family options add some (LTX-2's sound)."""
        return self.targets_of(part, components.parts()[part])

    def adapted_text_encoders(self) -> tuple[str, ...]:
        """The text encoders `adapter.text_encoder` trains: the ones diffusers' LoRA loader of this family reads
        (`lora_text_encoders`)."""
        return self.family.text_encoder_names if self.lora_text_encoders is None else self.lora_text_encoders

    def fine_tuned_text_encoders(self) -> tuple[str, ...]:
        """The text encoders a full fine-tune trains with `adapter.text_encoder` (saved in the pipeline folder, which
        the family's pipeline loads whole): the adapted ones, or all of them where the LoRA loader reads the denoiser's
        adapters alone."""
        return self.adapted_text_encoders() or self.family.text_encoder_names

    def adapter_parts(self) -> tuple[str, ...]:
        """The parts an adapter file may hold: the denoiser and the adapted text encoders."""
        return (self.family.denoiser_name, *self.adapted_text_encoders())

    def parts(self) -> tuple[str, ...]:
        """Adapter parts: the denoiser, then the text encoders, as diffusers' LoRA files prefix their keys."""
        return (self.family.denoiser_name, *self.family.text_encoder_names)
