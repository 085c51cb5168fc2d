"""Wan image-to-video (`WanImageToVideoPipeline`): Wan's transformer reading, beside the noisy clip, the clip's first
frame as its pipeline gives it the image to animate. Everything else is Wan's (wan.py): text, files, experts.

- The condition, exactly as the pipeline's `prepare_latents` makes it from the image: the first frame followed by
  black frames, encoded by the autoencoder (its posterior's mode) and normalised per channel; and a mask of
  `scale_factor_temporal` channels, 1 over the first latent frame and 0 after. The transformer reads
  [noisy latents, mask, condition] along the channels (16 + 4 + 16 = 36 for Wan's). In training the first frame is the
  training window's own (flipped and cut with it), encoded with the same frozen autoencoder as the clip
  (`pixel_conditioning`): cached beside the clip's posterior, so a cached run trains as an uncached one. The loss covers
  every frame, the first too, as musubi-tuner's does.
- Wan 2.1 I2V also reads CLIP image states of the first frame (`image_encoder`, a pixel encoder:
  `Components.pixel_encoders`), made exactly as the pipeline's `encode_image` makes them from the image it animates:
  the frame as 8-bit pixels through the pipeline's CLIP processor, the encoder's second-to-last hidden state. They join
  the first frame's latents in `pixel_conditioning` (cached beside the clip's posterior), and the transformer reads them
  through its cross-attention's image key and value projections, which the default targets adapt too (musubi-tuner's
  `k_img`, `v_img`).
- Wan 2.2 I2V A14B: two experts (wan.py), switching at its `boundary_ratio` (0.9), and no image encoder. TI2V-5B's
  image-to-video mode (its first frame replaces the latents' own, with a time of 0 there) is refused by name for now:
  TI2V-5B trains as text-to-video (wan.py).
- Samples animate the image each prompt names: `{prompt = "...", controls = ["first_frame.png"]}`.
"""

from __future__ import annotations

import torch
from diffusers import WanImageToVideoPipeline

from difftune.errors import DifftuneError
from difftune.families.common.conditioning import processed_frames
from difftune.families.common.drawing import ImageToVideoDrawing
from difftune.families.wan import Wan, WanConditioning, WanDrawing, WanLoading, WanTargets
from difftune.models.autoencoders import encode_posterior
from difftune.models.components import Components

# The cross-attention's projections of CLIP image states, in a transformer that reads them (Wan 2.1 I2V's).
IMAGE_TARGETS = ["attn2.add_k_proj", "attn2.add_v_proj"]


def clip_image_states(components: Components, frames: torch.Tensor) -> torch.Tensor:
    """First frames (B, 3, H, W) in [-1, 1] read as `WanImageToVideoPipeline.encode_image` reads an image: as 8-bit
    pixels through its CLIP processor, then the image encoder's second-to-last hidden state (B, tokens, D)."""
    encoder = components.pixel_encoders["image_encoder"]
    inputs = processed_frames(components.tokenizers["image_processor"], frames, encoder)
    return encoder(pixel_values=inputs, output_hidden_states=True).hidden_states[-2]


class WanImageToVideoTargets(WanTargets):
    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        """Wan's targets, and where the transformer reads CLIP image states (Wan 2.1's), the cross-attention's image
        key and value projections."""
        targets = super().targets_of(part, model)
        return targets + IMAGE_TARGETS if model.config.image_dim is not None else targets


class WanImageToVideoLoading(WanLoading):
    def components_of(self, pipeline, options) -> Components:
        if pipeline.config.get("expand_timesteps"):
            raise DifftuneError(
                "Wan 2.2 TI2V-5B's image-to-video mode is not trained yet; train it as text-to-video "
                "(a WanPipeline folder of the same model)"
            )
        components = super().components_of(pipeline, options)
        if components.pixel_encoders:  # Wan 2.1's CLIP image encoder reads the frame through the pipeline's processor
            components.tokenizers["image_processor"] = pipeline.image_processor
        return components


class WanImageToVideoDrawing(ImageToVideoDrawing, WanDrawing):
    pass


class WanImageToVideoConditioning(WanConditioning):
    def pixel_conditioning(self, components: Components, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The first frame followed by black ones, as the pipeline's `prepare_latents`, encoded to its posterior's mode
        (unnormalised, as the cache keeps posteriors): (B, C, t, h, w); and, for a base with an image encoder, the
        frame's CLIP image states (B, tokens, D)."""
        clip = pixels if pixels.dim() == 5 else pixels[:, :, None]
        video = torch.cat([clip[:, :, :1], torch.zeros_like(clip[:, :, 1:])], dim=2)
        conditioning = {"first_frame_latents": encode_posterior(components.vae, video)[0]}
        if components.pixel_encoders.get("image_encoder") is not None:
            conditioning["image_embeds"] = clip_image_states(components, clip[:, :, 0])
        return conditioning


class WanImageToVideo(Wan):
    name = "wan_i2v"
    loading = WanImageToVideoLoading()
    conditioning = WanImageToVideoConditioning()
    drawing = WanImageToVideoDrawing()
    targets = WanImageToVideoTargets()
    page_family = "wan"
    description = "Wan 2.1 / 2.2 image-to-video"
    pipeline_class = WanImageToVideoPipeline
    pipeline_classes = ("WanImageToVideoPipeline",)
    pixel_encoder_names = ("image_encoder",)  # Wan 2.1's CLIP image encoder (Wan 2.2's bases have none)

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        condition = components.latent_normalization.apply(conditioning["first_frame_latents"].float())
        clip = noisy if noisy.dim() == 5 else noisy[:, :, None]
        mask_channels = components.denoiser.config.in_channels - 2 * clip.shape[1]  # the autoencoder's temporal factor
        mask = torch.zeros(clip.shape[0], mask_channels, *clip.shape[2:], device=clip.device, dtype=clip.dtype)
        mask[:, :, 0] = 1  # the first latent frame is given
        prediction = super().denoise(
            components, torch.cat([clip, mask, condition.to(clip.dtype)], dim=1), timesteps, conditioning, geometry
        )
        return prediction if noisy.dim() == 5 else prediction[:, :, 0]


FAMILY = WanImageToVideo()
