"""Micro Wan VACE: Wan's micro parts, its transformer a `WanVACETransformer3DModel` whose VACE blocks (one per
`vace_layers` entry) read the control latents: the inactive and reactive clips' latents and the mask folded to the
latents' size (16 + 16 + the autoencoder's spatial factor squared channels, 96 at Wan's)."""

from diffusers import WanVACEPipeline

from difftune.families.wan.micro import autoencoder, build_umt5_encoder, build_wan_scheduler, build_wan_transformer
from difftune.toy.micro import MicroSizes
from difftune.toy.tiny import FLUX_LATENT_CHANNELS, build_t5_tokenizer

__all__ = ["autoencoder", "pipeline"]


def pipeline(vae, sizes: MicroSizes):
    tokenizer = build_t5_tokenizer()
    layers = sizes.dit_layers or 2
    vace = {
        "vace_layers": list(range(0, layers, 2)) if layers > 2 else [0, 1],  # every other block, as Wan's VACE 14B
        "vace_in_channels": 2 * FLUX_LATENT_CHANNELS + vae.config.scale_factor_spatial**2,
    }
    transformer = build_wan_transformer(layers, sizes.dit_heads, vace=vace)  # drawn from the seed before the encoder
    return WanVACEPipeline(
        vae=vae,
        text_encoder=build_umt5_encoder(len(tokenizer)),
        tokenizer=tokenizer,
        transformer=transformer,
        scheduler=build_wan_scheduler(),
    )
