"""Micro Qwen-Image-Edit-Plus (2509 / 2511): Qwen-Image-Edit's, with 2511's zero-conditioning time."""

from diffusers import QwenImageEditPlusPipeline

from difftune.families.qwen_image import micro as qwen_image
from difftune.families.qwen_image.micro import autoencoder
from difftune.toy.micro import MicroSizes

__all__ = ["autoencoder", "pipeline"]


def pipeline(vae, sizes: MicroSizes):
    return qwen_image.pipeline(vae, sizes, edit_pipeline=QwenImageEditPlusPipeline)
