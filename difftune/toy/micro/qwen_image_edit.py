"""Micro Qwen-Image-Edit: Qwen-Image's, its tokenizer showing images, in its edit pipeline."""

from diffusers import QwenImageEditPipeline

from difftune.toy.micro import MicroSizes, qwen_image
from difftune.toy.micro.qwen_image import autoencoder

__all__ = ["autoencoder", "pipeline"]


def pipeline(vae, sizes: MicroSizes):
    return qwen_image.pipeline(vae, sizes, edit_pipeline=QwenImageEditPipeline)
