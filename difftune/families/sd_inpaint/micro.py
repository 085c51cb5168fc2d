"""Micro Stable Diffusion inpainting: the micro SD's parts, its UNet reading nine channels (the noisy latents, the
mask, the masked image's latents)."""

import torch
from diffusers import StableDiffusionPipeline, UNet2DConditionModel

from difftune.families.sd import micro as text_to_image
from difftune.families.sd.micro import autoencoder
from difftune.families.sd_inpaint import StableDiffusionInpaint
from difftune.toy.micro import MicroSizes

__all__ = ["autoencoder", "inpaint_pipeline_of", "pipeline"]


def pipeline(vae, sizes: MicroSizes):
    parts = text_to_image.pipeline(vae, sizes).components
    unet = UNet2DConditionModel.from_config(parts["unet"].config, in_channels=9)
    return StableDiffusionInpaint.pipeline_class(**parts | {"unet": unet})


def inpaint_pipeline_of(pipeline: StableDiffusionPipeline) -> StableDiffusionInpaint.pipeline_class:
    """SD inpainting of SD's components: the UNet's input layer widened to nine channels, the five new ones zero, so
    that it draws as before until trained to read them (as SD-inpainting was made from SD;
    scripts/make_tiny_inpaint_base.py)."""
    state = pipeline.unet.state_dict()
    weight = state["conv_in.weight"]
    state["conv_in.weight"] = torch.cat([weight, weight.new_zeros(weight.shape[0], 5, *weight.shape[2:])], dim=1)
    unet = UNet2DConditionModel.from_config(pipeline.unet.config, in_channels=9)
    unet.load_state_dict(state)
    return StableDiffusionInpaint.pipeline_class(**pipeline.components | {"unet": unet})
