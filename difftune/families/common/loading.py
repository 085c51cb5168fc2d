"""A family's loading, a role it holds (`family.loading`): a base (a pipeline folder, a hub id, a single file or a
file of the denoiser alone) read into `Components`, each part in the dtype the run keeps it in, and the family's own
settings (`model.family_options`) checked first."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import init_empty_weights
from diffusers.loaders.lora_pipeline import CogView4LoraLoaderMixin

from difftune.config import ModelConfig, Section
from difftune.errors import DifftuneError
from difftune.families.common.role import Role
from difftune.models.autoencoders import downsampling, sampling_rate
from difftune.models.components import SINGLE_FILE_SUFFIXES, Components, files_dtype
from difftune.models.denoiser_files import (
    DenoiserFile,
    is_gguf,
    load_denoiser_file,
    load_gguf_file,
    read_denoiser_file,
)
from difftune.models.dtypes import AS_STORED, FP32_PARTS, PartDtypes


def config_folder(config: ModelConfig) -> str:
    """Where `config.base`'s configs are: its own folder or hub id, a single file's `single_file_config`."""
    return config.single_file_config if config.base.endswith(SINGLE_FILE_SUFFIXES) else config.base


def with_transformer_lora_loading(pipeline_class: type) -> type:
    """`pipeline_class` with diffusers' LoRA loading of a transformer-only pipeline (`load_lora_weights`, `fuse_lora`,
    `set_adapters`), for a diffusers pipeline that ships none (HunyuanImage 2.1's, HunyuanVideo 1.5's): CogView 4's
    mixin, whose conversions apply to CogView files alone, reads a `transformer.` file as the transformer's
    `load_lora_adapter` does. `save_pipeline` writes it as `pipeline_class`, the class other tools load."""
    return type(
        f"{pipeline_class.__name__}WithLora",
        (pipeline_class, CogView4LoraLoaderMixin),
        {"_lora_loadable_modules": ["transformer"], "__module__": __name__, "saved_as": pipeline_class.__name__},
    )


def part_class(library: str, class_name: str) -> type:
    """The class a `model_index.json` entry names, resolved as diffusers' loader resolves it: a library to import, or
    one of diffusers' pipeline modules (a part whose class lives beside its pipeline is indexed by that module's name,
    not a library's)."""
    from diffusers import pipelines

    module = getattr(pipelines, library) if hasattr(pipelines, library) else importlib.import_module(library)
    return getattr(module, class_name)


@dataclass(frozen=True)
class PartSource:
    """Where a pipeline keeps one part: its class, and the folder or hub id, subfolder and revision of its files."""

    part_class: type
    folder: str
    subfolder: str
    revision: str | None

    def config(self) -> dict:
        return self.part_class.load_config(self.folder, subfolder=self.subfolder, revision=self.revision)


class FamilyOptions(Section):
    """A family's own settings (`model.family_options`); a family with some declares them in a subclass."""


class Loading(Role):
    def load(self, config: ModelConfig, dtypes: PartDtypes = FP32_PARTS) -> Components:
        """Every part of `config.base` (a pipeline folder, hub id or single file) on the CPU, each in its `dtypes`
        (diffusers' per-part `dtype`)."""
        options = self.family.options(config)  # before the minutes a large base takes to load
        if config.base.endswith(SINGLE_FILE_SUFFIXES):
            if not Path(config.base).is_file():
                raise DifftuneError(f"model.base {config.base}: no such file")
            pipeline = self.single_file_pipeline(config, dtypes)
        else:
            pipeline = self.family.pipeline_class.from_pretrained(
                config.base,
                revision=config.revision or None,
                variant=config.variant or None,
                **self.family.fixed_pipeline_arguments,
                **self._loading_arguments(config, options, dtypes),
            )
        return self.components_of(pipeline, options)

    def _loading_arguments(self, config: ModelConfig, options: FamilyOptions, dtypes: PartDtypes) -> dict:
        part = self.family.denoiser_part(options)
        left_out = {} if dtypes.drawing_parts else dict.fromkeys(self.drawing_part_names_of(config))
        if dtypes.denoiser is None:
            return {part: None, **left_out, "dtype": {"default": dtypes.others, "vae": dtypes.vae}}
        return {
            **left_out,
            "dtype": {"default": dtypes.others, "vae": dtypes.vae, part: self._denoiser_dtype(config, part, dtypes)},
        }

    def drawing_part_names_of(self, config: ModelConfig) -> tuple[str, ...]:
        """The drawing parts (`drawing_part_names`) base `config` has."""
        return self.family.drawing_part_names

    def _denoiser_dtype(self, config: ModelConfig, part: str, dtypes: PartDtypes) -> torch.dtype:
        if dtypes.denoiser == AS_STORED:
            return files_dtype(config.base, part, config.variant) or dtypes.others
        return dtypes.denoiser

    def load_denoiser(self, config: ModelConfig, dtypes: PartDtypes) -> torch.nn.Module:
        """The denoiser alone (`denoiser_part` of a pipeline folder or hub id, or a file of the denoiser alone), in
        `dtypes.denoiser`."""
        return self.load_denoiser_part(config, self.family.denoiser_part(self.family.options(config)), dtypes)

    def load_denoiser_part(self, config: ModelConfig, part: str, dtypes: PartDtypes) -> torch.nn.Module:
        """The pipeline part `part` of a denoiser's kind, loaded as `load_denoiser` loads the denoiser."""
        if config.base.endswith(SINGLE_FILE_SUFFIXES):
            return self.denoiser_of_file(config, part, dtypes)
        source = self.part_source(config.base, part, config.revision or None)
        return source.part_class.from_pretrained(
            source.folder,
            subfolder=source.subfolder,
            revision=source.revision,
            variant=config.variant or None,
            dtype=self._denoiser_dtype(config, part, dtypes),
        )

    def empty_denoiser(self, config: ModelConfig) -> torch.nn.Module:
        """The denoiser built from its config alone, without weights (its shape: latent channels, blocks)."""
        return self.empty_denoiser_part(config, self.family.denoiser_part(self.family.options(config)))

    def empty_denoiser_part(self, config: ModelConfig, part: str) -> torch.nn.Module:
        source = self.part_source(config_folder(config), part, config.revision or None)
        with init_empty_weights():
            return source.part_class.from_config(source.config())

    def part_source(self, folder: str, part: str, revision: str | None) -> PartSource:
        """Where the pipeline folder (or hub id) `folder` keeps `part`: in its subfolder of that name, of the class
        its `model_index.json` names (as the pipeline would load it)."""
        library, class_name = self.family.pipeline_class.load_config(folder, revision=revision)[part]
        return PartSource(part_class(library, class_name), folder, part, revision)

    def single_file_pipeline(self, config: ModelConfig, dtypes: PartDtypes = FP32_PARTS):
        """The pipeline of a single-file `config.base` (there, an existing file), through diffusers' reader, which
        takes one dtype for every part: the run's where its parts agree on one, else fp32."""
        agree = dtypes.vae == dtypes.others and dtypes.denoiser in (AS_STORED, None, dtypes.others)
        return self.family.pipeline_class.from_single_file(
            config.base,
            config=config.single_file_config or None,
            **self.family.fixed_pipeline_arguments,
            dtype=dtypes.others if agree else torch.float32,
        )

    def pipeline_around_denoiser_file(self, config: ModelConfig, dtypes: PartDtypes = FP32_PARTS):
        """For a single file that holds the denoiser alone (how ComfyUI ships the newer families: their text encoder
        and autoencoder are files of their own): the pipeline of `model.single_file_config` around the denoiser
        (`denoiser_of_file`), each part in its `dtypes` (None: left out). A family whose single files are so sets
        `single_file_pipeline = pipeline_around_denoiser_file`."""
        self.check_denoiser_file(config)
        folder, revision = config.single_file_config, config.revision or None
        part = self.family.denoiser_part(self.family.options(config))
        parts = {"dtype": {"default": dtypes.others, "vae": dtypes.vae}, part: None}
        if not dtypes.drawing_parts:
            parts |= dict.fromkeys(self.drawing_part_names_of(config))
        if dtypes.denoiser is not None:
            parts[part] = self.denoiser_of_file(config, part, dtypes)
        return self.family.pipeline_class.from_pretrained(
            folder, **parts, revision=revision, **self.family.fixed_pipeline_arguments
        )

    def check_denoiser_file(self, config: ModelConfig) -> None:
        """Refuse a single file of the denoiser alone that cannot be read: one without `model.single_file_config` (its
        text encoder, autoencoder and configs come from there), or one neither .safetensors nor .gguf."""
        family = self.family
        if not config.single_file_config:
            raise DifftuneError(
                f"model.base {config.base}: a {family.description} single file holds the {family.denoiser_name} alone; "
                f"set model.single_file_config to a {family.description} diffusers folder or hub id for its text "
                "encoder, autoencoder and configs"
            )
        if not config.base.endswith((".safetensors", ".gguf")):
            raise DifftuneError(
                f"model.base {config.base}: read as .safetensors or .gguf only for {family.description}; convert the "
                "file"
            )

    def denoiser_of_file(self, config: ModelConfig, part: str, dtypes: PartDtypes) -> torch.nn.Module:
        """The denoiser (`denoiser_class`, as `model.single_file_config` shapes it) of a file of it alone: a
        `.safetensors` file tensor by tensor, a GGUF file's blocks quantized (denoiser_files.py)."""
        source = self.part_source(config.single_file_config, part, config.revision or None)
        with init_empty_weights():
            denoiser = self.family.denoiser_class.from_config(self.denoiser_file_config(source.config()))
        if is_gguf(config.base):
            return load_gguf_file(denoiser, config.base, self.family.layout.diffusers_names, dtypes.others)
        try:
            return load_denoiser_file(denoiser, self.denoiser_file_weights(config.base), dtypes)
        except RuntimeError as error:
            mismatch = next((line.strip() for line in str(error).splitlines() if "size mismatch" in line), None)
            if mismatch is None:
                raise
            raise DifftuneError(
                f"model.base {config.base}: does not fit the {self.family.description} {part} that "
                f"model.single_file_config {config.single_file_config} describes ({mismatch}): it is another variant "
                "of the model; set model.family to the family of that variant, or model.single_file_config to a "
                "folder of its own configs"
            ) from None

    def denoiser_file_config(self, config: dict) -> dict:
        """The denoiser's config a single file is read into, from `model.single_file_config`'s: as it is, unless a
        family's files are a variant of the folder's model (SkyReels' image-to-video transformer in a HunyuanVideo
        folder)."""
        return config

    @property
    def reads_denoiser_files(self) -> bool:
        """Its single files hold the denoiser alone and are read by difftune (`pipeline_around_denoiser_file`), which
        applies ComfyUI's per-tensor fp8 scales and reads GGUF files."""
        return type(self).single_file_pipeline is type(self).pipeline_around_denoiser_file

    def denoiser_file_weights(self, path: str) -> DenoiserFile:
        """A denoiser-alone `.safetensors` file's tensors under diffusers' names (`diffusers_names`), as the file
        holds them, with each fp8 tensor's scale (denoiser_files.py)."""
        return read_denoiser_file(path, self.family.layout.diffusers_names)

    def save_pipeline(self, pipeline, folder: Path) -> None:
        """A pipeline of the family written as a diffusers folder, safetensors, that `load` reads back; one given LoRA
        loading by `with_transformer_lora_loading` as the diffusers class it extends."""
        pipeline.save_pretrained(folder, safe_serialization=True)
        if saved_as := getattr(type(pipeline), "saved_as", None):
            index = Path(folder) / "model_index.json"
            index.write_text(json.dumps(json.loads(index.read_text()) | {"_class_name": saved_as}, indent=2) + "\n")

    def components_of(self, pipeline, options: FamilyOptions) -> Components:
        return Components(
            family=self.family,
            denoiser=getattr(pipeline, self.family.denoiser_part(options)),
            vae=pipeline.vae,
            text_encoders={name: getattr(pipeline, name) for name in self.family.text_encoder_names},
            tokenizers={name: getattr(pipeline, name) for name in self.family.tokenizer_names},
            drawing_parts={name: getattr(pipeline, name) for name in self.family.drawing_part_names},
            pixel_encoders={
                name: part
                for name in self.family.pixel_encoder_names
                if (part := getattr(pipeline, name, None)) is not None
            },
            noise_scheduler=self.family.objective.training_scheduler(pipeline.scheduler),
            pixels_per_latent=downsampling(pipeline.vae) if pipeline.vae is not None else 8,
            samples_per_second=sampling_rate(pipeline.vae),
            pipeline_options={
                key: pipeline.config[key] for key in self.family.pipeline_options if key in pipeline.config
            },
            family_options=options,
        )
