"""Micro Qwen-Image-Edit-Plus (2509 / 2511): Qwen-Image-Edit's, with 2511's zero-conditioning time."""

from diffusers import QwenImageEditPlusPipeline

from difftune.toy.micro import MicroSizes, qwen_image
from difftune.toy.micro.qwen_image import autoencoder

__all__ = ["autoencoder", "pipeline"]


def pipeline(vae, sizes: MicroSizes):
    return qwen_image.pipeline(vae, sizes, edit_pipeline=QwenImageEditPlusPipeline)
