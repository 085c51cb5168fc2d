"""Stable Diffusion XL inpainting (`diffusers/stable-diffusion-xl-1.0-inpainting-0.1`,
`StableDiffusionXLInpaintPipeline`): SDXL's UNet reading nine channels, as SD's inpainting UNet reads them
(common/inpainting.py's `UNetInpainting`). Everything else is SDXL's (sdxl): text, the size conditioning, objective,
files. What the inpainting families share (random masks, the masked image, samples from an image and its mask) is
common/inpainting.py.

- Samples: the pipeline starts from the image noised to its `strength` (0.9999 by default), as it draws for anyone.
- Single files: whole checkpoints in SDXL's layout, whose keys are SDXL's: `auto` tells them by the UNet's input layer
  (9 channels in; `file_inputs`).
"""

from __future__ import annotations

from diffusers import StableDiffusionXLControlNetInpaintPipeline, StableDiffusionXLInpaintPipeline

from difftune.families.common.control import UNetInpaintControlNet
from difftune.families.common.inpainting import InpaintConditioning, UNetInpainting
from difftune.families.sdxl import StableDiffusionXL, StableDiffusionXLConditioning


class StableDiffusionXLInpaintConditioning(InpaintConditioning, StableDiffusionXLConditioning):
    """SDXL's text; the mask and masked image from the view's pixels."""


class StableDiffusionXLInpaint(UNetInpainting, StableDiffusionXL):
    name = "sdxl_inpaint"
    page_family = "sdxl"
    conditioning = StableDiffusionXLInpaintConditioning()
    description = "Stable Diffusion XL inpainting"
    pipeline_class = StableDiffusionXLInpaintPipeline
    pipeline_classes = ("StableDiffusionXLInpaintPipeline",)
    controlnet = UNetInpaintControlNet(StableDiffusionXLControlNetInpaintPipeline)
    pipeline_options = ("force_zeros_for_empty_prompt", "requires_aesthetics_score")


FAMILY = StableDiffusionXLInpaint()
