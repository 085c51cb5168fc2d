"""FLUX.2 [klein] (`Flux2KleinPipeline`): FLUX.2 [dev]'s transformer, autoencoder, objective and files (flux2.py) at
smaller sizes, conditioned on a Qwen3 language model instead of Mistral.

- Text, exactly as `Flux2KleinPipeline.encode_prompt`: each caption goes through the tokenizer's chat template
  (thinking disabled, no system message), padded to the pipeline's 512 tokens (or the tokenizer's
  `model_max_length` where shorter, which difftune's samples then pass as `max_sequence_length`: the tiny base
  reads 48); the hidden states of layers `text_layers` are stacked along the width, all positions kept.
- References: as [dev]'s, at most `max_controls`.
- Samples that paint into an image (a sample prompt's `mask`) are drawn by `Flux2KleinInpaintPipeline` over the same
  parts: it blends the base's own drawing into the image, so a run's adapter paints there as it is.
- Guidance: klein's pipeline uses classifier-free guidance with an empty negative prompt (it takes no other) above
  a scale of 1, none for the step-distilled bases (`is_distilled`); a base with a guidance embedding is conditioned
  on `model.family_options.guidance` in training, as diffusers' FLUX.2 scripts do.
"""

from __future__ import annotations

import torch
from diffusers import Flux2KleinInpaintPipeline, Flux2KleinPipeline

from difftune.families.flux2 import Flux2, Flux2Conditioning, Flux2Drawing, Flux2Layout, text_tokens


class Flux2KleinLayout(Flux2Layout):
    """Flux2Klein's files in other tools' layouts."""

    kohya_model_version = "flux2_klein"


class Flux2KleinConditioning(Flux2Conditioning):
    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        tokenizer = tokenizers["tokenizer"]
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": caption}],
                tokenize=False,
                add_generation_prompt=True,
                enable_thinking=False,
            )
            for caption in captions
        ]
        ids = tokenizer(
            texts, padding="max_length", max_length=text_tokens(tokenizer), truncation=True, return_tensors="pt"
        ).input_ids
        return {"text_encoder": ids}


class Flux2KleinDrawing(Flux2Drawing):
    inpaint_pipeline_class = Flux2KleinInpaintPipeline  # a sample prompt's `mask`, its other controls references


class Flux2Klein(Flux2):
    name = "flux2_klein"
    page_family = "flux2"
    layout = Flux2KleinLayout()
    conditioning = Flux2KleinConditioning()
    drawing = Flux2KleinDrawing()
    description = "FLUX.2 [klein]"
    pipeline_class = Flux2KleinPipeline
    pipeline_classes = ("Flux2KleinPipeline",)
    pipeline_options = ("is_distilled",)
    text_layers = (9, 18, 27)  # the pipeline's default `text_encoder_out_layers`
    negative_prompt_refusal = "Flux2KleinPipeline guides with an empty negative prompt and takes no other"
    max_controls = 4  # BFL's most for [klein]


FAMILY = Flux2Klein()
