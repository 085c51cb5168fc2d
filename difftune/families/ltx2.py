"""LTX-2 text-to-video (`LTX2Pipeline`): Lightricks' audio-video DiT (`LTX2VideoTransformer3DModel`: 48 blocks, each a
video stream and an audio stream with self-attention, cross-attention to the caption, and attention between the two
streams) over the 128-channel latents of a causal video autoencoder (`AutoencoderKLLTX2Video`: 32x in space, 8x in
time), each latent pixel one token, conditioned on Gemma 3's states through the pipeline's text connectors. Trained by
flow matching (flow.py) on clips (dataset.py cuts them into windows of frames) and images, each a one-frame clip.

- Text, exactly as `LTX2Pipeline.encode_prompt`: the stripped caption left-padded to the 1024 tokens the pipeline
  reads (fewer where the tokenizer's `model_max_length` says so, passed to the pipeline as `max_sequence_length`),
  every one of Gemma 3's hidden states stacked per token, then the pipeline's `connectors` (`LTX2TextConnectors`,
  frozen: a text encoder here) into the video stream's caption states and their mask. The text
  cache keeps those (the connectors' learnable registers fill the padding, so every token read is kept).
- Latents (B, 128, t, h, w) as the pipeline decodes them: (encoded - the autoencoder's `latents_mean`) x its
  `scaling_factor` / `latents_std`. Time: the scheduler's timestep (0-1000), the prediction the flow velocity. The
  resolution shift counts a clip's tokens over all its frames, as the pipeline's `calculate_shift` does (flow.py).
- **Video alone; the audio stream kept out.** A run trains the video stream: the transformer runs with its modalities
  isolated (`isolate_modalities`: no attention between the streams), so the video prediction does not depend on the
  audio stream, which is given one empty token and whose output is not trained. This is what Lightricks' own trainer
  does with `with_audio = false` (its default: the audio modality disabled), and what musubi-tuner's `--ltx_mode video`
  does. The adapters go on the video stream's layers alone (`attn1`, `attn2`, `ff`), so the audio stream's own
  weights are unchanged and the pipeline still draws sound beside the adapted video. A clip's sound is not read yet
  (training it needs its log-mel spectrograms as the original model computes them, which diffusers does not ship, the
  audio autoencoder's latents cached, and a loss over both streams: docs/families/ltx2.md).
- Samples: clips of `sample.frames` frames (images: one-frame clips) at the size asked (a multiple of 32), at the
  pipeline's default 24 frames per second (the frame rate the video positions are conditioned on, in training too),
  guided by classifier-free guidance at `sample.guidance_scale` for video and audio alike; the pipeline's
  spatio-temporal and modality guidance and its rescaling are off (one pass per prompt and guidance side).
- Files: diffusers' layout (`transformer.`, what `LTX2Pipeline.load_lora_weights` reads). The kohya layout is the
  original model's names (`lora_unet_transformer_blocks_0_attn1_to_q`; outside the blocks `patchify_proj`,
  `adaln_single`...), the key ComfyUI maps for every weight of the model it loads; Lightricks' trainer's
  `diffusion_model.` files are read through diffusers' own reader of them. A single file is the transformer alone in
  the original layout (`model.diffusion_model.` of Lightricks' all-in-one file), read through diffusers' converter;
  the text encoder, connectors, autoencoders and vocoder come from `model.single_file_config`.
"""

from __future__ import annotations

import re

import torch
from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ltx2_lora_to_diffusers
from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

from difftune.families.conditioning import NO_TOKEN, padded_token_ids
from difftune.families.drawing import ClipDrawing
from difftune.families.flow import FlowMatchingFamily
from difftune.families.layouts import RenamedLayout
from difftune.families.loading import FamilyOptions
from difftune.families.targets import targets_in_blocks
from difftune.models.parts import Components

TEXT_TOKENS = 1024  # the pipeline's default `max_sequence_length`: Gemma 3 reads every caption left-padded to it
FRAME_RATE = 24.0  # the pipeline's default `frame_rate`: the rate its video positions are conditioned on
# The video stream's layers in each block (the audio stream's are `audio_attn1`, `audio_ff`, ...; the layers between
# the streams `audio_to_video_attn`, `video_to_audio_attn`): what a video run adapts.
VIDEO_TARGETS = [
    f"{attention}.{layer}" for attention in ("attn1", "attn2") for layer in ("to_q", "to_k", "to_v", "to_out.0")
] + ["ff.net.0.proj", "ff.net.2"]
# diffusers' module names -> the original model's (Lightricks', ComfyUI's), one name part for another: diffusers'
# converter (`convert_ltx2_transformer_to_diffusers`) renames these, and nothing else.
ORIGINAL_PARTS = {
    "proj_in": "patchify_proj",
    "audio_proj_in": "audio_patchify_proj",
    "time_embed": "adaln_single",
    "audio_time_embed": "audio_adaln_single",
    "av_cross_attn_video_scale_shift": "av_ca_video_scale_shift_adaln_single",
    "av_cross_attn_video_a2v_gate": "av_ca_a2v_gate_adaln_single",
    "av_cross_attn_audio_scale_shift": "av_ca_audio_scale_shift_adaln_single",
    "av_cross_attn_audio_v2a_gate": "av_ca_v2a_gate_adaln_single",
    "video_a2v_cross_attn_scale_shift_table": "scale_shift_table_a2v_ca_video",
    "audio_a2v_cross_attn_scale_shift_table": "scale_shift_table_a2v_ca_audio",
    "norm_q": "q_norm",
    "norm_k": "k_norm",
    "prompt_adaln": "prompt_adaln_single",  # LTX-2.3's
    "audio_prompt_adaln": "audio_prompt_adaln_single",
}
# Lightricks' trainer's and ComfyUI's adapter files: the original names after `diffusion_model.`.
ORIGINAL_ADAPTER_KEY = re.compile(r"^diffusion_model\.transformer_blocks\.\d+\.")


def text_tokens(tokenizer) -> int:
    """The caption length read: the pipeline's default, unless the tokenizer says less (a tiny base's), which
    difftune's samples then pass as `max_sequence_length`."""
    return min(TEXT_TOKENS, tokenizer.model_max_length)


def original_name(name: str) -> str:
    """A transformer module's or weight's name in the original model."""
    return ".".join(ORIGINAL_PARTS.get(part, part) for part in name.split("."))


class LTX2Layout(RenamedLayout):
    """LTX-2's files in other tools' layouts (see the module's docstring)."""

    kohya_prefixes = {"transformer": "lora_unet_"}
    kohya_text_model_parts = ()
    kohya_model_version = "ltx2"
    kohya_layout_name = "LTX-2"
    single_file_layout = "transformer alone (original layout)"
    # What diffusers' reader detects LTX-2 files by (`CHECKPOINT_KEY_NAMES["ltx2"]`), without its prefix.
    denoiser_file_key = "av_ca_a2v_gate_adaln_single.emb.timestep_embedder.linear_1.weight"

    def original_name(self, module: str) -> str | None:
        return original_name(module)

    def diffusers_names(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return convert_ltx2_transformer_to_diffusers(dict(weights)) if self.denoiser_file_key in weights else weights

    def to_single_file(self, components: Components) -> dict[str, torch.Tensor]:
        return {original_name(key): value.contiguous() for key, value in components.denoiser.state_dict().items()}

    def read_original_layout(self, tensors):
        """Lightricks' trainer's files (`diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight`), through
        diffusers' own reader of them."""
        if not any(ORIGINAL_ADAPTER_KEY.match(key) for key in tensors):
            return None
        return _convert_non_diffusers_ltx2_lora_to_diffusers(dict(tensors))


class LTX2(ClipDrawing, FlowMatchingFamily):
    name = "ltx2"
    layout = LTX2Layout()
    description = "LTX-2"
    pipeline_class = LTX2Pipeline
    pipeline_classes = ("LTX2Pipeline",)
    denoiser_class = LTX2VideoTransformer3DModel
    denoiser_name = "transformer"
    text_encoder_names = ("text_encoder", "connectors")  # the connectors turn Gemma 3's states into the caption's
    tokenizer_names = ("tokenizer",)
    drawing_part_names = ("audio_vae", "vocoder")  # the pipeline draws sound beside every clip
    block_lists = ("transformer_blocks",)
    default_targets = {"transformer": VIDEO_TARGETS}
    patch_size = 1  # each latent pixel a token (the transformers of LTX-2 all patch 1 x 1 x 1)
    options_model = FamilyOptions  # no guidance embedding: classifier-free guidance
    lora_text_encoders = ()  # the transformer's adapters alone (the connectors are frozen)
    reads_clips = True
    single_file_pipeline = FlowMatchingFamily.pipeline_around_denoiser_file

    def encoder_tokenizers(self) -> list[tuple[str, str]]:
        return [("text_encoder", "tokenizer"), ("connectors", "tokenizer")]

    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        """Each block's video-stream layers by full name (the audio stream's have the same names after `audio_`)."""
        return targets_in_blocks(model, {"transformer_blocks": VIDEO_TARGETS})

    # Prompts and the transformer.

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        """Each stripped caption's ids (with Gemma's start token), left-padded with -1 (no token's id) to the length
        the pipeline reads (`text_tokens`)."""
        length = text_tokens(tokenizers["tokenizer"])
        ids = tokenizers["tokenizer"]([caption.strip() for caption in captions], truncation=True, max_length=length)
        return {"text_encoder": padded_token_ids(ids["input_ids"], length, left=True)}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = token_ids["text_encoder"]
        mask = (ids != NO_TOKEN).long()
        tokenizer = components.tokenizers["tokenizer"]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        encoder = components.text_encoders["text_encoder"]
        states = encoder(input_ids=ids.masked_fill(mask == 0, pad), attention_mask=mask, output_hidden_states=True)
        stacked = torch.stack(states.hidden_states, dim=-1).flatten(2, 3).to(encoder.dtype)
        video, _, text_mask = components.text_encoders["connectors"](stacked, mask, padding_side="left")
        return {"encoder_hidden_states": video, "text_mask": text_mask}

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """An image's latents (B, C, h, w) as one-frame clips; a clip's (B, C, t, h, w) as the pipeline packs them,
        each latent pixel a token; the audio stream one empty token, isolated (see the module's docstring)."""
        denoiser = components.denoiser
        states = conditioning["encoder_hidden_states"]
        clip = (noisy if noisy.dim() == 5 else noisy[:, :, None]).to(states.dtype)
        config = denoiser.config
        frames, height, width = clip.shape[2:]
        grid = (frames // config.patch_size_t, height // config.patch_size, width // config.patch_size)  # in tokens
        tokens = LTX2Pipeline._pack_latents(clip, config.patch_size, config.patch_size_t)
        # The audio stream's caption states are the audio connector's width where the transformer projects none.
        audio_width = config.caption_channels if config.use_prompt_embeddings else config.audio_cross_attention_dim
        audio = states.new_zeros(len(clip), 1, config.audio_in_channels)
        time = timesteps.to(states.dtype)
        prediction = denoiser(
            hidden_states=tokens,
            audio_hidden_states=audio,
            encoder_hidden_states=states,
            audio_encoder_hidden_states=states.new_zeros(len(clip), 1, audio_width),
            timestep=time,
            sigma=time,
            encoder_attention_mask=conditioning["text_mask"],
            audio_encoder_attention_mask=torch.ones(len(clip), 1, device=states.device),
            num_frames=grid[0],
            height=grid[1],
            width=grid[2],
            fps=FRAME_RATE,
            audio_num_frames=1,
            isolate_modalities=True,
            use_cross_timestep=True,
            return_dict=False,
        )[0]
        unpacked = LTX2Pipeline._unpack_latents(prediction, *grid, config.patch_size, config.patch_size_t)
        return unpacked if noisy.dim() == 5 else unpacked[:, :, 0]

    # Sampling.

    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """Classifier-free guidance at this scale for video and audio, the pipeline's other guidance off (see the
        module's docstring), at the frame rate training conditions on."""
        return {
            "max_sequence_length": self.max_sequence_length(components),
            "frame_rate": FRAME_RATE,
            "guidance_scale": guidance_scale,
            "audio_guidance_scale": guidance_scale,
            "negative_prompt": negative_prompt or "",
            "stg_scale": 0.0,
            "audio_stg_scale": 0.0,
            "modality_scale": 1.0,
            "audio_modality_scale": 1.0,
            "guidance_rescale": 0.0,
            "audio_guidance_rescale": 0.0,
        }

    def max_sequence_length(self, components: Components) -> int:
        return text_tokens(components.tokenizers["tokenizer"])
