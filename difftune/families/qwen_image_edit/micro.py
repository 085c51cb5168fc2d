"""Micro Qwen-Image-Edit: Qwen-Image's, its tokenizer showing images, in its edit pipeline."""

from diffusers import QwenImageEditPipeline

from difftune.families.qwen_image import micro as qwen_image
from difftune.families.qwen_image.micro import autoencoder
from difftune.toy.micro import MicroSizes

__all__ = ["autoencoder", "pipeline"]


def pipeline(vae, sizes: MicroSizes):
    return qwen_image.pipeline(vae, sizes, edit_pipeline=QwenImageEditPipeline)
