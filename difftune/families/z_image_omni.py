"""Z-Image Omni (`ZImageOmniPipeline`): Z-Image's DiT in its omni form, whose sequence holds the caption, the images
(references clean, the target noisy, each with its own time embedding) and a reference's SigLIP2 features; text-to-
image here, the family Z-Image's otherwise (z_image.py). Trained by flow matching (flow.py).

- Text, exactly as `ZImageOmniPipeline.encode_prompt` encodes a prompt without reference images: the caption in the
  chat turn "<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n" (the text Z-Image's chat template makes with
  thinking enabled, so tokenized as Z-Image's), the language model's second-to-last states at the valid tokens.
- The transformer is called as the pipeline calls it: each sample a list of its images (here the noisy target alone,
  noise mask 1) and a list of its caption's segments (here one), no SigLIP features; the time as 1 - sigma and the
  prediction negated, as Z-Image's.
- Its SigLIP2 vision model (`siglip`, `siglip_processor`) reads reference images alone: text-to-image training and
  sampling never run it, so it is never loaded (a merged folder has none: edit with the base's). Reference-image
  (edit) training is not built yet.
- Files: Z-Image's layouts (the kohya layout with q, k and v fused, the original single file); a single file of the
  omni transformer (it has `siglip_embedder`) is this family's, not Z-Image's.
"""

from __future__ import annotations

import torch
from diffusers import ZImageOmniPipeline

from difftune.families.targets import targets_in_blocks
from difftune.families.z_image import BLOCK_LISTS, TRANSFORMER_TARGETS, ZImage, ZImageLayout


class ZImageOmniLayout(ZImageLayout):
    """Z-Image Omni's files: Z-Image's layouts over the omni transformer."""

    omni = True

    kohya_model_version = "z_image_omni"

    kohya_layout_name = "Z-Image Omni"


class ZImageOmni(ZImage):
    name = "z_image_omni"
    layout = ZImageOmniLayout()
    description = "Z-Image Omni"
    pipeline_class = ZImageOmniPipeline
    pipeline_classes = ("ZImageOmniPipeline",)
    fixed_pipeline_arguments = {"siglip": None, "siglip_processor": None}  # reference images' encoder, never run

    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        """Z-Image's targets in the refiner and main blocks, by name: the SigLIP refiner's blocks have the same layers,
        and no text-to-image step runs them."""
        return targets_in_blocks(model, dict.fromkeys(BLOCK_LISTS, TRANSFORMER_TARGETS))

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """Each sample as the pipeline's omni call takes it: its images (the noisy target alone) and its caption's
        segments (one), without SigLIP features."""
        lengths = conditioning["text_mask"].bool().sum(dim=1).tolist()
        states = conditioning["encoder_hidden_states"]
        prediction = components.denoiser(
            [[latent] for latent in noisy.to(states.dtype).unsqueeze(2).unbind(0)],
            ((1000 - timesteps) / 1000).to(states.dtype),
            [[state[:length]] for state, length in zip(states, lengths, strict=True)],
            siglip_feats=[None] * len(noisy),
            image_noise_mask=[[1]] * len(noisy),
            return_dict=False,
        )[0]
        return -torch.stack(prediction).squeeze(2)
