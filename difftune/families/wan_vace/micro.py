"""Micro Wan VACE: Wan's micro parts, its transformer a `WanVACETransformer3DModel` whose VACE blocks (one per
`vace_layers` entry) read the control latents: the inactive and reactive clips' latents and the mask folded to the
latents' size (16 + 16 + the autoencoder's spatial factor squared channels, 96 at Wan's)."""

from diffusers import WanVACEPipeline, WanVACETransformer3DModel

from difftune.families.wan.micro import autoencoder, build_umt5_encoder, build_wan_scheduler
from difftune.toy.micro import MicroSizes
from difftune.toy.tiny import FLUX_LATENT_CHANNELS, T5_HIDDEN_SIZE, build_t5_tokenizer

__all__ = ["autoencoder", "pipeline"]


def pipeline(vae, sizes: MicroSizes):
    tokenizer = build_t5_tokenizer()
    heads, head_dim, layers = sizes.dit_heads, 16, sizes.dit_layers or 2
    transformer = WanVACETransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=FLUX_LATENT_CHANNELS,
        out_channels=FLUX_LATENT_CHANNELS,
        text_dim=T5_HIDDEN_SIZE,
        freq_dim=32,
        ffn_dim=2 * heads * head_dim,
        num_layers=layers,
        rope_max_seq_len=64,
        vace_layers=list(range(0, layers, 2)) if layers > 2 else [0, 1],  # every other block, as Wan's VACE 14B
        vace_in_channels=2 * FLUX_LATENT_CHANNELS + vae.config.scale_factor_spatial**2,
    )
    return WanVACEPipeline(
        vae=vae,
        text_encoder=build_umt5_encoder(len(tokenizer)),
        tokenizer=tokenizer,
        transformer=transformer,
        scheduler=build_wan_scheduler(),
    )
