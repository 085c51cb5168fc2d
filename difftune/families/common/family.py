"""What a model family is to the rest of difftune: the one place that knows SD from SDXL (and what comes next).

A family names its pipeline class and its parts (the denoiser and the text encoders, by the names diffusers'
pipelines and LoRA files use), calls its denoiser with its conditioning, and holds its roles, each an object with one
job in a module of its own:

- `loading` (loading.py): a base read into `Components`;
- `conditioning` (conditioning.py): captions, controls and pixels into what the denoiser reads, and the text cache;
- `drawing` (drawing.py): samplers, the pipeline over the trained parts, images and clips drawn;
- `targets` (targets.py): the parts and modules an adapter goes on, the files it is written as;
- `layout` (layouts.py): its files in other tools' layouts;
- `objective` (objective.py, flow.py): what training minimises;
- `controlnet`, `input_control` (control.py): its control models, where it has them.

A family declares a role where it differs from the default (`conditioning = FluxConditioning()`, a subclass of the
role's class with only what differs); the first four read the family back (`role.family`, role.py). The loop, data,
caches, checkpoints, export, eval and UI ask the family and its roles and never branch on which it is. `Family`
holds what SD-like families share; a family module overrides the rest.
"""

from __future__ import annotations

import re

import torch
from pydantic import ValidationError

from difftune.config import Config, ModelConfig
from difftune.errors import DifftuneError
from difftune.families.common.conditioning import Conditioning
from difftune.families.common.control import ControlNets, InputControl
from difftune.families.common.drawing import Drawing
from difftune.families.common.layouts import Layout
from difftune.families.common.loading import FamilyOptions, Loading
from difftune.families.common.objective import DDPM, Objective
from difftune.families.common.targets import AdapterTargets
from difftune.memory.offload import spread
from difftune.models.components import Components

# A UNet block's name, wherever the UNet sits (peft and compile may wrap it): `down_blocks.1`, `mid_block`,
# `up_blocks.0.attentions.2`, `down_blocks.0.resnets.1`...
UNET_BLOCK = re.compile(r"(?:^|\.)((?:down_blocks\.\d+|up_blocks\.\d+|mid_block)(?:\.(?:attentions|resnets)\.\d+)?)$")
UNET_TOP_BLOCK = re.compile(r"(?:^|\.)(?:down_blocks\.\d+|mid_block|up_blocks\.\d+)$")
ROLES = ("loading", "conditioning", "drawing", "targets")  # the roles a family holds that read it back (role.py)


class Family:
    name: str
    description: str
    pipeline_class: type
    pipeline_classes: tuple[str, ...]  # model_index.json `_class_name`s this family reads
    denoiser_class: type  # where a single file holds the denoiser alone (`pipeline_around_denoiser_file`)
    denoiser_name = "unet"  # its pipeline argument and its prefix in diffusers' LoRA files
    text_encoder_names: tuple[str, ...] = ("text_encoder",)
    tokenizer_names: tuple[str, ...] = ("tokenizer",)
    drawing_part_names: tuple[str, ...] = ()  # frozen pipeline parts drawing alone uses (`Components.drawing_parts`)
    # Frozen pipeline parts that encode a sample's pixels beside the autoencoder, where the base has them
    # (`Components.pixel_encoders`)
    pixel_encoder_names: tuple[str, ...] = ()
    pipeline_options: tuple[str, ...] = ()  # pipeline config values a reassembled pipeline keeps
    fixed_pipeline_arguments: dict = {}  # what every pipeline of the family is built with
    options_model: type[FamilyOptions] = FamilyOptions  # what `model.family_options` may set
    max_controls = 0  # control (source) images an edit pair may have: 0 for a text-to-image family
    # Its bases are edit models (the images in a control folder are always what they edit: FLUX.1 Kontext, the Qwen edit
    # models), not text-to-image bases that also read references (FLUX.3): scored on edits, and refused preference pairs
    edit_base = False
    reads_clips = False  # a video base: trains on clips (`frame_windows`) and images alike
    reads_sound = False  # a sound base: trains on sound files alone (`frame_windows` cuts them), draws sounds
    page_family: str | None = None  # the family whose page for the real model tells of this one too (`page`)
    # The inputs of its denoiser's input layer in its single files (`Layout.input_file_key`; none: any), where the
    # families that read one file's keys differ in them: `auto` takes the file's
    file_inputs: tuple[int, ...] = ()
    layout: Layout  # its files in other tools' layouts (layouts.py)
    objective: Objective = DDPM()  # what training minimises (objective.py; flow.py's for the flow families)
    controlnet: ControlNets | None = None  # its ControlNet (control.py), where diffusers has one
    input_control: InputControl | None = None  # control images as input channels (control.py), where drawn so
    loading: Loading = Loading()  # a base read into `Components` (loading.py)
    conditioning: Conditioning = Conditioning()  # captions and controls into what the denoiser reads (conditioning.py)
    drawing: Drawing = Drawing()  # its samplers and pipeline, images and clips drawn (drawing.py)
    targets: AdapterTargets = AdapterTargets()  # which parts and modules an adapter goes on (targets.py)

    def __init__(self) -> None:
        # Each role its own copy bound to this family: a family that inherits its parent's role (FLUX.1 Kontext's
        # loading is FLUX.1's) reads its own names through it.
        for role in ROLES:
            setattr(self, role, getattr(self, role).held_by(self))

    @property
    def page(self) -> str:
        """The name of its page for the real model, `docs/families/<page>.md`: its own, or `page_family`'s (an
        image-to-video family's is its text-to-video family's)."""
        return self.page_family or self.name

    def options(self, config: ModelConfig) -> FamilyOptions:
        """`model.family_options` checked against the family's own `options_model`: each wrong or unknown setting
        named (those another family has are refused too: on this base they would do nothing)."""
        try:
            return self.options_model.model_validate(config.family_options)
        except ValidationError as err:
            known = ", ".join(self.options_model.model_fields) or "none"
            problems = [
                f"model.family_options.{'.'.join(map(str, error['loc']))}: "
                + (
                    f"not a setting of {self.description} bases (theirs: {known})"
                    if error["type"] == "extra_forbidden"
                    else f"{error['msg']} (got {error.get('input')!r})"
                )
                for error in err.errors()
            ]
            raise DifftuneError("\n".join(problems)) from None

    def denoiser_part(self, options: FamilyOptions) -> str:
        """The pipeline part that holds the denoiser this run trains: `denoiser_name`, unless the base has several
        (Wan 2.2's low-noise expert is `transformer_2`; its adapter files still say `transformer.`, as diffusers
        writes and loads them)."""
        return self.denoiser_name

    def check_config(self, config: Config) -> None:
        """Refuse settings this family cannot train with (a `DifftuneError` naming them all), before any work: a
        sampler it lacks would otherwise stop the run at its end-of-run samples."""
        problems = self.config_problems(config)
        if problems:
            raise DifftuneError(f"{config.model.base} is a {self.description} base: " + "; ".join(problems))

    def config_problems(self, config: Config) -> list[str]:
        """Every setting of `config` this family cannot train with, each named (what `check_config` refuses)."""
        problems = (
            self.objective.problems(config)
            + self.unsupported_settings(config)
            + self.targets.adapter_problems(config)
            + self.layout.problems(config)
            + self.drawing.sample_prompt_problems(
                config.sample.prompts, config.adapter.trains_controlnet or config.adapter.control_input
            )
        )
        try:
            self.drawing.sampler(config.sample.scheduler)
        except DifftuneError as err:
            problems.append(str(err))
        return problems

    def unsupported_settings(self, config: Config) -> list[str]:
        """What `check_config` refuses besides the objective's loss settings, the adapter, the sample prompts and the
        sampler: nothing, unless the family says otherwise."""
        return []

    # The denoiser.

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        """Channels of the latents the denoiser takes (unpacked, as the autoencoder makes them)."""
        return denoiser.config.in_channels

    def denoise(
        self,
        components: Components,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        conditioning: dict,
        geometry: torch.Tensor,
    ) -> torch.Tensor:
        """The denoiser's prediction for noisy latents (B, C, h, w). `geometry` (B, 6) holds each sample's
        (original height, width, crop top, left, target height, width) in pixels (`data.image_geometry`)."""
        raise NotImplementedError

    def planned_prediction(
        self,
        components: Components,
        noisy: torch.Tensor,
        timesteps: torch.Tensor,
        conditioning: dict,
        geometry: torch.Tensor,
    ) -> torch.Tensor:
        """What the memory plan runs forward and back as one training step's denoising: `denoise`, unless training runs
        more than it (LTX-2's sound stream beside the video's)."""
        return self.denoise(components, noisy, timesteps, conditioning, geometry)

    def control_residuals(
        self, components: Components, conditioning: dict, hidden_states: torch.Tensor, timestep: torch.Tensor, **inputs
    ) -> dict:
        """What a ControlNet adds to one call of the denoiser (`controlnet.residuals`, on the call's own inputs), or
        nothing where `conditioning` holds no control image."""
        control = conditioning.get("control")
        if control is None:
            return {}
        return self.controlnet.residuals(components.controlnet, control, hidden_states, timestep, **inputs)

    def monitored_blocks(self, denoiser: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """The blocks whose outputs `log.activations_every_steps` records, by their name in the denoiser: a UNet's
        down, mid and up blocks and the attention and resnet blocks inside them."""
        blocks = {}
        for name, module in denoiser.named_modules():
            match = UNET_BLOCK.search(name)
            if match:
                blocks[match.group(1)] = module
        return blocks

    def blocks_to_offload(self, denoiser: torch.nn.Module, count: int) -> list[torch.nn.Module]:
        """The `count` blocks `model.offload_blocks` keeps in host memory: spread evenly over `offloadable_blocks`."""
        blocks = self.offloadable_blocks(denoiser)
        if count > len(blocks):
            raise DifftuneError(
                f"model.offload_blocks = {count}, and this {type(denoiser).__name__} "
                f"has {len(blocks)} blocks: set at most {len(blocks)}"
            )
        return [blocks[index] for index in spread(count, len(blocks))] if count else []

    def offloadable_blocks(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """The blocks `model.offload_blocks` counts and keeps in host memory, in the order the denoiser
        holds them: a UNet's down blocks, up blocks and mid block."""
        return [module for name, module in denoiser.named_modules() if UNET_TOP_BLOCK.search(name)]
