"""Micro FLUX.1 Fill: the micro FLUX.1's parts with a guidance embedding (as Fill [dev]), its transformer reading
the noisy latents' 64 values, the masked image's 64 and the mask's 256 per token."""

from diffusers import FluxTransformer2DModel

from difftune.families.flux import micro as text_to_image
from difftune.families.flux.micro import autoencoder
from difftune.families.flux_fill import FluxFill
from difftune.toy.micro import MicroSizes

__all__ = ["autoencoder", "pipeline"]


def pipeline(vae, sizes: MicroSizes):
    # FluxPipeline's IP-Adapter parts (None) are not FluxFillPipeline's
    parts = text_to_image.pipeline(vae, sizes, guidance=True).components
    config = parts["transformer"].config
    mask_values = 4 * 2 ** (2 * (len(vae.config.block_out_channels) - 1))  # each 2x2 patch's pixels
    # As keywords: a config's settings left at their defaults (`out_channels`) are not read from a dict
    transformer = FluxTransformer2DModel.from_config(
        config, in_channels=2 * config.in_channels + mask_values, out_channels=config.in_channels
    )
    kept = {name: part for name, part in parts.items() if name not in ("image_encoder", "feature_extractor")}
    return FluxFill.pipeline_class(**kept | {"transformer": transformer})
