"""A family whose base is a diffusers modular pipeline (`ModularPipeline`: FLUX.3's `Flux3ModularPipeline`): the
loading and drawing roles such a family holds (`ModularLoading`, `ModularDrawing`).

A modular base names its parts in `modular_model_index.json`, each with where its files are (a subfolder of the
base, or of another repository); its other parts (scheduler, guider, image processor) are made from the blocks' own
specs. So a modular family is a family module like any other: it names its pipeline class (`pipeline_class`, whose
`default_blocks_name` gives its blocks) and, in its loading, the steps training never runs (`left_out_steps`: FLUX.3's
prompt upsampler, a second language model). `ModularLoading` loads the parts through the pipeline's component specs;
`ModularDrawing` assembles a pipeline over the (adapted) parts with `update_components` and draws through its blocks.
Files are written by the pipeline's own `save_pretrained` (a `modular_model_index.json` that points at the saved
folder).
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from pathlib import Path

from difftune.config import ModelConfig
from difftune.errors import DifftuneError
from difftune.families.common.drawing import Drawing, one_call_each
from difftune.families.common.loading import FamilyOptions, Loading, PartSource
from difftune.models.components import SINGLE_FILE_SUFFIXES, Components
from difftune.models.dtypes import FP32_PARTS, PartDtypes

MODULAR_INDEX = "modular_model_index.json"


@contextmanager
def diffusers_warnings_silenced():
    """diffusers' warnings while a modular pipeline is put together, silenced: each preview's pipeline would say that
    guiders are experimental and that its scheduler was made from config, at every sample of a run."""
    from diffusers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)


def without_step_bars(blocks) -> None:
    """Every nested loop's progress bar off (the pipeline's own `set_progress_bar_config` reaches its top blocks
    alone): difftune shows its own bar over the images drawn, as it does for the other families' pipelines."""
    for block in getattr(blocks, "sub_blocks", {}).values():
        if hasattr(block, "set_progress_bar_config"):
            block.set_progress_bar_config(disable=True)
        without_step_bars(block)


class ModularLoading(Loading):
    left_out_steps: tuple[str, ...] = ()  # the default blocks' steps difftune never runs (by their names)
    # The default blocks' workflow difftune trains and draws (`get_workflow`: MiniMax-H3's text-to-video, which loads
    # its own transformer alone of the two its bases hold); None: the blocks whole.
    workflow: str | None = None

    def modular_pipeline(self, folder: str | None = None, revision: str | None = None):
        """The family's modular pipeline over its blocks less `left_out_steps`, reading the component specs of
        `folder` (a base folder or hub id; None: none, every part to be given), no part loaded yet."""
        blocks = getattr(importlib.import_module("diffusers"), self.family.pipeline_class.default_blocks_name)()
        if self.workflow:
            blocks = blocks.get_workflow(self.workflow)
        for step in self.left_out_steps:
            blocks.sub_blocks.pop(step)
        without_step_bars(blocks)
        revision = {"revision": revision} if folder else {}
        with diffusers_warnings_silenced():
            return self.family.pipeline_class(blocks=blocks, pretrained_model_name_or_path=folder, **revision)

    def part_source(self, folder: str, part: str, revision: str | None) -> PartSource:
        """Where the modular base `folder` keeps `part`: as its component spec says (a subfolder of the base, or of
        another repository)."""
        spec = self.modular_pipeline(folder, revision).get_component_spec(part)
        if spec.pretrained_model_name_or_path is None:
            raise DifftuneError(f"model.base {folder}: its {MODULAR_INDEX} names no files for its {part}")
        return PartSource(spec.type_hint, spec.pretrained_model_name_or_path, spec.subfolder or "", spec.revision)

    def load(self, config: ModelConfig, dtypes: PartDtypes = FP32_PARTS) -> Components:
        options = self.family.options(config)  # before the minutes a large base takes to load
        if config.base.endswith(SINGLE_FILE_SUFFIXES):
            return self.components_of(self.single_file_pipeline(config, dtypes), options)
        arguments = self._loading_arguments(config, options, dtypes)
        return self.components_of(self._loaded(config, config.base, arguments), options)

    def pipeline_around_denoiser_file(self, config: ModelConfig, dtypes: PartDtypes = FP32_PARTS):
        """A single file of the denoiser alone inside the modular pipeline of `model.single_file_config`."""
        self.check_denoiser_file(config)
        options = self.family.options(config)
        part = self.family.denoiser_part(options)
        arguments = self._loading_arguments(config, options, dtypes) | {part: None}
        pipeline = self._loaded(config, config.single_file_config, arguments)
        if dtypes.denoiser is not None:
            pipeline.update_components(**{part: self.denoiser_of_file(config, part, dtypes)})
        return pipeline

    single_file_pipeline = pipeline_around_denoiser_file

    def _loaded(self, config: ModelConfig, folder: str, arguments: dict):
        """The modular pipeline of `folder` with every part its specs name loaded from them (each in `arguments`'
        `dtype` by name), but those `arguments` names as None (left out)."""
        pipeline = self.modular_pipeline(folder, config.revision or None)
        dtypes = arguments.pop("dtype")
        loaded = {}
        for name, spec in pipeline._component_specs.items():
            if spec.default_creation_method != "from_pretrained" or name in arguments:
                continue
            if spec.pretrained_model_name_or_path is None:
                raise DifftuneError(
                    f"model.base {folder}: its {MODULAR_INDEX} names no files for its {name}; is it a "
                    f"{self.family.description} base?"
                )
            variant = {"variant": config.variant} if config.variant else {}
            loaded[name] = spec.load(dtype=dtypes.get(name, dtypes["default"]), **variant)
        pipeline.update_components(**loaded)
        return pipeline

    def save_pipeline(self, pipeline, folder: Path) -> None:
        """Its `modular_model_index.json` pointing at `folder` (its parts' files are there: a copy or a move of the
        folder still loads them from where it is, as diffusers reads a local copy)."""
        pipeline.save_pretrained(str(folder), safe_serialization=True, overwrite_modular_index=True)

    def components_of(self, pipeline, options: FamilyOptions) -> Components:
        """As `Loading.components_of`; the parts the blocks make from their own specs (the scheduler), where the
        pipeline lacks them (a plan's parts built from configs), made so."""
        missing = [name for name in ("scheduler", *self.family.drawing_part_names) if not hasattr(pipeline, name)]
        if missing:
            defaults = self.modular_pipeline()
            for name in missing:
                setattr(pipeline, name, getattr(defaults, name))
        return super().components_of(pipeline, options)


class ModularDrawing(Drawing):
    def assemble_pipeline(self, components: Components, scheduler=None):
        pipeline = self.family.loading.modular_pipeline()
        with diffusers_warnings_silenced():
            pipeline.update_components(
                **self.denoiser_pipeline_parts(components),
                vae=components.vae,
                **components.text_encoders,
                **components.tokenizers,
                **components.drawing_parts,
                **components.pixel_encoders,
                scheduler=scheduler or components.noise_scheduler,
                **components.pipeline_options,
            )
        return pipeline

    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """Classifier-free guidance by the pipeline's guider (off at 1 and below), with its negative prompt."""
        from diffusers import ClassifierFreeGuidance

        with diffusers_warnings_silenced():
            arguments = {"guider": ClassifierFreeGuidance(guidance_scale=guidance_scale)}
        return arguments | ({"negative_prompt": negative_prompt or ""} if guidance_scale > 1 else {})

    def components_given(self, pipeline, arguments: dict) -> dict:
        """`arguments` less those that name one of the pipeline's components (the guider of a guidance scale), each
        of which replaces that component first."""
        parts = {name: arguments.pop(name) for name in list(arguments) if name in pipeline._component_specs}
        with diffusers_warnings_silenced():
            pipeline.update_components(**parts)
        return arguments

    def draw(self, pipeline, options, prompt, controls, height, width, **arguments) -> list:
        """Through the modular pipeline's blocks, one prompt a call (as its text step takes them), each prompt of a
        list with its own generator."""
        images = []
        for text, call in one_call_each(prompt, self.components_given(pipeline, arguments)):
            images += pipeline(
                prompt=text,
                height=height,
                width=width,
                **self.image_arguments(controls, height, width),
                **call,
                output="images",
            )
        return images
