"""Micro Wan image-to-video: Wan's, without a CLIP image encoder (as Wan 2.2's): the transformer reads the first
frame's latents and its mask beside the noisy ones."""

from diffusers import WanImageToVideoPipeline

from difftune.toy.micro import MicroSizes
from difftune.toy.micro.wan import autoencoder
from difftune.toy.tiny import (
    FLUX_LATENT_CHANNELS,
    build_t5_tokenizer,
    build_umt5_encoder,
    build_wan_scheduler,
    build_wan_transformer,
)

__all__ = ["autoencoder", "pipeline"]


def pipeline(vae, sizes: MicroSizes):
    tokenizer = build_t5_tokenizer()
    mask_channels = vae.config.scale_factor_temporal
    return WanImageToVideoPipeline(
        vae=vae,
        text_encoder=build_umt5_encoder(len(tokenizer)),
        tokenizer=tokenizer,
        scheduler=build_wan_scheduler(),
        transformer=build_wan_transformer(
            sizes.dit_layers or 2, sizes.dit_heads, in_channels=2 * FLUX_LATENT_CHANNELS + mask_channels
        ),
    )
