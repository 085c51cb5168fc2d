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
- **Video alone, by default; the audio stream kept out.** A run trains the video stream: the transformer runs with its
  modalities isolated (`isolate_modalities`: no attention between the streams), so the video prediction does not
  depend on the audio stream, which is given one empty token and whose output is not trained. This is what Lightricks'
  own trainer does with `with_audio = false` (its default: the audio modality disabled), and what musubi-tuner's
  `--ltx_mode video` does. The adapters go on the video stream's layers alone (`attn1`, `attn2`, `ff`), so the audio
  stream's own weights are unchanged and the pipeline still draws sound beside the adapted video.
- **Sound and video** (`model.family_options.sound`, Lightricks' `with_audio = true`, musubi-tuner's `--ltx_mode av`):
  every clip's sound under its window (sound.py: 16 kHz stereo log-mel spectrograms as Lightricks' `AudioProcessor`
  computes them) is encoded by the audio autoencoder (its posterior's mode, packed and normalised as the pipeline
  reads `audio_latents`) into the latent cache beside the frames' posterior, with the clip's frame rate. The streams
  then run joined, as the pipeline runs them: the sound noised at the clip's noise level with its own noise, the
  video positioned at the clip's frame rate (so both streams' positions are in the clip's seconds), and the loss the
  video's mean error plus the sound's (Lightricks' trainer's `video_loss + audio_loss`). The adapters go on the audio
  stream's layers and the attention between the streams too. A run with sound needs the latent cache and a clip in
  every example (an image is refused by name); a clip without an audio stream trains its frames beside the
  sounding ones, its sound's loss masked; the validation loss counts the held-out clips' sound too.
- Samples: clips of `sample.frames` frames (images: one-frame clips) at the size asked (a multiple of 32), at the
  pipeline's default 24 frames per second (the frame rate the video positions are conditioned on, in training too),
  guided by classifier-free guidance at `sample.guidance_scale` for video and audio alike; the pipeline's
  spatio-temporal and modality guidance and its rescaling are off (one pass per prompt and guidance side). Each clip
  keeps the sound the pipeline drew beside it (its vocoder's waveform): the sample's mp4 carries it as an AAC track,
  the frames written at the 24 per second they were drawn for, so the two stay in step.
- Files: diffusers' layout (`transformer.`, what `LTX2Pipeline.load_lora_weights` reads). The kohya layout is the
  original model's names (`lora_unet_transformer_blocks_0_attn1_to_q`; outside the blocks `patchify_proj`,
  `adaln_single`...), the key ComfyUI maps for every weight of the model it loads; Lightricks' trainer's
  `diffusion_model.` files are read through diffusers' own reader of them. A single file is the transformer alone in
  the original layout (`model.diffusion_model.` of Lightricks' all-in-one file), read through diffusers' converter;
  the text encoder, connectors, autoencoders and vocoder come from `model.single_file_config`.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ltx2_lora_to_diffusers
from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers
from pydantic import Field

from difftune.config import Config
from difftune.data.clips import Sound, SoundingClip, frame_rate
from difftune.data.sound import log_mel_spectrogram, read_sound, window_samples
from difftune.errors import DifftuneError
from difftune.families.common.conditioning import NO_TOKEN, padded_token_ids
from difftune.families.common.drawing import ClipDrawing
from difftune.families.common.flow import FlowDrawing, FlowMatching, FlowMatchingFamily, flow_error
from difftune.families.common.layouts import RenamedLayout
from difftune.families.common.loading import FamilyOptions, Loading
from difftune.families.common.sound import SoundConditioning, SoundLoading, sound_setting_problems
from difftune.families.common.targets import AdapterTargets, targets_in_blocks
from difftune.memory.transfer import host_randn
from difftune.models.components import Components

TEXT_TOKENS = 1024  # the pipeline's default `max_sequence_length`: Gemma 3 reads every caption left-padded to it
FRAME_RATE = 24.0  # the pipeline's default `frame_rate`: the rate its video positions are conditioned on
# The video stream's layers in each block (the audio stream's are `audio_attn1`, `audio_ff`, ...; the layers between
# the streams `audio_to_video_attn`, `video_to_audio_attn`): what a video run adapts.
VIDEO_TARGETS = [
    f"{attention}.{layer}" for attention in ("attn1", "attn2") for layer in ("to_q", "to_k", "to_v", "to_out.0")
] + ["ff.net.0.proj", "ff.net.2"]
# What a run with sound adapts besides: the audio stream's layers and the attention between the streams.
SOUND_TARGETS = [
    f"{attention}.{layer}"
    for attention in ("audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
    for layer in ("to_q", "to_k", "to_v", "to_out.0")
] + ["audio_ff.net.0.proj", "audio_ff.net.2"]
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


class LTX2Options(FamilyOptions):
    sound: bool = Field(
        False,
        description="Train each clip's sound beside its frames (Lightricks' trainer's `with_audio`, musubi-tuner's "
        "`--ltx_mode av`): the audio stream and the attention between the streams get adapters too. Every example "
        "must be a clip (one without an audio stream trains its frames, its sound's loss masked), and cache.latents "
        "on. false: the video alone, the audio stream left as the base's (the pipeline still draws sound).",
    )


class SoundAndVideoFlow(FlowMatching):
    """LTX-2's flow matching: a clip's latents, and where the batch holds its sound (`sound_latents`) the sound's
    latents too, at the clip's noise level with their own noise; the loss the video's mean error plus the sound's."""

    def stream_noise(self, components, generators, latents, conditioning):
        if "sound_latents" not in conditioning:
            return {}
        sound = conditioning["sound_latents"]
        return {"sound_noise": host_randn(sound.shape, generators, sound.device, sound.dtype)}

    def loss(self, components, latents, timesteps, noise, conditioning, geometry, config, input_noise=None, mask=None):
        if "sound_latents" not in conditioning:
            arguments = (components, latents, timesteps, noise, conditioning, geometry, config, input_noise, mask)
            return super().loss(*arguments)
        sound, sound_noise = conditioning["sound_latents"], conditioning["sound_noise"]
        noisy = self.noised(components, latents, timesteps, noise if input_noise is None else input_noise)
        noisy_sound = self.noised(components, sound, timesteps, sound_noise)
        video, heard = components.family.denoise_with_sound(components, noisy, noisy_sound, timesteps, conditioning)
        # A silent clip's sound (digital silence, not what was there) is not trained: its error is masked. Caches
        # made before silent clips trained hold sounds all heard.
        sound_heard = conditioning.get("sound_heard", torch.ones(len(sound))).to(sound.device)
        per_sample = flow_error(video, noise - latents, timesteps, config, mask) + sound_heard * flow_error(
            heard, sound_noise - sound, timesteps, config
        )
        return self.weighted(per_sample, timesteps, config)


class LTX2Targets(AdapterTargets):
    default_targets = {"transformer": VIDEO_TARGETS}
    lora_text_encoders = ()  # the transformer's adapters alone (the connectors are frozen)

    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        """Each block's video-stream layers by full name (the audio stream's have the same names after `audio_`)."""
        return targets_in_blocks(model, {"transformer_blocks": VIDEO_TARGETS})

    def adapter_targets(self, components: Components, part: str) -> list[str]:
        """A run with sound adapts the audio stream and the attention between the streams too."""
        targets = self.targets_of(part, components.parts()[part])
        if self.family.conditioning.trains_sound(components):
            targets += targets_in_blocks(components.denoiser, {"transformer_blocks": SOUND_TARGETS})
        return targets


class LTX2Loading(SoundLoading):
    single_file_pipeline = Loading.pipeline_around_denoiser_file


class LTX2Drawing(ClipDrawing, FlowDrawing):
    def draw_clips(self, pipeline, prompt, controls, height, width, frames, **arguments) -> list[list]:
        """Each clip with the sound the pipeline drew beside it (its vocoder's waveform), which lasts as long as the
        frames at the frame rate they were drawn for: written together (`save_clip`)."""
        drawn = pipeline(prompt=prompt, height=height, width=width, num_frames=frames, output_type="pil", **arguments)
        rate, fps = pipeline.vocoder.config.output_sampling_rate, arguments.get("frame_rate", FRAME_RATE)
        return [
            SoundingClip(clip, Sound(sound.float().cpu().numpy(), rate), fps)
            for clip, sound in zip(drawn.frames, drawn.audio, strict=True)
        ]

    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """Classifier-free guidance at this scale for video and audio, the pipeline's other guidance off (see the
        module's docstring), at the frame rate training conditions on."""
        return {
            "max_sequence_length": self.family.max_sequence_length(components),
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


class LTX2Conditioning(SoundConditioning):
    def encoder_tokenizers(self) -> list[tuple[str, str]]:
        return [("text_encoder", "tokenizer"), ("connectors", "tokenizer")]

    def sound_conditioning(self, components: Components, clips: list[tuple[Path, tuple[int, int] | None]]) -> dict:
        """Each clip window's sound as the transformer reads it, (B, tokens, channels), the clip's frame rate (B,) and
        whether it was heard (B,: 0 for a clip without an audio stream, whose sound's loss is masked), for the latent
        cache: its log-mel spectrogram encoded by the audio autoencoder (the posterior's mode), packed and normalised
        as the pipeline reads `audio_latents`. A silent clip's is digital silence of the window's length."""
        audio_vae = components.pixel_encoders["audio_vae"]
        config = audio_vae.config
        sounds, heard = [], []
        for path, window in clips:
            if not window:
                raise DifftuneError(
                    f"{path}: is an image; model.family_options.sound trains clips' sound beside their frames: train "
                    "clips, or set it to false"
                )
            sound = read_sound(path, *window, config.sample_rate)
            heard.append(sound is not None)
            if sound is None:
                if not (fps := frame_rate(path)):
                    raise DifftuneError(f"{path}: states no frame rate to time its (silent) sound by; re-encode it")
                sound = torch.zeros(2, window_samples(*window, fps, config.sample_rate)[1]), fps
            sounds.append(sound)
        lengths = {waveform.shape[1] for waveform, _ in sounds}
        if len(lengths) > 1:
            rates = ", ".join(f"{rate:g}" for rate in sorted({rate for _, rate in sounds}))
            raise DifftuneError(
                f"windows of {clips[0][1][1]} frames at several frame rates ({rates} fps) hold sounds of different "
                "lengths: encode one rate at a time (training's cache chunks are cut so)"
            )
        waveforms = torch.stack([waveform for waveform, _ in sounds])
        spectrograms = log_mel_spectrogram(waveforms, config.sample_rate, config.mel_hop_length, config.mel_bins)
        weight = next(audio_vae.parameters())
        latents = audio_vae.encode(spectrograms.to(weight)).latent_dist.mode().float()
        packed = LTX2Pipeline._pack_audio_latents(latents)
        normalised = LTX2Pipeline._normalize_audio_latents(packed, audio_vae.latents_mean, audio_vae.latents_std)
        return {
            "sound_latents": normalised,
            "frame_rate": torch.tensor([rate for _, rate in sounds]),
            "sound_heard": torch.tensor(heard, dtype=torch.float32),
        }

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
        video, audio, text_mask = components.text_encoders["connectors"](stacked, mask, padding_side="left")
        sound = {"audio_hidden_states": audio} if self.trains_sound(components) else {}
        return {"encoder_hidden_states": video, "text_mask": text_mask} | sound

    def text_kept(self, components: Components) -> str:
        return "+sound" if self.trains_sound(components) else ""


class LTX2(FlowMatchingFamily):
    name = "ltx2"
    layout = LTX2Layout()
    loading = LTX2Loading()
    conditioning = LTX2Conditioning()
    drawing = LTX2Drawing()
    targets = LTX2Targets()
    description = "LTX-2"
    pipeline_class = LTX2Pipeline
    pipeline_classes = ("LTX2Pipeline",)
    denoiser_class = LTX2VideoTransformer3DModel
    denoiser_name = "transformer"
    text_encoder_names = ("text_encoder", "connectors")  # the connectors turn Gemma 3's states into the caption's
    tokenizer_names = ("tokenizer",)
    drawing_part_names = ("audio_vae", "vocoder")  # the pipeline draws sound beside every clip
    block_lists = ("transformer_blocks",)
    patch_size = 1  # each latent pixel a token (the transformers of LTX-2 all patch 1 x 1 x 1)
    options_model = LTX2Options  # no guidance embedding: classifier-free guidance
    objective = SoundAndVideoFlow()
    reads_clips = True

    # Sound (see the module's docstring): the audio autoencoder encodes each clip's sound into the latent cache, as the
    # autoencoder its frames; kept, placed and released with it (`pixel_encoders`) where sound trains.

    def unsupported_settings(self, config: Config) -> list[str]:
        return sound_setting_problems(config) if self.options(config.model).sound else []

    # Prompts and the transformer.

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """An image's latents (B, C, h, w) as one-frame clips; a clip's (B, C, t, h, w) as the pipeline packs them,
        each latent pixel a token; the audio stream one empty token, isolated (see the module's docstring)."""
        states = conditioning["encoder_hidden_states"]
        config = components.denoiser.config
        # The audio stream's caption states are the audio connector's width where the transformer projects none.
        audio_width = config.caption_channels if config.use_prompt_embeddings else config.audio_cross_attention_dim
        silence = {
            "audio_hidden_states": states.new_zeros(len(noisy), 1, config.audio_in_channels),
            "audio_encoder_hidden_states": states.new_zeros(len(noisy), 1, audio_width),
            "audio_encoder_attention_mask": torch.ones(len(noisy), 1, device=states.device),
            "audio_num_frames": 1,
            "fps": FRAME_RATE,
            "isolate_modalities": True,
        }
        return self._run(components, noisy, timesteps, conditioning, silence)[0]

    def planned_prediction(self, components, noisy, timesteps, conditioning, geometry):
        """A run with sound plans both streams joined, as it trains them, over the sound of a window as long as the
        clip's frames at the pipeline's frame rate (its token count as `LTX2Pipeline` counts a clip's audio latents)."""
        if not self.conditioning.trains_sound(components) or noisy.dim() != 5:
            return super().planned_prediction(components, noisy, timesteps, conditioning, geometry)
        audio_vae = components.pixel_encoders["audio_vae"]
        seconds = ((noisy.shape[2] - 1) * components.vae.temporal_compression_ratio + 1) / FRAME_RATE
        per_second = (
            audio_vae.config.sample_rate / audio_vae.config.mel_hop_length / audio_vae.temporal_compression_ratio
        )
        sound = noisy.new_zeros(len(noisy), round(seconds * per_second), components.denoiser.config.audio_in_channels)
        rates = {"frame_rate": torch.full((len(noisy),), FRAME_RATE)}
        video, heard = self.denoise_with_sound(components, noisy, sound, timesteps, conditioning | rates)
        return torch.cat([video.flatten(1), heard.flatten(1)], dim=1)

    def denoise_with_sound(self, components, noisy, noisy_sound, timesteps, conditioning):
        """A clip's latents (B, C, t, h, w) and its sound's (B, tokens, channels) through both streams, joined, as the
        pipeline runs them (the video positioned at the clip's frame rate): both predictions."""
        rates = conditioning["frame_rate"]
        if not torch.all(rates == rates[0]):
            raise DifftuneError(  # training's batches are cut by rate (dataset.batch_groups)
                f"a batch of clips at several frame rates ({rates.tolist()}): the video is placed at one rate"
            )
        states = conditioning["audio_hidden_states"]
        sound = {
            "audio_hidden_states": noisy_sound.to(states.dtype),
            "audio_encoder_hidden_states": states,
            "audio_encoder_attention_mask": conditioning["text_mask"],
            "audio_num_frames": noisy_sound.shape[1],
            "fps": float(rates[0]),
            "isolate_modalities": False,
        }
        return self._run(components, noisy, timesteps, conditioning, sound)

    def _run(self, components, noisy, timesteps, conditioning, audio_stream: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformer on `noisy` latents beside `audio_stream`'s inputs: the video's prediction unpacked as
        `noisy`, and the audio stream's."""
        denoiser = components.denoiser
        states = conditioning["encoder_hidden_states"]
        clip = (noisy if noisy.dim() == 5 else noisy[:, :, None]).to(states.dtype)
        config = denoiser.config
        frames, height, width = clip.shape[2:]
        grid = (frames // config.patch_size_t, height // config.patch_size, width // config.patch_size)  # in tokens
        time = timesteps.to(states.dtype)
        video, sound = denoiser(
            hidden_states=LTX2Pipeline._pack_latents(clip, config.patch_size, config.patch_size_t),
            encoder_hidden_states=states,
            timestep=time,
            sigma=time,
            encoder_attention_mask=conditioning["text_mask"],
            num_frames=grid[0],
            height=grid[1],
            width=grid[2],
            use_cross_timestep=True,
            return_dict=False,
            **audio_stream,
        )
        unpacked = LTX2Pipeline._unpack_latents(video, *grid, config.patch_size, config.patch_size_t)
        return (unpacked if noisy.dim() == 5 else unpacked[:, :, 0]), sound

    # Sampling.

    def max_sequence_length(self, components: Components) -> int:
        return text_tokens(components.tokenizers["tokenizer"])


FAMILY = LTX2()
