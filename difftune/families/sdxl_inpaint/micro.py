"""Micro Stable Diffusion XL inpainting: the micro SDXL's parts, its UNet reading nine channels (the noisy latents, the
mask, the masked image's latents)."""

from diffusers import UNet2DConditionModel

from difftune.families.sdxl import micro as text_to_image
from difftune.families.sdxl.micro import autoencoder
from difftune.families.sdxl_inpaint import StableDiffusionXLInpaint
from difftune.toy.micro import MicroSizes

__all__ = ["autoencoder", "pipeline"]


def pipeline(vae, sizes: MicroSizes):
    parts = text_to_image.pipeline(vae, sizes).components
    unet = UNet2DConditionModel.from_config(parts["unet"].config, in_channels=9)
    kept = {name: part for name, part in parts.items() if name not in ("image_encoder", "feature_extractor")}
    return StableDiffusionXLInpaint.pipeline_class(
        **kept | {"unet": unet}, force_zeros_for_empty_prompt=False, add_watermarker=False
    )
