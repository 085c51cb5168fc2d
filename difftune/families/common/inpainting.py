"""What the inpainting families share (SD's `sd_inpaint`, SDXL's `sdxl_inpaint`, FLUX.1 Fill's `flux_fill`): bases
that read, beside the noisy latents, a mask and the latents of the image with the masked part blanked, and draw what
the mask covers.

- Training: each view gets its subject's mask where the data gives one (`data.masks`), else a random mask
  (data/inpaint_masks.py: rectangles, ellipses, brush strokes, now and then the whole image) drawn from its own
  pixels, so cached and encoded-each-step runs see the same one. The masked image is the view with the mask's pixels
  set to 0 (mid-grey in [-1, 1]), as the pipelines blank it for a binary mask, encoded by the frozen autoencoder to
  its posterior's mode and cached beside the view's posterior with the mask (`pixel_conditioning`). The loss covers
  the whole image, as diffusers' inpainting scripts' does, unless a subject's mask weights it (`data.masks`, with
  `data.unmasked_weight`).
- Samples: each sample prompt names its image and its mask (`{prompt = "...", controls = ["photo.png",
  "mask.png"]}`, or `controls = ["photo.png"], mask = "mask.png"`; white where the base draws), given to the pipeline
  as `image` and `mask_image`.
- ControlNets (SD's and SDXL's, control.py's `UNetInpaintControlNet`): a run with `adapter.kind = "controlnet"` on an
  inpainting base trains one beside the random masks, its samples naming the control image last
  (`controls = ["photo.png", "mask.png", "pose.png"]`), drawn by the family's ControlNet inpainting pipeline.
"""

from __future__ import annotations

import torch

from difftune.data.inpaint_masks import RECIPE, view_masks
from difftune.families.common.conditioning import Conditioning
from difftune.families.common.drawing import Drawing, images_each, mask_second
from difftune.models.autoencoders import encode_posterior
from difftune.models.components import Components


class InpaintConditioning(Conditioning):
    reads_masks = True

    def pixel_conditioning(
        self, components: Components, pixels: torch.Tensor, masks: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """The view's mask (B, 1, H, W; 1 where the base draws, kept as bytes) and its masked image's latents (its
        posterior's mode, unnormalised as the cache keeps posteriors). The mask is the subject's where the data gives
        one (`masks`, (B, 1, H, W) in [0, 1], as `data.masks` reads them; 0.5 and over is drawn), else drawn at random:
        a view whose mask is all ones has none."""
        drawn = view_masks(pixels)
        if masks is not None:
            given = (masks >= 0.5).to(drawn.dtype)
            has_subject = (given.flatten(1).amin(dim=1) < 1).view(-1, 1, 1, 1)
            drawn = torch.where(has_subject, given, drawn)
        masked = pixels * (drawn < 0.5)
        return {"inpaint_mask": drawn.to(torch.uint8), "masked_latents": encode_posterior(components.vae, masked)[0]}

    def latent_identity(self, components: Components) -> str:
        """Another mask recipe is another cache entry."""
        return f"{super().latent_identity(components)}+{RECIPE}"


def masked_image_latents(components: Components, conditioning: dict) -> torch.Tensor:
    """The masked image's latents, normalised as the noisy latents are (what both pipelines give their denoisers)."""
    return components.latent_normalization.apply(conditioning["masked_latents"].float())


class InpaintDrawing(Drawing):
    """Samples drawn by the family's inpaint pipeline, from the image and mask each sample prompt names."""

    needs_controls_to_draw = True
    control_names = ("image", "mask")

    def image_arguments(self, controls: list, height: int | None, width: int | None) -> dict:
        image, mask = controls
        return {"image": image, "mask_image": mask}

    def inpaint(self, pipeline, options, prompt, controls: list, mask, height, width, **arguments) -> list:
        """A prompt whose mask is named as such: drawn as one naming it as its second control."""
        return self.draw(pipeline, options, prompt, mask_second(controls, mask), height, width, **arguments)

    def sample_prompt_problems(self, prompts: list, controlled: bool = False) -> list[str]:
        """Every sample prompt names two images: the one it paints into, then the mask (white where it draws), as
        its controls or as its first control and its `mask`; where a ControlNet draws, its control image last."""
        pipelines_do = f"{self.family.description} pipelines paint into an image where its mask is white"
        if controlled:
            pipelines_do += ", as the ControlNet's control image says"
        as_controls = [
            entry.model_copy(update={"controls": mask_second(entry.controls, entry.mask), "mask": None})
            if not isinstance(entry, str) and entry.mask
            else entry
            for entry in prompts
        ]
        named = ("image.png", "mask.png", *(("control.png",) if controlled else ()))
        return images_each(as_controls, pipelines_do, named)


class UNetInpainting:
    """What SD's and SDXL's inpainting families add to their text-to-image family (listed before it): a UNet reading
    nine channels, the noisy latents, the mask resized to them by nearest neighbour (`interpolate`'s default, as their
    pipelines resize it: each latent pixel reads its block's top-left pixel), then the masked image's latents; samples
    drawn from an image and its mask."""

    drawing = InpaintDrawing()
    file_inputs = (9,)  # 4 + 1 + 4: what tells its single files from the text-to-image family's (4)

    def latent_channels(self, denoiser) -> int:
        """The latents it predicts: it reads five channels more."""
        return denoiser.config.out_channels

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        mask = torch.nn.functional.interpolate(conditioning["inpaint_mask"].float(), size=noisy.shape[-2:])
        inputs = torch.cat([noisy, mask, masked_image_latents(components, conditioning)], dim=1).to(noisy.dtype)
        return super().denoise(components, inputs, timesteps, conditioning, geometry)
