"""Sana-Video (NVIDIA's, `SanaVideoPipeline`): Sana's linear-attention DiT in three dimensions
(`SanaVideoTransformer3DModel`: 1x2x2 patches with Wan's rotary positions) over Wan 2.1's causal video autoencoder,
conditioned on Gemma 2 as Sana is (sana.py), trained on clips (dataset.py cuts them into windows of frames) and images,
each a one-frame clip. What differs from Sana:

- Text: the pipeline's own complex human instruction (a video one: motion and time), read from its signature; the
  pipeline's example adds a motion score to the prompt (" motion score: 30."), which captions may carry as written.
- Latents: Wan's autoencoder's (B, 16, t, h, w), normalised per channel as `SanaVideoPipeline` un-normalises them
  (autoencoders.py); the transformer patches them 1x2x2 itself and reads the timestep as it is.
- Noise levels: the pipeline's sampler shifts every size by its `flow_shift` (8 for the 480p base); training draws with
  it, and samples are clips of `sample.frames` frames (images: one-frame clips) drawn by an Euler sampler at it.
- Files: Sana's (transformer adapters alone, which `SanaVideoPipeline.load_lora_weights` reads).
"""

from __future__ import annotations

import torch
from diffusers import SanaVideoPipeline, SanaVideoTransformer3DModel

from difftune.families.common.drawing import ClipDrawing
from difftune.families.sana import Sana, SanaDrawing, SanaLayout


class SanaVideoLayout(SanaLayout):
    """Sana-Video's files in other tools' layouts."""

    kohya_model_version = "sana_video"


class SanaVideoDrawing(ClipDrawing, SanaDrawing):
    frames_argument = "frames"


class SanaVideo(Sana):
    name = "sana_video"
    page_family = "sana"
    layout = SanaVideoLayout()
    drawing = SanaVideoDrawing()
    description = "Sana-Video"
    pipeline_class = SanaVideoPipeline
    pipeline_classes = ("SanaVideoPipeline",)
    denoiser_class = SanaVideoTransformer3DModel
    patch_size = 2  # a token is 2x2 latent pixels of a frame
    reads_clips = True

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_channels  # the transformer patches the latents itself

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """An image's latents (B, C, h, w) as one-frame clips; a clip's (B, C, T, h, w) as they are."""
        if noisy.dim() == 5:
            return super().denoise(components, noisy, timesteps, conditioning, geometry)
        return super().denoise(components, noisy[:, :, None], timesteps, conditioning, geometry)[:, :, 0]


FAMILY = SanaVideo()
