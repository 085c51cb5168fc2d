"""Micro Stable Diffusion inpainting: the micro SD's parts, its UNet reading nine channels (the noisy latents, the
mask, the masked image's latents)."""

from diffusers import UNet2DConditionModel

from difftune.families.sd import micro as text_to_image
from difftune.families.sd.micro import autoencoder
from difftune.families.sd_inpaint import StableDiffusionInpaint
from difftune.toy.micro import MicroSizes

__all__ = ["autoencoder", "pipeline"]


def pipeline(vae, sizes: MicroSizes):
    parts = text_to_image.pipeline(vae, sizes).components
    unet = UNet2DConditionModel.from_config(parts["unet"].config, in_channels=9)
    return StableDiffusionInpaint.pipeline_class(**parts | {"unet": unet})
