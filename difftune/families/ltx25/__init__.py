"""LTX-2.5 text-to-video with sound (`LTX25ModularPipeline`, a diffusers modular pipeline: modular.py): LTX-2's
successor, trained as LTX-2 is (ltx2/). The same audio-video transformer class (`LTX2VideoTransformer3DModel`, in
LTX-2.5's configuration: gated attention, the caption's key/value modulation a fixed table per layer, no feed-forward
biases, a learned keyframe embedding the text-to-video pass leaves unused) over the latents of the same causal video
autoencoder (`AutoencoderKLLTX2Video`: 32x in space, 8x in time), read by Gemma 4's stacked hidden states through the
pipeline's text connectors. Trained by flow matching (flow.py) on clips and images, each a one-frame clip.

- What is LTX-2's (see ltx2/): the caption read left-padded, every hidden state stacked, then the connectors (frozen,
  a text encoder here); the latents normalised as the pipeline reads them; video alone by default (the audio stream
  isolated, given one empty token, not trained); `model.family_options.sound` trains each clip's sound beside its
  frames (16 kHz log-mel spectrograms through the audio autoencoder, noised at the clip's level, the loss the video's
  plus the sound's, a silent clip's masked); the adapters on the video stream's layers (and with sound the audio
  stream's and the attention between them); files in diffusers' layout and in the original names (the kohya layout
  ComfyUI maps; single files of the transformer alone), read back through diffusers' readers of LTX-2's.
- What is LTX-2.5's own: the base is a modular pipeline (its `modular_model_index.json` names each part's files). The
  steps training never runs are left out: the prompt enhancer (a second Gemma 4 model that rewrites prompts) and the
  duration head (which picks a frame count where none is given; difftune always gives one), so neither is loaded.
  Samples are drawn through the pipeline's own blocks: its guiders (`LTX2Guidance`, classifier-free guidance at
  `sample.guidance_scale` for video and sound, the spatio-temporal and modality guidance off, as LTX-2's samples), and
  its decoder, LTX-2.5's diffusion decoder (`LTX2VideoDiffusionDecoderModel`: it draws the pixels from the latents,
  with noise of its own from the sample's generator), the vocoder drawing the sound beside each clip.
"""

from __future__ import annotations

import math

from diffusers import LTX2Guidance, LTX25ModularPipeline

from difftune.data.clips import Sound, SoundingClip
from difftune.families.common.drawing import ClipDrawing, one_call_each
from difftune.families.common.flow import FlowDrawing
from difftune.families.common.modular import ModularDrawing, ModularLoading, diffusers_warnings_silenced
from difftune.families.common.sound import SoundLoading
from difftune.families.ltx2 import FRAME_RATE, LTX2, LTX2Layout
from difftune.models.components import Components


class LTX25Layout(LTX2Layout):
    kohya_model_version = "ltx2.5"
    kohya_layout_name = "LTX-2.5"


class LTX25Loading(SoundLoading, ModularLoading):
    left_out_steps = ("prompt_enhancer", "duration")  # see the module's docstring


def shortest_clip(pipeline) -> int:
    """The fewest frames of a clip the pipeline's diffusion decoder draws: its last stage's neighbourhoods span
    `decoder_stage5_kernel` frames (LTX-2.5's: 11, so 17 frames, 8n + 1; one frame it refuses)."""
    kernel = pipeline.diffusion_decoder.config.decoder_stage5_kernel[0]
    ratio = pipeline.vae_temporal_compression_ratio
    return math.ceil((kernel - 1) / ratio) * ratio + 1


class LTX25Drawing(ClipDrawing, ModularDrawing, FlowDrawing):  # an image: a clip's first frame (ClipDrawing.draw)
    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """The pipeline's two guiders at this scale (video's and sound's), their other guidance off, at the frame rate
        training conditions on."""
        with diffusers_warnings_silenced():
            guiders = {name: LTX2Guidance(guidance_scale=guidance_scale) for name in ("guider", "audio_guider")}
        return guiders | {
            "negative_prompt": negative_prompt or "",
            "max_sequence_length": self.family.max_sequence_length(components),
            "frame_rate": FRAME_RATE,
        }

    def draw_clips(self, pipeline, prompt, controls, height, width, frames, **arguments) -> list[list]:
        """Each prompt's clip in a call of its own (the pipeline's text step takes one), with its generator, and with
        the sound its vocoder drew beside it; a clip shorter than the diffusion decoder draws (`shortest_clip`) at
        that length."""
        rate = pipeline.vocoder.config.output_sampling_rate
        frames = max(frames, shortest_clip(pipeline))
        clips = []
        for text, call in one_call_each(prompt, self.components_given(pipeline, arguments)):
            drawn = pipeline(
                prompt=text, height=height, width=width, num_frames=frames, output=["videos", "audio"], **call
            )
            sound = Sound(drawn["audio"][0].float().cpu().numpy(), rate)
            clips.append(SoundingClip(drawn["videos"][0], sound, call.get("frame_rate", FRAME_RATE)))
        return clips


class LTX25(LTX2):
    name = "ltx25"
    layout = LTX25Layout()
    loading = LTX25Loading()
    drawing = LTX25Drawing()
    description = "LTX-2.5"
    pipeline_class = LTX25ModularPipeline
    pipeline_classes = ("LTX25ModularPipeline",)
    # The pipeline draws sound beside every clip, and its pixels by the diffusion decoder.
    drawing_part_names = ("audio_vae", "vocoder", "diffusion_decoder")


FAMILY = LTX25()
