"""Qwen-Image-Edit: Qwen-Image's transformer taught to edit an image (`QwenImageEditPipeline`), trained on
(control, instruction, target) pairs. Everything but the control is Qwen-Image's (qwen_image.py): the transformer,
autoencoder, language model, objective and files.

- Prompts: the language model sees the control. The edit pipeline's chat template (its own system prompt, 64
  tokens, which the pipeline drops) frames the instruction, after the control's vision tokens; the processor
  (`Qwen2VLProcessor`, a second "tokenizer") turns the control into patches, and `tokenize` returns them beside the
  token ids, so the text cache keys an entry by what the language model saw. Targets without a control train with
  the same template and no image (what the pipeline would make of an empty image list).
- The transformer reads the control's latents (its posterior's mode, normalised, as the pipeline encodes the image
  it edits) as tokens after the noisy image's, placed by their own `img_shapes` entry; their prediction is dropped
  (`QwenImage.denoise`).
- Sizes: the pipelines resize every control to about 1 MP keeping its aspect ratio (multiples of 32,
  `calculate_dimensions`), whatever size they draw. Training resizes a control to its target's area instead
  (musubi-tuner's default, so 512 px runs cost 512 px controls), or to `control_resolution` squared, by that same
  rule; samples drawn at a set size follow the rule too. The pipelines take no argument for it, so `draw` sets
  the pipeline module's size for the call (`sized_controls`): without that, a 32 px base would edit 1 MP controls.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit_pipeline_module
from diffusers import QwenImageEditPipeline
from pydantic import Field
from transformers import Qwen2VLProcessor

from difftune.config import Config
from difftune.errors import DifftuneError
from difftune.families.common.flow import FlowDrawing, FlowOptions
from difftune.families.qwen_image import QwenImage, QwenImageConditioning
from difftune.models.processors import load_without_video_processor

# The edit pipelines' template (`prompt_template_encode` without the vision tokens, which `vision_prompt` places) and
# the number of its tokens before the instruction that they drop (tests/test_qwen_edit.py checks both).
EDIT_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new image "
    "that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
EDIT_TEMPLATE_TOKENS = 64
EDIT_TEXT_TOKENS = 1024  # the edit pipelines' `tokenizer_max_length`: vision tokens count, and they are many
VISION_TOKENS = (
    "<|vision_start|><|image_pad|><|vision_end|>"  # the processor widens `<|image_pad|>` to the image's patches
)

load_without_video_processor(Qwen2VLProcessor)


class EditOptions(FlowOptions):
    control_resolution: int = Field(
        0,
        ge=0,
        description="The side of the square whose area each control image is resized to, keeping its aspect "
        "ratio (multiples of 32), in training and in samples drawn at a set size. 0: the target's area (a sample's "
        "size). 1024 is what the Qwen-Image-Edit pipelines always do (about 1 MP), and musubi-tuner's advice.",
    )


def control_dimensions(area: int, size: tuple[int, int]) -> tuple[int, int]:
    """(width, height) of a `size` control resized to about `area` pixels: the pipelines' `calculate_dimensions`."""
    width, height, _ = edit_pipeline_module.calculate_dimensions(area, size[0] / size[1])
    return width, height


class QwenImageEditDrawing(FlowDrawing):
    needs_controls_to_draw = True  # its pipeline draws nothing without an image

    def image_arguments(self, controls: list, height: int | None, width: int | None) -> dict:
        return {"image": controls[0]}

    def draw(
        self,
        pipeline,
        options: EditOptions,
        prompt: str,
        controls: list,
        height: int | None,
        width: int | None,
        **arguments,
    ) -> list:
        area = options.control_resolution**2 or (height * width if height else 0)
        with self.family.sized_controls(area):
            return super().draw(pipeline, options, prompt, controls, height, width, **arguments)


class QwenImageEditConditioning(QwenImageConditioning):
    prompts_see_controls = True
    template_tokens = EDIT_TEMPLATE_TOKENS
    padded_text_tokens = EDIT_TEXT_TOKENS

    def encoder_tokenizers(self) -> list[tuple[str, str]]:
        return [("text_encoder", "tokenizer")]

    def control_size(self, target_size, control_size, options: EditOptions | None = None):
        options = options or EditOptions()
        return control_dimensions(options.control_resolution**2 or target_size[0] * target_size[1], control_size)

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict:
        """Token ids (padded to the fixed `template_tokens + padded_text_tokens`) and, for captions with controls (PIL,
        one
        list per caption; every caption of a call with controls of the same sizes), the processor's patches per caption
        (B, patches, D) and their grids (B, images, 3)."""
        controls = controls or [[] for _ in captions]
        images = [self.family.prompt_image(image) for images in controls for image in images]
        inputs = tokenizers["processor"](
            text=[
                self.family.prompt_template.format(self.family.vision_prompt(len(images)) + caption)
                for caption, images in zip(captions, controls, strict=True)
            ],
            images=images or None,
            padding="max_length",
            max_length=self.template_tokens + self.padded_text_tokens,
            return_tensors="pt",
        )
        ids = inputs["input_ids"]
        if ids.shape[1] > self.template_tokens + self.padded_text_tokens:
            raise DifftuneError(
                f"{captions[0]!r} and its control images make {ids.shape[1] - self.template_tokens} prompt "
                f"tokens; {self.family.description} reads at most {self.padded_text_tokens}: shorten it"
            )
        if not images:
            return {"text_encoder": ids}
        return {
            "text_encoder": ids,
            "pixel_values": inputs["pixel_values"].view(len(captions), -1, inputs["pixel_values"].shape[-1]),
            "image_grid_thw": inputs["image_grid_thw"].view(len(captions), -1, 3),
        }


class QwenImageEdit(QwenImage):
    name = "qwen_image_edit"
    description = "Qwen-Image-Edit"
    pipeline_class = QwenImageEditPipeline
    controlnet = None  # QwenImageControlNetPipeline draws text-to-image: no ControlNet reads an edit's references
    pipeline_classes = ("QwenImageEditPipeline",)
    tokenizer_names = ("tokenizer", "processor")  # the processor reads the control images for the language model
    options_model = EditOptions
    max_controls = 1  # QwenImageEditPipeline edits one image
    edit_base = True
    conditioning = QwenImageEditConditioning()
    drawing = QwenImageEditDrawing()
    prompt_template = EDIT_PROMPT_TEMPLATE

    def unsupported_settings(self, config: Config) -> list[str]:
        problems = super().unsupported_settings(config)
        if config.prior.num_class_images:
            problems.append(
                f"prior.num_class_images: {self.description} pipelines draw only edits of a control image; give "
                "prior.class_path a folder of class images (or pairs) instead"
            )
        return problems

    # Edit pairs.

    def vision_prompt(self, count: int) -> str:
        """What stands before the instruction for `count` control images: their vision tokens (one image here)."""
        return VISION_TOKENS if count else ""

    def prompt_image(self, control):
        """The image the language model sees of a control (PIL, at its training size): that same image."""
        return control

    # Sampling.

    def sized_controls(self, area: int):
        """A block in which the pipeline sizes controls to `area` pixels (0: its own 1 MP)."""
        return dimensions_for_the_call(edit_pipeline_module, area)


def dimensions_for_the_call(module, area: int):
    """A block in which a Qwen-Image pipeline module's `calculate_dimensions` (how it sizes the image it is given,
    whatever size it draws) sizes it to about `area` pixels, its aspect ratio kept; 0: as the pipeline does."""
    original = module.calculate_dimensions
    return (
        set_for_the_call(module, "calculate_dimensions", lambda _, ratio: original(area, ratio))
        if area
        else nullcontext()
    )


@contextmanager
def set_for_the_call(module, name: str, value):
    """`module.name` is `value` while the block runs."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


FAMILY = QwenImageEdit()
