"""Micro HunyuanVideo 1.5 image-to-video: the text-to-video micro model's parts with a SigLIP vision model (patches of
8 px of a 32 px image, 16 states of width 16; the published one's 729 of 1152) and its processor, whose last states the
transformer reads beside the text."""

from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

from difftune.families.hunyuan_video15 import micro as text_to_video
from difftune.families.hunyuan_video15.micro import autoencoder
from difftune.families.hunyuan_video15_i2v import HunyuanVideo15ImageToVideo
from difftune.toy.micro import MicroSizes

__all__ = ["autoencoder", "pipeline"]

SIGLIP_WIDTH = 16  # the micro transformer's `image_embed_dim`


def pipeline(vae, sizes: MicroSizes):
    parts = text_to_video.pipeline(vae, sizes).components
    encoder = SiglipVisionModel(
        SiglipVisionConfig(
            hidden_size=SIGLIP_WIDTH,
            intermediate_size=2 * SIGLIP_WIDTH,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
    )
    processor = SiglipImageProcessor(size={"height": 32, "width": 32})
    return HunyuanVideo15ImageToVideo.pipeline_class(
        **parts | {"image_encoder": encoder, "feature_extractor": processor}
    )
