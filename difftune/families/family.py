"""What a model family is to the rest of difftune: the one place that knows SD from SDXL (and what comes next).

A family names its pipeline class and its parts (the denoiser and the text encoders, by the names diffusers'
pipelines and LoRA files use), and does what differs between families: loading, tokenizing and encoding
prompts, calling the denoiser with its conditioning, its kohya key prefixes and its single-file layout. The
loop, data, caches, checkpoints, export, eval and UI ask it and never branch on which it is. `Family` holds
what SD-like families share; a family module overrides the rest.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import init_empty_weights
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
)
from pydantic import ValidationError

from difftune.config import Config, ModelConfig, Section
from difftune.data.clips import FrameWindows
from difftune.errors import DifftuneError
from difftune.families.objective import DDPM, Objective
from difftune.models import single_file
from difftune.models.autoencoders import LatentNormalization, frames_per_latent, latent_normalization
from difftune.models.denoiser_files import (
    DENOISER_FILE_PREFIXES,
    DenoiserFile,
    is_gguf,
    load_denoiser_file,
    load_gguf_file,
    read_denoiser_file,
)
from difftune.models.parts import (
    AS_STORED,
    FP32_PARTS,
    SINGLE_FILE_SUFFIXES,
    Components,
    PartDtypes,
    files_dtype,
    tokenize,
)

# A UNet block's name, wherever the UNet sits (peft and compile may wrap it): `down_blocks.1`, `mid_block`,
# `up_blocks.0.attentions.2`, `down_blocks.0.resnets.1`...
UNET_BLOCK = re.compile(r"(?:^|\.)((?:down_blocks\.\d+|up_blocks\.\d+|mid_block)(?:\.(?:attentions|resnets)\.\d+)?)$")
UNET_TOP_BLOCK = re.compile(r"(?:^|\.)(?:down_blocks\.\d+|mid_block|up_blocks\.\d+)$")
SAMPLERS = {
    "ddim": DDIMScheduler,
    "euler": EulerDiscreteScheduler,
    "euler_a": EulerAncestralDiscreteScheduler,
    "dpmpp_2m": DPMSolverMultistepScheduler,
}


def config_folder(config: ModelConfig) -> str:
    """Where `config.base`'s configs are: its own folder or hub id, a single file's `single_file_config`."""
    return config.single_file_config if config.base.endswith(SINGLE_FILE_SUFFIXES) else config.base


def valid_token_states(states: torch.Tensor, mask: torch.Tensor, skip: int, length: int) -> dict[str, torch.Tensor]:
    """A language model's states (B, L, D) kept at each caption's valid tokens (`mask`, (B, L)) after its first
    `skip` (a template's), at most `length` of them, zero-padded to `length`; with the mask of those kept."""
    kept_states = states.new_zeros(len(states), length, states.shape[-1])
    text_mask = torch.zeros(len(states), length, dtype=torch.long, device=states.device)
    for i in range(len(states)):
        kept = states[i][mask[i]][skip:][:length]
        kept_states[i, : len(kept)] = kept
        text_mask[i, : len(kept)] = 1
    return {"encoder_hidden_states": kept_states, "text_mask": text_mask}


def trimmed(conditioning: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One caption's `valid_token_states` without the padding past its text, as the text cache stores it: at full
    length (512 x 3584 fp32 for Qwen-Image) an entry is 7 MB, a short caption's ~0.3 MB."""
    valid = int(conditioning["text_mask"].sum())
    return {name: tensor[:valid] for name, tensor in conditioning.items()}


def padded(stored: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """Inverse of `trimmed`."""
    return {
        name: F.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, length - len(tensor))) for name, tensor in stored.items()
    }


class FamilyOptions(Section):
    """A family's own settings (`model.family_options`); a family with some declares them in a subclass."""


class Family:
    name: str
    description: str
    pipeline_class: type
    pipeline_classes: tuple[str, ...]  # model_index.json `_class_name`s this family reads
    denoiser_class: type  # where a single file holds the denoiser alone (`pipeline_around_denoiser_file`)
    single_file_layout: str | None = None  # what its single files (read and written) hold; None: not read
    denoiser_file_key: str | None = None  # a key every denoiser-alone single file of the family has
    denoiser_name = "unet"  # its pipeline argument and its prefix in diffusers' LoRA files
    text_encoder_names: tuple[str, ...] = ("text_encoder",)
    tokenizer_names: tuple[str, ...] = ("tokenizer",)
    lora_text_encoders: tuple[str, ...] | None = None  # those its pipeline's LoRA loader reads adapters of (None: all)
    # Where its text states are a language model's at each caption's tokens, zero-padded to this length with their
    # `text_mask` (`valid_token_states`): the text cache keeps the caption's tokens alone and pads them back. None:
    # stored as encoded.
    padded_text_tokens: int | None = None
    drawing_part_names: tuple[
        str, ...
    ] = ()  # frozen pipeline parts that drawing alone uses (`Components.drawing_parts`)
    kohya_prefixes: dict[str, str]  # part -> key prefix in kohya / A1111 / ComfyUI files
    kohya_text_model_parts: tuple[str, ...] = (
        "text_encoder",
    )  # CLIP encoders: kohya names their modules `text_model_*`
    kohya_model_version: str  # kohya's `ss_base_model_version`, where one name covers the family's bases
    embedding_keys: tuple[str, ...] = ("emb_params",)  # per text encoder: its key in A1111 / ComfyUI embedding files
    default_targets: dict[str, list[str]]  # part -> modules that get an adapter unless the config lists others
    pipeline_options: tuple[str, ...] = ()  # pipeline config values a reassembled pipeline keeps
    fixed_pipeline_arguments: dict = {}  # what every pipeline of the family is built with
    default_sampler = "ddim"  # what `sample.scheduler = "auto"` means
    samplers = SAMPLERS  # sampler name -> scheduler class, built over the model's own schedule config
    options_model: type[FamilyOptions] = FamilyOptions  # what `model.family_options` may set
    trains_embeddings = False  # textual inversion is built for it (`adapter.kind = "embedding"`)
    max_controls = 0  # control (source) images an edit pair may have: 0 for a text-to-image family
    needs_controls_to_draw = False  # its pipeline draws only edits (a sample prompt without controls is refused)
    prompts_see_controls = False  # its text encoder reads an edit pair's controls (`tokenize` takes them)
    reads_clips = False  # a video base: trains on clips (`frame_windows`) and images alike
    objective: Objective = DDPM()  # what training minimises (objective.py; flow.py's for the flow families)
    placement_options: tuple[str, ...] = ()  # family options that say which part a file adapts (`denoiser_part`)

    # Detection and loading.

    def reads_single_file(self, keys: set[str]) -> bool:
        """Whether a single file with these keys is this family's: where its single files hold the denoiser alone,
        they have `denoiser_file_key` (ComfyUI's files may prefix it); families without single files read none (a
        diffusers folder of theirs is what to pass)."""
        return self.denoiser_file_key is not None and any(
            prefix + self.denoiser_file_key in keys for prefix in ("", *DENOISER_FILE_PREFIXES)
        )

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

    def load(self, config: ModelConfig, dtypes: PartDtypes = FP32_PARTS) -> Components:
        """Every part of `config.base` (a pipeline folder, hub id or single file) on the CPU, each in its `dtypes`
        (diffusers' per-part `dtype`)."""
        options = self.options(config)  # before the minutes a large base takes to load
        if config.base.endswith(SINGLE_FILE_SUFFIXES):
            if not Path(config.base).is_file():
                raise DifftuneError(f"model.base {config.base}: no such file")
            pipeline = self.single_file_pipeline(config, dtypes)
        else:
            pipeline = self.pipeline_class.from_pretrained(
                config.base,
                revision=config.revision or None,
                variant=config.variant or None,
                **self.fixed_pipeline_arguments,
                **self._loading_arguments(config, options, dtypes),
            )
        return self.components_of(pipeline, options)

    def _loading_arguments(self, config: ModelConfig, options: FamilyOptions, dtypes: PartDtypes) -> dict:
        part = self.denoiser_part(options)
        left_out = {} if dtypes.drawing_parts else dict.fromkeys(self.drawing_part_names_of(config))
        if dtypes.denoiser is None:
            return {part: None, **left_out, "dtype": {"default": dtypes.others, "vae": dtypes.vae}}
        return {
            **left_out,
            "dtype": {"default": dtypes.others, "vae": dtypes.vae, part: self._denoiser_dtype(config, part, dtypes)},
        }

    def drawing_part_names_of(self, config: ModelConfig) -> tuple[str, ...]:
        """The drawing parts (`drawing_part_names`) base `config` has."""
        return self.drawing_part_names

    def _denoiser_dtype(self, config: ModelConfig, part: str, dtypes: PartDtypes) -> torch.dtype:
        if dtypes.denoiser == AS_STORED:
            return files_dtype(config.base, part, config.variant) or dtypes.others
        return dtypes.denoiser

    def load_denoiser(self, config: ModelConfig, dtypes: PartDtypes) -> torch.nn.Module:
        """The denoiser alone (`denoiser_part` of a pipeline folder or hub id, or a file of the denoiser alone), in
        `dtypes.denoiser`."""
        part, part_class = self._denoiser_class(config)
        if config.base.endswith(SINGLE_FILE_SUFFIXES):
            return self.denoiser_of_file(config, part, dtypes)
        return part_class.from_pretrained(
            config.base,
            subfolder=part,
            revision=config.revision or None,
            variant=config.variant or None,
            dtype=self._denoiser_dtype(config, part, dtypes),
        )

    def empty_denoiser(self, config: ModelConfig) -> torch.nn.Module:
        """The denoiser built from its config alone, without weights (its shape: latent channels, blocks)."""
        part, part_class = self._denoiser_class(config)
        folder = config_folder(config)
        with init_empty_weights():
            return part_class.from_config(
                part_class.load_config(folder, subfolder=part, revision=config.revision or None)
            )

    def _denoiser_class(self, config: ModelConfig) -> tuple[str, type]:
        part = self.denoiser_part(self.options(config))
        library, class_name = self.pipeline_class.load_config(config_folder(config), revision=config.revision or None)[
            part
        ]
        return part, getattr(importlib.import_module(library), class_name)  # as the pipeline would load it

    def single_file_pipeline(self, config: ModelConfig, dtypes: PartDtypes = FP32_PARTS):
        """The pipeline of a single-file `config.base` (there, an existing file), through diffusers' reader, which
        takes one dtype for every part: the run's where its parts agree on one, else fp32."""
        agree = dtypes.vae == dtypes.others and dtypes.denoiser in (AS_STORED, None, dtypes.others)
        return self.pipeline_class.from_single_file(
            config.base,
            config=config.single_file_config or None,
            **self.fixed_pipeline_arguments,
            dtype=dtypes.others if agree else torch.float32,
        )

    def pipeline_around_denoiser_file(self, config: ModelConfig, dtypes: PartDtypes = FP32_PARTS):
        """For a single file that holds the denoiser alone (how ComfyUI ships the newer families: their text encoder
        and autoencoder are files of their own): the pipeline of `model.single_file_config` around the denoiser
        (`denoiser_of_file`), each part in its `dtypes` (None: left out). A family whose single files are so sets
        `single_file_pipeline = pipeline_around_denoiser_file`."""
        folder, revision = config.single_file_config, config.revision or None
        if not folder:
            raise DifftuneError(
                f"model.base {config.base}: a {self.description} single file holds the {self.denoiser_name} alone; set "
                f"model.single_file_config to a {self.description} diffusers folder or hub id for its text encoder, "
                "autoencoder and configs"
            )
        if not config.base.endswith((".safetensors", ".gguf")):
            raise DifftuneError(
                f"model.base {config.base}: read as .safetensors or .gguf only for {self.description}; convert the file"
            )
        part = self.denoiser_part(self.options(config))
        parts = {"dtype": {"default": dtypes.others, "vae": dtypes.vae}, part: None}
        if not dtypes.drawing_parts:
            parts |= dict.fromkeys(self.drawing_part_names_of(config))
        if dtypes.denoiser is not None:
            parts[part] = self.denoiser_of_file(config, part, dtypes)
        return self.pipeline_class.from_pretrained(folder, **parts, revision=revision, **self.fixed_pipeline_arguments)

    def denoiser_of_file(self, config: ModelConfig, part: str, dtypes: PartDtypes) -> torch.nn.Module:
        """The denoiser (`denoiser_class`, as `model.single_file_config` shapes it) of a file of it alone: a
        `.safetensors` file tensor by tensor, a GGUF file's blocks quantized (denoiser_files.py)."""
        denoiser_config = self.denoiser_class.load_config(
            config.single_file_config, subfolder=part, revision=config.revision or None
        )
        with init_empty_weights():
            denoiser = self.denoiser_class.from_config(denoiser_config)
        if is_gguf(config.base):
            return load_gguf_file(denoiser, config.base, self.diffusers_names, dtypes.others)
        return load_denoiser_file(denoiser, self.denoiser_file_weights(config.base), dtypes)

    @property
    def reads_denoiser_files(self) -> bool:
        """Its single files hold the denoiser alone and are read by difftune (`pipeline_around_denoiser_file`), which
        applies ComfyUI's per-tensor fp8 scales and reads GGUF files."""
        return type(self).single_file_pipeline is Family.pipeline_around_denoiser_file

    def denoiser_file_weights(self, path: str) -> DenoiserFile:
        """A denoiser-alone `.safetensors` file's tensors under diffusers' names (`diffusers_names`), as the file
        holds them, with each fp8 tensor's scale (denoiser_files.py)."""
        return read_denoiser_file(path, self.diffusers_names)

    def diffusers_names(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A denoiser file's tensors (ComfyUI's prefixes gone) under diffusers' names: as they are, unless the
        family's files have another layout. Only moves, splits, joins and reshapes (vectors): denoiser_files.py runs
        it over codes of the file's rows, never over its weights."""
        return weights

    def denoiser_part(self, options: FamilyOptions) -> str:
        """The pipeline part that holds the denoiser this run trains: `denoiser_name`, unless the base has several
        (Wan 2.2's low-noise expert is `transformer_2`; its adapter files still say `transformer.`, as diffusers
        writes and loads them)."""
        return self.denoiser_name

    def lora_loading_arguments(self, options: FamilyOptions) -> dict:
        """What the pipeline's `load_lora_weights` needs to put a file's denoiser adapter on `denoiser_part`."""
        return {}

    def components_of(self, pipeline, options: FamilyOptions) -> Components:
        return Components(
            family=self,
            denoiser=getattr(pipeline, self.denoiser_part(options)),
            vae=pipeline.vae,
            text_encoders={name: getattr(pipeline, name) for name in self.text_encoder_names},
            tokenizers={name: getattr(pipeline, name) for name in self.tokenizer_names},
            drawing_parts={name: getattr(pipeline, name) for name in self.drawing_part_names},
            noise_scheduler=self.objective.training_scheduler(pipeline.scheduler),
            pipeline_options={key: pipeline.config[key] for key in self.pipeline_options if key in pipeline.config},
            family_options=options,
        )

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
            + self.adapter_problems(config)
            + self.prompt_control_problems(config.sample.prompts)
        )
        try:
            self.sampler(config.sample.scheduler)
        except DifftuneError as err:
            problems.append(str(err))
        return problems

    def unsupported_settings(self, config: Config) -> list[str]:
        """What `check_config` refuses besides the objective's loss settings, the adapter, the sample prompts and the
        sampler: nothing, unless the family says otherwise."""
        return []

    def adapter_problems(self, config: Config) -> list[str]:
        """What `check_config` refuses of the adapter for any family: text-encoder adapters its pipeline's LoRA
        loader would drop, and textual inversion where it is not built."""
        problems = []
        if config.adapter.text_encoder and config.adapter.is_adapter and not self.adapted_text_encoders():
            problems.append(
                f"adapter.text_encoder: {self.pipeline_class.__name__}'s LoRA loader reads {self.denoiser_name} "
                "adapters alone (a text encoder adapter would be dropped where the file is used); set it to false, "
                'or fine-tune in full (adapter.kind = "none"), which saves the text encoder in the pipeline folder'
            )
        if config.adapter.kind == "embedding" and not self.trains_embeddings:
            problems.append(
                f'adapter.kind = "embedding": textual inversion is not built for {self.description}; train a LoRA'
            )
        return problems

    def sampler(self, name: str) -> type:
        """The scheduler class of sampler `name` (`auto`: the family's default)."""
        name = self.default_sampler if name == "auto" else name
        if name not in self.samplers:
            raise DifftuneError(
                f'sample.scheduler = "{name}": not a sampler for {self.description}; use auto or '
                f"{', '.join(self.samplers)}"
            )
        return self.samplers[name]

    def assemble_pipeline(self, components: Components, scheduler=None):
        """A text-to-image pipeline over the (possibly adapted) components."""
        return self.pipeline_class(
            **{self.denoiser_part(components.family_options): components.denoiser},
            vae=components.vae,
            **components.text_encoders,
            **components.tokenizers,
            **components.drawing_parts,
            scheduler=scheduler or components.noise_scheduler,
            **self.fixed_pipeline_arguments,
            **components.pipeline_options,
        )

    # Edit pairs.

    def check_controls(self, examples: list, key: str) -> None:
        """Refuse a data set whose pairs have more control images than this family reads (a `DifftuneError` naming
        one such image): a text-to-image base would train as if the controls were not there."""
        over = next((e for e in examples if len(e.control_paths) > self.max_controls), None)
        if over is None:
            return
        if not self.max_controls:
            raise DifftuneError(
                f"{key}: {over.path.name} has control images ({', '.join(str(c) for c in over.control_paths)}), "
                f"but {self.description} bases edit no image; train an edit base (FLUX.1 "
                "Kontext, Qwen-Image-Edit) on pairs, or move the control folder away"
            )
        raise DifftuneError(
            f"{key}: {over.path.name} has {len(over.control_paths)} control images; {self.description} bases read "
            f"at most {self.max_controls}"
        )

    def frame_windows(self, data, vae) -> FrameWindows | None:
        """How this family's data cuts clips into windows (`data`'s frame settings, lengths the autoencoder `vae`
        takes); None for an image family, whose data leaves clips out and reports them."""
        return FrameWindows.of(data, frames_per_latent(vae)) if self.reads_clips else None

    def control_size(
        self, target_size: tuple[int, int], control_size: tuple[int, int], options: FamilyOptions | None = None
    ) -> tuple[int, int]:
        """The (width, height) a control image of `control_size` trains at beside a target trained at `target_size`
        (under the base's `options`): the target's (as diffusers' Kontext training script pairs them), unless the
        family says otherwise."""
        return target_size

    def prompt_control_problems(self, prompts: list) -> list[str]:
        """The `sample.prompts` entries with more control images than this family reads (or none, where its pipeline
        draws only edits), each named."""
        problems = []
        for entry in prompts:
            controls = [] if isinstance(entry, str) else entry.controls
            text = entry if isinstance(entry, str) else entry.prompt
            if len(controls) > self.max_controls:
                problems.append(
                    f"sample.prompts: {text!r} has {len(controls)} control images; these bases read "
                    f"{'none (they edit no image)' if not self.max_controls else f'at most {self.max_controls}'}"
                )
            elif self.needs_controls_to_draw and not controls:
                problems.append(
                    f"sample.prompts: {text!r} has no control image; {self.description} pipelines draw only "
                    f'edits: write it as {{prompt = {text!r}, controls = ["image.png"]}}'
                )
        return problems

    def draw(
        self,
        pipeline,
        options: FamilyOptions,
        prompt: str | list[str],
        controls: list,
        height: int | None,
        width: int | None,
        **arguments,
    ) -> list:
        """The images the family's `pipeline` draws for `prompt` at `height` x `width` (None: the pipeline's default
        size) from an edit prompt's control images (PIL; none for a text-to-image prompt, at most `max_controls`:
        callers check `prompt_control_problems` first), under the base's `options`; `arguments`: the rest of the call
        (steps, guidance, generators)."""
        return pipeline(
            prompt=prompt,
            height=height,
            width=width,  # by name: an edit pipeline's first argument is the image
            **self.image_arguments(controls, height, width),
            **arguments,
        ).images

    def draw_clips(
        self,
        pipeline,
        prompt: str | list[str],
        controls: list,
        height: int | None,
        width: int | None,
        frames: int,
        **arguments,
    ) -> list[list]:
        """A video family's clips (each a list of PIL frames) of `frames` frames for `prompt` (from `controls`: an
        image-to-video base's first frame), as `draw` draws images; refused by an image family (callers check
        `reads_clips` first)."""
        raise DifftuneError(f"{self.description} bases draw images, not clips")

    def image_arguments(self, controls: list, height: int | None, width: int | None) -> dict:
        """`draw`'s arguments for the controls and size: none for a text-to-image family."""
        return {}

    # Prompts and the denoiser.

    def pixel_conditioning(self, components: Components, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the denoiser reads of a sample's own pixels (B, 3, [T,] H, W) besides its latents, by name (an
        image-to-video base's first frame, encoded as its pipeline encodes the image it animates): computed from the
        training view with the frozen autoencoder, cached beside its posterior, joined to the text conditioning.
        Nothing, for a base that reads text alone."""
        return {}

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        """Captions -> token ids per text encoder (name -> (B, L)), padded and truncated as its pipeline does; where
        `prompts_see_controls`, each caption's control images (a list of PIL images each) join them. Takes the
        tokenizers alone: data-loader workers call it."""
        return {encoder: tokenize(tokenizers[tokenizer], captions) for encoder, tokenizer in self.encoder_tokenizers()}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Token ids (on the encoders' device) -> the denoiser's text conditioning, by name; each tensor has the
        batch first. This is what the text cache stores."""
        raise NotImplementedError

    def cached_conditioning(self, conditioning: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One caption's conditioning (no batch axis) as the text cache stores it: as it is, unless the family can
        drop what `uncached_conditioning` restores (padding: `padded_text_tokens`)."""
        return trimmed(conditioning) if self.padded_text_tokens else conditioning

    def uncached_conditioning(self, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Inverse of `cached_conditioning`: a stored entry as `encode_prompts` made it."""
        return padded(stored, self.padded_text_tokens) if self.padded_text_tokens else stored

    def latent_normalization(self, vae) -> LatentNormalization:
        """How latents are normalised for the denoiser: as the autoencoder asks (autoencoders.py), unless the family's
        pipeline reads them otherwise."""
        return latent_normalization(vae)

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

    def monitored_blocks(self, denoiser: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """The blocks whose outputs `log.activations_every_steps` records, by their name in the denoiser: a UNet's
        down, mid and up blocks and the attention and resnet blocks inside them."""
        blocks = {}
        for name, module in denoiser.named_modules():
            match = UNET_BLOCK.search(name)
            if match:
                blocks[match.group(1)] = module
        return blocks

    def offloadable_blocks(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """The blocks `model.offload_blocks` counts and keeps in host memory, in the order the denoiser
        holds them: a UNet's down blocks, up blocks and mid block."""
        return [module for name, module in denoiser.named_modules() if UNET_TOP_BLOCK.search(name)]

    # Sampling.

    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """The pipeline call's guidance arguments (and anything else the family's pipelines need)."""
        return {"guidance_scale": guidance_scale, "negative_prompt": negative_prompt or None}

    # Files.

    def read_original_layout(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """An adapter file in the family's original layout that only diffusers' reader for the family converts (fused
        layers split, as other trainers write them), recognised by its keys alone: its tensors in diffusers' layout
        (`transformer.<module>.lora_A.weight`, ...), or None for any other file (the generic readers take it)."""
        return None

    def original_module_names(self, denoiser_modules: list[str]) -> dict[str, str]:
        """The denoiser's modules by their names in the original (non-diffusers) model, as kohya files may use them:
        a UNet's LDM/SGM names (none for a transformer: where its original layout fuses layers, `fused.py`'s table
        names them)."""
        return single_file.unet_ldm_module_names(denoiser_modules)

    def base_model_version(self, model: ModelConfig | None) -> str | None:
        """kohya's `ss_base_model_version` of adapters for `model` (None: unknown): the family's, where one version
        name covers all its bases."""
        return self.kohya_model_version

    def to_single_file(self, components: Components) -> dict[str, torch.Tensor]:
        """Every weight under the original (LDM / SGM) single-file keys that A1111, ComfyUI and
        `from_single_file` read; a family without a single-file layout (`single_file_layout` None) refuses."""
        raise DifftuneError(
            f"merge --single-file: no single-file layout is built for {self.description}; merge into a "
            "diffusers folder (without --single-file), which its pipeline loads"
        )

    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        """The modules of `part` (the loaded `model`) an adapter goes on unless the config lists others: the
        family's `default_targets`, unless its names depend on the model's size."""
        return self.default_targets[part]

    def encoder_tokenizers(self) -> list[tuple[str, str]]:
        """(text encoder, its tokenizer) names, in order."""
        return list(zip(self.text_encoder_names, self.tokenizer_names, strict=True))

    def adapted_text_encoders(self) -> tuple[str, ...]:
        """The text encoders `adapter.text_encoder` trains: the ones diffusers' LoRA loader of this family reads
        (`lora_text_encoders`)."""
        return self.text_encoder_names if self.lora_text_encoders is None else self.lora_text_encoders

    def fine_tuned_text_encoders(self) -> tuple[str, ...]:
        """The text encoders a full fine-tune trains with `adapter.text_encoder` (saved in the pipeline folder, which
        the family's pipeline loads whole): the adapted ones, or all of them where the LoRA loader reads the denoiser's
        adapters alone."""
        return self.adapted_text_encoders() or self.text_encoder_names

    def adapter_parts(self) -> tuple[str, ...]:
        """The parts an adapter file may hold: the denoiser and the adapted text encoders."""
        return (self.denoiser_name, *self.adapted_text_encoders())

    def parts(self) -> tuple[str, ...]:
        """Adapter parts: the denoiser, then the text encoders, as diffusers' LoRA files prefix their keys."""
        return (self.denoiser_name, *self.text_encoder_names)
