"""Micro SkyReels V1 image-to-video: the micro HunyuanVideo's parts, its transformer reading twice the latent channels
(the noisy clip's and the image's)."""

from diffusers import HunyuanVideoTransformer3DModel

from difftune.families.hunyuan_video import micro as text_to_video
from difftune.families.hunyuan_video.micro import autoencoder
from difftune.families.hunyuan_video_skyreels_i2v import SkyReelsImageToVideo
from difftune.toy.micro import MicroSizes

__all__ = ["autoencoder", "pipeline"]


def pipeline(vae, sizes: MicroSizes):
    parts = text_to_video.pipeline(vae, sizes).components
    config = parts["transformer"].config
    transformer = HunyuanVideoTransformer3DModel.from_config({**config, "in_channels": 2 * config.out_channels})
    return SkyReelsImageToVideo.pipeline_class(**parts | {"transformer": transformer})
