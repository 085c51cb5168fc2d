"""Micro Wan image-to-video: Wan's, without a CLIP image encoder (as Wan 2.2's): the transformer reads the first
frame's latents and its mask beside the noisy ones; and Wan 2.1's kind (`wan21_pipeline`), whose transformer also reads
CLIP image states of the frame."""

from diffusers import WanImageToVideoPipeline
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

from difftune.families.wan.micro import autoencoder, build_umt5_encoder, build_wan_scheduler, build_wan_transformer
from difftune.toy.micro import MicroSizes
from difftune.toy.tiny import FLUX_LATENT_CHANNELS, build_t5_tokenizer

__all__ = ["autoencoder", "pipeline", "wan21_pipeline"]

CLIP_WIDTH = 32  # the micro CLIP vision model's states (Wan 2.1's ViT-H/14: 1280)


def pipeline(vae, sizes: MicroSizes, image_dim: int | None = None):
    tokenizer = build_t5_tokenizer()
    mask_channels = vae.config.scale_factor_temporal
    return WanImageToVideoPipeline(
        vae=vae,
        text_encoder=build_umt5_encoder(len(tokenizer)),
        tokenizer=tokenizer,
        scheduler=build_wan_scheduler(),
        transformer=build_wan_transformer(
            sizes.dit_layers or 2,
            sizes.dit_heads,
            in_channels=2 * FLUX_LATENT_CHANNELS + mask_channels,
            image_dim=image_dim,
        ),
    )


def wan21_pipeline(vae, sizes: MicroSizes):
    """Wan 2.1 image-to-video's kind: a CLIP vision model (patches of 8 px of a 32 px crop, 17 states) and its
    processor (the shorter side to 32, the center cut), whose second-to-last states the transformer reads."""
    encoder = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=CLIP_WIDTH,
            intermediate_size=2 * CLIP_WIDTH,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
    )
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    parts = pipeline(vae, sizes, image_dim=CLIP_WIDTH).components
    return WanImageToVideoPipeline(**parts | {"image_encoder": encoder, "image_processor": processor})
