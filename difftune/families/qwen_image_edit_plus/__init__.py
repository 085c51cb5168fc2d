"""Qwen-Image-Edit-Plus (Qwen-Image-Edit-2509 and 2511, `QwenImageEditPlusPipeline`): Qwen-Image-Edit reading
several control images. What differs from the first edit model (qwen_image_edit.py):

- Prompts name each control, "Picture 1: <vision tokens>Picture 2: ..." before the instruction, and the language
  model sees each at about 384 x 384 pixels (the pipeline's `CONDITION_IMAGE_SIZE`, aspect kept, multiples of 32),
  not at the size its latents are made.
- The transformer takes every control's tokens in turn after the image's. 2511 bases also modulate the control
  tokens at time 0 (`zero_cond_t` in the transformer's config), which the transformer does from `img_shapes` alone.
- The pipeline sizes the controls' latents by its module constant `VAE_IMAGE_SIZE`, which `sized_controls` sets.
"""

from __future__ import annotations

from contextlib import nullcontext

import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus_pipeline_module
from diffusers import QwenImageEditPlusPipeline
from diffusers.image_processor import VaeImageProcessor

from difftune.families.qwen_image_edit import (
    VISION_TOKENS,
    QwenImageEdit,
    QwenImageEditDrawing,
    control_dimensions,
    set_for_the_call,
)


class QwenImageEditPlusDrawing(QwenImageEditDrawing):
    def image_arguments(self, controls: list, height: int | None, width: int | None) -> dict:
        return {"image": controls}


class QwenImageEditPlus(QwenImageEdit):
    name = "qwen_image_edit_plus"
    page_family = "qwen_image_edit"
    description = "Qwen-Image-Edit-Plus (2509, 2511)"
    pipeline_class = QwenImageEditPlusPipeline
    pipeline_classes = ("QwenImageEditPlusPipeline",)
    max_controls = 3  # what Qwen-Image-Edit-2509 / 2511 were trained with
    drawing = QwenImageEditPlusDrawing()

    def vision_prompt(self, count: int) -> str:
        return "".join(f"Picture {i + 1}: {VISION_TOKENS}" for i in range(count))

    def prompt_image(self, control):
        """The control as the pipeline shows it to the language model: resized (`VaeImageProcessor.resize`) to
        about `CONDITION_IMAGE_SIZE` pixels."""
        width, height = control_dimensions(plus_pipeline_module.CONDITION_IMAGE_SIZE, control.size)
        return VaeImageProcessor().resize(control, height, width)

    def sized_controls(self, area: int):
        return set_for_the_call(plus_pipeline_module, "VAE_IMAGE_SIZE", area) if area else nullcontext()


FAMILY = QwenImageEditPlus()
