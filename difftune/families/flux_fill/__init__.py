"""FLUX.1 Fill (`FLUX.1-Fill-dev`, `FluxFillPipeline`): Flux.1's transformer reading, in each 2 x 2 patch's token
beside the noisy latents' 64 values, the masked image's latents (64) and the mask at full resolution (each 8 x 8
pixel block's 64 values, 256 per token): 384 inputs. Everything else is Flux.1's (flux): text, the guidance
embedding, objective, files. What the inpainting families share (random masks, the masked image, samples from an
image and its mask) is common/inpainting.py.

- The conditioning, as the pipeline packs it: the masked image's latents and the mask unfolded to 64 channels at the
  latents' size (the channel is the pixel's place in its 8 x 8 block) joined to the noisy latents along the channels
  before packing, which puts each one's 2 x 2 patch after the other's in the token, as the pipeline's concatenation
  of the packed parts does.
- Samples: the guidance embedding reads `sample.guidance_scale` (the pipeline's default is 30); the pipeline takes
  no negative prompt.
- Single files: the transformer alone in BFL's layout (`flux1-fill-dev.safetensors`), whose keys are Flux.1's: `auto`
  tells it by its input layer (384 inputs; `file_inputs`), with a Fill pipeline folder as `model.single_file_config`
  for the other parts.
"""

from __future__ import annotations

import torch
from diffusers import FluxFillPipeline

from difftune.families.common.flow import FlowDrawing
from difftune.families.common.inpainting import InpaintConditioning, InpaintDrawing, masked_image_latents
from difftune.families.flux import Flux, FluxConditioning
from difftune.models.components import Components


class FluxFillConditioning(InpaintConditioning, FluxConditioning):
    """Flux.1's text; the mask and masked image from the view's pixels."""


class FluxFillDrawing(InpaintDrawing, FlowDrawing):
    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """The scale is the guidance embedding's input; FluxFillPipeline has no negative prompt."""
        return {"max_sequence_length": self.family.max_sequence_length(components), "guidance_scale": guidance_scale}


class FluxFill(Flux):
    name = "flux_fill"
    page_family = "flux"
    conditioning = FluxFillConditioning()
    drawing = FluxFillDrawing()
    description = "FLUX.1 Fill inpainting"
    pipeline_class = FluxFillPipeline
    pipeline_classes = ("FluxFillPipeline",)
    file_inputs = (384,)
    controlnet = None  # diffusers' Flux ControlNets are FLUX.1 [dev]'s
    input_control = None  # its input channels are the mask's and the masked image's

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """The masked image's latents and the unfolded mask as more input channels (Flux's `input_control`)."""
        mask = conditioning["inpaint_mask"].float()
        b, _, h, w = noisy.shape
        factor = mask.shape[-1] // w  # the autoencoder's downsampling (it may be released: cached latents)
        mask = mask.view(b, h, factor, w, factor).permute(0, 2, 4, 1, 3).reshape(b, factor * factor, h, w)
        control = torch.cat([masked_image_latents(components, conditioning), mask], dim=1).to(noisy.dtype)
        return super().denoise(components, noisy, timesteps, conditioning | {"input_control": control}, geometry)


FAMILY = FluxFill()
