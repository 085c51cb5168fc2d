"""Stable Diffusion 1.x / 2.x inpainting (`stable-diffusion-inpainting`, `StableDiffusionInpaintPipeline`): SD's UNet
reading nine channels, the noisy latents, then the mask at the latents' size, then the masked image's latents
(4 + 1 + 4: common/inpainting.py's `UNetInpainting`, which SDXL's inpainting shares). Everything else is SD's
(sd): text, objective, files. What the inpainting families share (random masks, the masked image, samples from an
image and its mask) is common/inpainting.py.

- Single files: whole checkpoints in the LDM layout (`sd-v1-5-inpainting.safetensors`), whose keys are SD's: `auto`
  tells them by the UNet's input layer (9 channels in; `file_inputs`).
"""

from __future__ import annotations

from diffusers import StableDiffusionControlNetInpaintPipeline, StableDiffusionInpaintPipeline

from difftune.families.common.control import UNetInpaintControlNet
from difftune.families.common.inpainting import InpaintConditioning, UNetInpainting
from difftune.families.sd import StableDiffusion, StableDiffusionConditioning


class StableDiffusionInpaintConditioning(InpaintConditioning, StableDiffusionConditioning):
    """SD's text; the mask and masked image from the view's pixels."""


class StableDiffusionInpaint(UNetInpainting, StableDiffusion):
    name = "sd_inpaint"
    page_family = "sd"
    conditioning = StableDiffusionInpaintConditioning()
    description = "Stable Diffusion 1.x / 2.x inpainting"
    pipeline_class = StableDiffusionInpaintPipeline
    pipeline_classes = ("StableDiffusionInpaintPipeline",)
    controlnet = UNetInpaintControlNet(StableDiffusionControlNetInpaintPipeline)


FAMILY = StableDiffusionInpaint()
