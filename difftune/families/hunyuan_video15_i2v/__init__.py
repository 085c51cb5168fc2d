"""HunyuanVideo 1.5 image-to-video (`HunyuanVideo15ImageToVideoPipeline`): HunyuanVideo 1.5's transformer reading,
beside the noisy clip, the clip's first frame as its pipeline gives it the image to animate. Everything else is the
text-to-video family's (hunyuan_video15.py): text, latents, files.

- The condition, exactly as the pipeline's `prepare_cond_latents_and_mask` makes it from the image: the frame encoded
  alone by the autoencoder (its posterior's mode) times its scaling factor, as the first latent frame of a clip of
  zeros, and a one-channel mask, 1 over the first latent frame; the transformer reads [noisy latents, condition, mask]
  along the channels (32 + 32 + 1 = 65). In training the first frame is the training window's own (flipped and cut
  with it), encoded with the same frozen autoencoder as the clip (`pixel_conditioning`): cached beside the clip's
  posterior, so a cached run trains as an uncached one. The loss covers every frame, the first too, as
  musubi-tuner's does.
- SigLIP image states of the frame (`image_encoder`, a pixel encoder: `Components.pixel_encoders`), exactly as the
  pipeline's `encode_image` makes them: the frame as 8-bit pixels through its `feature_extractor`, the encoder's last
  hidden state (729 tokens for the published SigLIP). The transformer attends to them beside the text.
- Samples animate the image each prompt names: `{prompt = "...", controls = ["first_frame.png"]}`. The pipeline sizes
  its clip from the image (the nearest in aspect of its sizes of `target_size` squared pixels, 640 for 480p): the image
  is resized to the size asked and the target size set to it, so it draws that size (or the nearest of its sizes).
"""

from __future__ import annotations

import math

import torch
from diffusers import HunyuanVideo15ImageToVideoPipeline

from difftune.families.common.conditioning import first_frame, first_frame_clip, processed_frames
from difftune.families.common.drawing import ImageToVideoDrawing
from difftune.families.common.hunyuan_text import attributes_set
from difftune.families.common.loading import with_transformer_lora_loading
from difftune.families.hunyuan_video15 import (
    HunyuanVideo15,
    HunyuanVideo15Conditioning,
    HunyuanVideo15Drawing,
    HunyuanVideo15Layout,
    HunyuanVideo15Loading,
)
from difftune.models.autoencoders import encode_posterior
from difftune.models.components import Components


def siglip_image_states(components: Components, frames: torch.Tensor) -> torch.Tensor:
    """First frames (B, 3, H, W) in [-1, 1] read as `HunyuanVideo15ImageToVideoPipeline.encode_image` reads an image:
    as 8-bit pixels through its SigLIP processor, then the image encoder's last hidden state (B, tokens, D)."""
    encoder = components.pixel_encoders["image_encoder"]
    inputs = processed_frames(
        components.tokenizers["feature_extractor"], frames, encoder, do_resize=True, do_convert_rgb=True
    )
    return encoder(pixel_values=inputs).last_hidden_state


class HunyuanVideo15ImageToVideoLayout(HunyuanVideo15Layout):
    """The text-to-video model's layouts (the same transformer class)."""

    kohya_model_version = "hunyuan_video_1_5_i2v"


class HunyuanVideo15ImageToVideoLoading(HunyuanVideo15Loading):
    def components_of(self, pipeline, options) -> Components:
        components = super().components_of(pipeline, options)
        components.tokenizers["feature_extractor"] = pipeline.feature_extractor  # reads the frame for the encoder
        return components


class HunyuanVideo15ImageToVideoDrawing(ImageToVideoDrawing, HunyuanVideo15Drawing):
    def draw_clips(self, pipeline, prompt, controls, height, width, frames, guidance=None, **arguments) -> list[list]:
        """The pipeline takes no size: it sizes the clip from the image (see the module's docstring)."""
        image, sizing = controls[0], {}
        if height and width:
            image, sizing = image.resize((width, height)), {"target_size": round(math.sqrt(height * width))}
        with attributes_set(pipeline, guider=guidance, **sizing):
            return pipeline(image=image, prompt=prompt, num_frames=frames, output_type="pil", **arguments).frames


class HunyuanVideo15ImageToVideoConditioning(HunyuanVideo15Conditioning):
    def pixel_conditioning(self, components: Components, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The first frame encoded alone, to its posterior's mode (unnormalised, as the cache keeps posteriors):
        (B, C, 1, h, w); and its SigLIP image states (B, tokens, D)."""
        first = first_frame(pixels)
        return {
            "first_frame_latents": encode_posterior(components.vae, first)[0],
            "image_embeds": siglip_image_states(components, first[:, :, 0]),
        }


class HunyuanVideo15ImageToVideo(HunyuanVideo15):
    name = "hunyuan_video15_i2v"
    page_family = "hunyuan_video15"
    layout = HunyuanVideo15ImageToVideoLayout()
    loading = HunyuanVideo15ImageToVideoLoading()
    conditioning = HunyuanVideo15ImageToVideoConditioning()
    drawing = HunyuanVideo15ImageToVideoDrawing()
    description = "HunyuanVideo 1.5 image-to-video"
    pipeline_class = with_transformer_lora_loading(HunyuanVideo15ImageToVideoPipeline)
    pipeline_classes = ("HunyuanVideo15ImageToVideoPipeline",)
    pixel_encoder_names = ("image_encoder",)

    def conditions(self, components: Components, clip: torch.Tensor, conditioning: dict) -> dict[str, torch.Tensor]:
        """The first frame's latents as the first latent frame of a clip of zeros, its mask 1 there; the frame's
        image states."""
        condition = first_frame_clip(components, clip, conditioning["first_frame_latents"])
        mask = torch.zeros_like(clip[:, :1])
        mask[:, :, 0] = 1  # the first latent frame is given
        return {"clip": torch.cat([condition, mask], dim=1), "image_embeds": conditioning["image_embeds"]}


FAMILY = HunyuanVideo15ImageToVideo()
