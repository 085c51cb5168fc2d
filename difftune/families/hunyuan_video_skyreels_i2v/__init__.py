"""SkyReels V1 image-to-video (Skywork's `SkyReels-V1-Hunyuan-I2V`, `HunyuanSkyreelsImageToVideoPipeline`):
HunyuanVideo's transformer fine-tuned to read, beside the noisy clip, the latents of the image it animates. Everything
else is HunyuanVideo's (hunyuan_video): text, latents, the guidance embedding, files.

- The condition, as the pipeline's `prepare_latents` makes it from the image: the image encoded alone by the
  autoencoder, times its scaling factor, as the first latent frame of a clip of zeros; the transformer reads [noisy
  latents, condition] along the channels (16 + 16 = 32). In training the image is the training window's own first
  frame (flipped and cut with it), encoded by the same frozen autoencoder as the clip (`pixel_conditioning`) and cached
  beside its posterior. The pipeline draws the image's latents from its posterior; training takes the posterior's
  mode, as HunyuanVideo 1.5's image-to-video pipeline encodes its image. The loss covers every frame, the first too,
  as musubi-tuner's does.
- Guidance: the pipeline gives the guidance embedding `guidance_scale` x 1000 (1 by default, as the model was trained)
  and guides by a second pass with a negative prompt (`true_cfg_scale`, 6 by default). Samples give the embedding
  `model.family_options.guidance`, what training conditions it on, and `sample.guidance_scale` as the second pass's
  scale.
- Single files: the transformer alone in Tencent's layout (Kijai's `skyreels_hunyuan_i2v_bf16.safetensors`, whose
  keys are HunyuanVideo's: set `model.family = "hunyuan_video_skyreels_i2v"`), with `model.single_file_config` a
  HunyuanVideo pipeline folder: read at twice the latent channels in.
"""

from __future__ import annotations

import torch
from diffusers import HunyuanSkyreelsImageToVideoPipeline

from difftune.families.common.conditioning import first_frame, first_frame_clip
from difftune.families.common.drawing import ImageToVideoDrawing
from difftune.families.hunyuan_video import (
    HunyuanVideo,
    HunyuanVideoConditioning,
    HunyuanVideoDrawing,
    HunyuanVideoLayout,
    HunyuanVideoLoading,
)
from difftune.models.autoencoders import encode_posterior
from difftune.models.components import Components


class SkyReelsImageToVideoLayout(HunyuanVideoLayout):
    """HunyuanVideo's layouts (the same transformer class and blocks)."""

    kohya_model_version = "hunyuan_video_skyreels_i2v"


class SkyReelsImageToVideoLoading(HunyuanVideoLoading):
    def denoiser_file_config(self, config: dict) -> dict:
        """A HunyuanVideo folder's transformer, reading the image's latents beside the noisy ones."""
        return {**config, "in_channels": 2 * config["out_channels"]}


class SkyReelsImageToVideoConditioning(HunyuanVideoConditioning):
    def pixel_conditioning(self, components: Components, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The first frame encoded alone, to its posterior's mode (unnormalised, as the cache keeps posteriors):
        (B, C, 1, h, w)."""
        return {"first_frame_latents": encode_posterior(components.vae, first_frame(pixels))[0]}


class SkyReelsImageToVideoDrawing(ImageToVideoDrawing, HunyuanVideoDrawing):
    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """The embedding reads what training conditioned it on; the scale guides by the pipeline's second pass."""
        arguments = {
            "max_sequence_length": self.family.max_sequence_length(components),
            "guidance_scale": components.family_options.guidance,
            "true_cfg_scale": guidance_scale,
        }
        return arguments | ({"negative_prompt": negative_prompt or ""} if guidance_scale > 1 else {})


class SkyReelsImageToVideo(HunyuanVideo):
    name = "hunyuan_video_skyreels_i2v"
    page_family = "hunyuan_video"
    layout = SkyReelsImageToVideoLayout()
    loading = SkyReelsImageToVideoLoading()
    conditioning = SkyReelsImageToVideoConditioning()
    drawing = SkyReelsImageToVideoDrawing()
    description = "SkyReels V1 image-to-video"
    pipeline_class = HunyuanSkyreelsImageToVideoPipeline
    pipeline_classes = ("HunyuanSkyreelsImageToVideoPipeline",)

    def transformer_input(self, components: Components, clip: torch.Tensor, conditioning: dict) -> torch.Tensor:
        """The noisy clip, then the first frame's latents as the first latent frame of a clip of zeros."""
        return torch.cat([clip, first_frame_clip(components, clip, conditioning["first_frame_latents"])], dim=1)


FAMILY = SkyReelsImageToVideo()
