"""Kandinsky 5 text-to-video (`Kandinsky5T2VPipeline`): Kandinsky 5's transformer (kandinsky5.py) over HunyuanVideo's
causal video autoencoder, trained on clips (dataset.py cuts them into windows of frames) and images, each a one-frame
clip. What differs from the image models:

- Text: the pipeline's video prompt template, whose system prompt is 128 tokens (dropped as the image template's 40).
- Latents (B, 16, t, h, w) of HunyuanVideo's autoencoder (4x in time, 8x in space) times its `scaling_factor`; the
  Lite transformers read a conditioning clip beside the noisy one (`visual_cond`): an empty one and its zero mask in
  text-to-video, as the pipeline passes.
- The visual rotary embedding is scaled by the size (the pipeline's `_get_scale_factor`: (1, 2, 2) for 480p sides,
  else (1, 3.16, 3.16)); Pro's sparse attention ("nabla") takes the pipeline's own settings (`get_sparse_params`).
- Samples: clips of `sample.frames` frames (images: one-frame clips), at the size asked.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from diffusers import Kandinsky5T2VPipeline

from difftune.families.common.drawing import ClipDrawing
from difftune.families.kandinsky5 import Kandinsky5, Kandinsky5Conditioning, Kandinsky5Drawing, Kandinsky5Layout

# The pipeline's prompt template and the number of its tokens before the caption that it drops (`prompt_template`,
# `prompt_template_encode_start_idx`; tests/test_families.py checks them against it).
PROMPT_TEMPLATE = "\n".join(
    [
        "<|im_start|>system\nYou are a prompt engineer. Describe the video in detail.",
        "Describe how the camera moves or shakes, describe the zoom and view angle, whether it follows the objects.",
        "Describe the location of the video, main characters or objects and their action.",
        "Describe the dynamism of the video and presented actions.",
        "Name the visual style of the video: whether it is a professional footage, user generated content, some kind "
        "of animation, video game or scren content.",
        "Describe the visual effects, postprocessing and transitions if they are presented in the video.",
        "Pay attention to the order of key actions shown in the scene.<|im_end|>",
        "<|im_start|>user\n{}<|im_end|>",
    ]
)
TEMPLATE_TOKENS = 128


class Kandinsky5VideoLayout(Kandinsky5Layout):
    """Kandinsky 5 video's files: the image models' layouts (the same transformer class)."""

    kohya_model_version = "kandinsky5_video"


class Kandinsky5VideoDrawing(ClipDrawing, Kandinsky5Drawing):
    pass


class Kandinsky5VideoConditioning(Kandinsky5Conditioning):
    template_tokens = TEMPLATE_TOKENS


class Kandinsky5Video(Kandinsky5):
    name = "kandinsky5_video"
    layout = Kandinsky5VideoLayout()
    conditioning = Kandinsky5VideoConditioning()
    drawing = Kandinsky5VideoDrawing()
    description = "Kandinsky 5 video"
    pipeline_class = Kandinsky5T2VPipeline
    pipeline_classes = ("Kandinsky5T2VPipeline",)
    reads_clips = True
    prompt_template = PROMPT_TEMPLATE

    def rope_scale(self, height: int, width: int) -> tuple[float, float, float]:
        # The pipeline's own rule (a method that reads nothing of its pipeline).
        return Kandinsky5T2VPipeline._get_scale_factor(None, height, width)

    def sparse_attention(self, denoiser: torch.nn.Module, latents: torch.Tensor) -> dict | None:
        """The pipeline's settings for its transformer's attention over `latents` (B, t, h, w, C): None for regular
        attention (Lite), its sparse mask for "nabla" (Pro)."""
        pipeline = SimpleNamespace(transformer=denoiser, fast_sta_nabla=Kandinsky5T2VPipeline.fast_sta_nabla)
        return Kandinsky5T2VPipeline.get_sparse_params(pipeline, latents, latents.device)


FAMILY = Kandinsky5Video()
