"""MiniMax-H3 text-to-video with sound (`MiniMaxH3ModularPipeline`'s `t2va` workflow, a diffusers modular pipeline:
modular.py): one transformer (`MiniMaxH3Transformer3DModel`: a token refiner over the text, then blocks of full
self-attention) over one packed sequence that holds the caption's rows, the sound's rows and the video's rows, over
MiniMax-H3's video autoencoder (`AutoencoderKLMiniMaxH3`: 16x in space, clips of 17n + 5 frames, autoencoders.py) and
its audio autoencoder (`AutoencoderKLMiniMaxH3Audio`: 32 kHz, 40 latents a second), conditioned on a Qwen3-VL language
model's 50th hidden state. Trained by flow matching (flow.py).

- Text, exactly as `MiniMaxH3TextEncoderStep` encodes a prompt: the caption as it is (no template, no special
  tokens), read by the language model alone (`get_qwen3vl_prompt_embeds`, the pipeline's own function), its state
  after layer 50 kept per token. The pipeline reads a prompt whole; training reads at most `TEXT_TOKENS` tokens.
- The packed sequence, as the pipeline lays it out (its own `build_packed_sequence` and `build_row_timesteps`): the
  caption's rows, then the sound's (stereo, channel-major: 40 latents a second each side), then the video's (the
  latents patched 1 x 2 x 2); one position grid, one modality tag and one noise level per row. It has no padding: each
  sample is its own sequence, and a batch runs sample by sample (the transformer's batch axis repeats one layout).
- Time and prediction: the transformer reads t = 1 - sigma (1 is clean) and predicts the velocity toward the data;
  difftune's flow objective reads it as noise - data, so the prediction's sign is turned.
- **Video alone, by default.** The sound's rows are there as at the pipeline's first step: noise at t = 0 (sigma 1),
  carrying nothing, their error not trained. The adapters go on the blocks (every row shares them), so the pipeline
  still draws sound beside the adapted video.
- **Sound and video** (`model.family_options.sound`): every clip's sound under its window (`sound.py`, resampled to
  32 kHz stereo) is encoded by the audio autoencoder (each side its own mono waveform; the posterior's mean, as the
  pipeline encodes a sound; normalised by its per-channel statistics) into the latent cache beside the frames, cut to
  the pipeline's count for the window (`audio_latent_num_frames`). The sound's noise level is the one the pipeline's
  two schedules pair with the video's (video shift 12, audio shift 3: the same step of each); the loss is the video's
  error plus the sound's. A clip without an audio stream trains its frames, its sound's error masked. The pipeline
  places sound and video by 24 frames a second, so a run with sound takes clips at 24 fps (others are refused by
  name: re-encode them).
- Samples: clips of `sample.frames` frames (5 to 15 seconds at 24 fps, as the pipeline draws), at the size asked (a
  multiple of 32), with the sound the pipeline drew (the sample's mp4 carries it); an image sample (`sample.frames`
  1) is the first frame of the shortest clip it draws (5 s). The base is guidance-distilled: one pass a step, and
  `sample.guidance_scale` and the negative prompt have no effect.
- Files: diffusers' layout (`transformer.`, what `MiniMaxH3ModularPipeline.load_lora_weights` reads). The original
  model fuses q, k and v (`attn.qkv_proj`, stacked) and holds the SwiGLU's gate before its value (`mlp.fc1`), under
  its own names (`blocks.0.attn.qkv_proj`, `final_layer.video_out`): the kohya / ComfyUI layout names its layers so
  (`lora_unet_blocks_0_attn_qkv_proj`, musubi-tuner's, which diffusers' reader of MiniMax-H3 files reads), and a
  single file is the transformer alone in that layout (`token_refiner.blocks.0.attn.qkv_proj.weight`, what diffusers
  and ComfyUI tell MiniMax-H3 by; diffusers' converter reads it back).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import MiniMaxH3ModularPipeline, MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
    patchify_video_latents,
)
from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MINIMAX_H3_AUDIO_CHANNELS,
    MINIMAX_H3_AUDIO_TAG,
    MINIMAX_H3_FPS,
    MINIMAX_H3_TEXT_TAG,
    MINIMAX_H3_VIDEO_TAG,
    audio_latent_num_frames,
)
from pydantic import Field

from difftune.config import Config
from difftune.data.clips import Sound, SoundingClip
from difftune.data.sound import read_sound, window_samples
from difftune.errors import DifftuneError
from difftune.families.common.conditioning import NO_TOKEN, padded_token_ids
from difftune.families.common.drawing import ClipDrawing, one_call_each
from difftune.families.common.flow import FlowDrawing, FlowMatching, FlowMatchingFamily, flow_error, shifted
from difftune.families.common.layouts import FusedLayout, kohya_blocks_of, kohya_globals_of
from difftune.families.common.loading import FamilyOptions
from difftune.families.common.modular import ModularDrawing, ModularLoading
from difftune.families.common.sound import SoundConditioning, SoundLoading, sound_setting_problems
from difftune.families.common.targets import AdapterTargets, targets_in_blocks
from difftune.memory.transfer import host_randn
from difftune.models.components import Components

TEXT_TOKENS = 512  # caption tokens training reads at most (the pipeline reads a prompt whole)
TEXT_LAYER = 50  # the pipeline's `text_encoder_layer`: the language model's hidden state the transformer reads
SHORTEST_SECONDS, LONGEST_SECONDS = 5, 15  # what the pipeline draws (`min_duration`, `max_duration`)
FRAMES_PER_CHUNK, LATENTS_PER_CHUNK = 17, 5  # the video autoencoder's `clip_length` and `tokens_chunk_size`
BLOCK_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2"]


# The original model's layers in a block (the transformer's and the token refiner's alike), each with the diffusers
# modules it holds; outside the blocks, diffusers' module -> the original layer (diffusers' converter's renames).
BLOCK_LAYERS = {
    "norm1": ["norm1"],
    "norm2": ["norm2"],
    "attn.qkv_proj": ["attn.to_q", "attn.to_k", "attn.to_v"],
    "attn.q_norm": ["attn.norm_q"],
    "attn.k_norm": ["attn.norm_k"],
    "attn.out_proj": ["attn.to_out.0"],
    "mlp.fc1": ["ff.net.0.proj"],
    "mlp.fc2": ["ff.net.2"],
}
ORIGINAL_BLOCKS = {
    "transformer_blocks": ("blocks", BLOCK_LAYERS | {"adaln_proj.linear": ["adaln_proj.linear"]}),
    "token_refiner.refiner_blocks": ("token_refiner.blocks", BLOCK_LAYERS),
}
ORIGINAL_GLOBALS = {
    "proj_in": "video_patch_proj",
    "audio_proj_in": "audio_patch_proj",
    "context_embedder": "condition_proj",
    "time_embedder.linear_1": "time_embedder.proj_in",
    "time_embedder.linear_2": "time_embedder.proj_out",
    "token_refiner.final_norm": "token_refiner.final_norm",
    "norm_out.norm": "final_layer.norm",
    "norm_out.linear": "final_layer.adaln_proj.linear",
    "proj_out": "final_layer.video_out",
    "audio_proj_out": "final_layer.audio_out",
}


class MiniMaxH3Layout(FusedLayout):
    """MiniMax-H3's files in other tools' layouts (see the module's docstring)."""

    single_file_layout = "transformer alone (original layout)"
    denoiser_file_key = "token_refiner.blocks.0.attn.qkv_proj.weight"
    kohya_prefixes = {"transformer": "lora_unet_"}
    kohya_text_model_parts = ()
    kohya_model_version = "minimax_h3"
    kohya_layout_name = "MiniMax-H3"
    original_blocks, original_globals = ORIGINAL_BLOCKS, ORIGINAL_GLOBALS
    swapped_block_layers = ("mlp.fc1",)
    # The transformer's blocks (the token refiner's hold no default target; diffusers' reader names none of them).
    kohya_blocks = kohya_blocks_of({"transformer_blocks": ORIGINAL_BLOCKS["transformer_blocks"]})
    kohya_globals = kohya_globals_of(ORIGINAL_GLOBALS, ())


class MiniMaxH3Options(FamilyOptions):
    sound: bool = Field(
        False,
        description="Train each clip's sound beside its frames: every example must be a clip at 24 fps (one without "
        "an audio stream trains its frames, its sound's loss masked), and cache.latents on. false: the video alone, "
        "the sound's rows noise as at the pipeline's first step (the pipeline still draws sound).",
    )


def clip_frames(latent_frames: int) -> int:
    """The frames of a clip of `latent_frames` latent frames (1: an image's one): the inverse of the pipeline's
    `video_latent_num_frames`, at the chunking MiniMax-H3's video autoencoder is built with (17 frames to 5 latent
    frames; the pipeline's defaults where it has none)."""
    if latent_frames == 1:
        return 1
    return (latent_frames - 2) // LATENTS_PER_CHUNK * FRAMES_PER_CHUNK + LATENTS_PER_CHUNK


def unpatched(rows: torch.Tensor, patch: tuple[int, int, int], shape: tuple[int, ...]) -> torch.Tensor:
    """Video rows (rows, C x patch) back to latents (1, C, t, h, w), as `MiniMaxH3AfterDenoiseStep` unpacks them."""
    channels, frames, height, width = shape
    pt, ph, pw = patch
    rows = rows.reshape(1, frames // pt, height // ph, width // pw, channels, pt, ph, pw)
    return rows.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(1, channels, frames, height, width)


def sound_levels(components: Components, timesteps: torch.Tensor) -> torch.Tensor:
    """The sound's noise levels (scheduler scale) the pipeline pairs with the video's `timesteps`: the same point of
    the unshifted schedule through each modality's shift."""
    video_shift = components.noise_scheduler.config.shift
    audio_shift = components.pipeline_options["audio_scheduler"].config.shift
    # Shifts compose by their product (s1 then s2 is s1 x s2), so undoing the video's and applying the sound's is one.
    return shifted(timesteps.float() / 1000, audio_shift / video_shift) * 1000


class PackedSoundAndVideoFlow(FlowMatching):
    """Flow matching over a clip's latents beside its sound's rows (see the module's docstring): the sound's noise
    drawn per sample; where the batch holds its sound (`sound_latents`), its error trained at the paired level."""

    def stream_noise(self, components, generators, latents, conditioning):
        if "sound_latents" in conditioning:
            shape = conditioning["sound_latents"].shape
        else:
            shape = (len(latents), *components.family.unheard_sound_shape(components, latents))
        return {"sound_noise": host_randn(shape, generators, latents.device, torch.float32)}

    def loss(self, components, latents, timesteps, noise, conditioning, geometry, config, input_noise=None, mask=None):
        if "sound_latents" not in conditioning:  # the video alone: `denoise` beside unheard sound
            arguments = (components, latents, timesteps, noise, conditioning, geometry, config, input_noise, mask)
            return super().loss(*arguments)
        family = components.family
        noisy = self.noised(components, latents, timesteps, noise if input_noise is None else input_noise)
        sound, sound_noise = conditioning["sound_latents"], conditioning["sound_noise"]
        levels = sound_levels(components, timesteps)
        noisy_sound = self.noised(components, sound, levels, sound_noise)
        video, heard = family.predict(components, noisy, noisy_sound, timesteps, levels, conditioning)
        sound_heard = conditioning.get("sound_heard", torch.ones(len(sound))).to(sound.device)
        per_sample = flow_error(video, noise - latents, timesteps, config, mask) + sound_heard * flow_error(
            heard, sound_noise - sound, levels, config
        )
        return self.weighted(per_sample, timesteps, config)


class MiniMaxH3Targets(AdapterTargets):
    default_targets = {"transformer": BLOCK_TARGETS}
    lora_text_encoders = ()

    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        """Each block's attention and feed-forward layers (the token refiner's, which hold the same names, left)."""
        return targets_in_blocks(model, {"transformer_blocks": BLOCK_TARGETS})


class MiniMaxH3Loading(SoundLoading, ModularLoading):
    workflow = "t2va"  # text-to-video: the base's `transformer` partition alone (not `transformer_ref`)

    def components_of(self, pipeline, options: MiniMaxH3Options) -> Components:
        """As any modular family's; the sound's schedule (a scheduler, no module to place) kept with the pipeline's
        options, which a reassembled pipeline is given back."""
        components = super().components_of(pipeline, options)
        components.pipeline_options["audio_scheduler"] = pipeline.audio_scheduler
        return components


class MiniMaxH3Drawing(ModularDrawing, ClipDrawing, FlowDrawing):
    samplers = {"euler": MiniMaxH3Scheduler}

    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        return {}  # guidance-distilled: one pass a step, no guidance to give

    def draw(self, pipeline, options, prompt, controls, height, width, **arguments) -> list:
        """Each prompt's image: the first frame of the shortest clip the pipeline draws."""
        frames = SHORTEST_SECONDS * MINIMAX_H3_FPS
        return [clip[0] for clip in self.draw_clips(pipeline, prompt, controls, height, width, frames, **arguments)]

    def draw_clips(self, pipeline, prompt, controls, height, width, frames, **arguments) -> list[list]:
        """Each prompt's clip in a call of its own (the pipeline packs one request), with its generator, and with the
        sound drawn beside it."""
        clips = []
        for text, call in one_call_each(prompt, arguments):
            drawn = pipeline(
                prompt=text,
                height=height,
                width=width,
                num_frames=frames,
                output=["videos", "audio", "sampling_rate"],
                **call,
            )
            sound = Sound(drawn["audio"][0].float().cpu().numpy(), drawn["sampling_rate"])
            clips.append(SoundingClip(drawn["videos"][0], sound, MINIMAX_H3_FPS))
        return clips


class MiniMaxH3Conditioning(SoundConditioning):
    padded_text_tokens = TEXT_TOKENS

    def encoder_tokenizers(self) -> list[tuple[str, str]]:
        return [("text_encoder", "tokenizer")]  # the processor only types the tokens (all text here)

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        """Each caption's ids as the pipeline tokenizes a prompt (no special tokens), right-padded with -1."""
        ids = tokenizers["tokenizer"](captions, add_special_tokens=False, truncation=True, max_length=TEXT_TOKENS)
        return {"text_encoder": padded_token_ids(ids["input_ids"], TEXT_TOKENS)}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each caption read alone, as the pipeline reads a prompt: (B, TEXT_TOKENS, D) states, zero past the
        caption's tokens (`text_mask`). An empty caption has no rows."""
        encoder, processor = components.text_encoders["text_encoder"], components.tokenizers["processor"]
        ids = token_ids["text_encoder"]
        if ids.is_meta:  # the memory plan's trace: the language model over the whole window, every token text
            mask = torch.ones_like(ids)
            states = encoder.model(
                input_ids=ids,
                attention_mask=mask,
                mm_token_type_ids=0 * mask,
                use_cache=False,
                output_hidden_states=True,
            ).hidden_states[TEXT_LAYER]
            return {"encoder_hidden_states": states, "text_mask": mask}
        width = encoder.config.text_config.hidden_size
        states = torch.zeros(len(ids), TEXT_TOKENS, width, device=ids.device, dtype=encoder.dtype)
        for i, row in enumerate(ids):
            tokens = row[row != NO_TOKEN].tolist()
            if tokens:
                states[i, : len(tokens)] = get_qwen3vl_prompt_embeds(
                    encoder, processor, tokens, {}, TEXT_LAYER, device=ids.device, dtype=encoder.dtype
                )[0]
        return {"encoder_hidden_states": states, "text_mask": (ids != NO_TOKEN).long()}

    def sound_conditioning(self, components: Components, clips: list[tuple[Path, tuple[int, int] | None]]) -> dict:
        """Each clip window's sound as the transformer reads it, (B, rows, channels): each side encoded alone (the
        posterior's mean), normalised, cut to the pipeline's count for the window, the sides one after the other;
        and whether it was heard (B,: 0 for a clip without an audio stream, digital silence in its place)."""
        audio_vae = components.pixel_encoders["audio_vae"]
        rate, waveforms, heard = audio_vae.config.sampling_rate, [], []
        for path, window in clips:
            if not window:
                raise DifftuneError(
                    f"{path}: is an image; model.family_options.sound trains clips' sound beside their frames: train "
                    "clips, or set it to false"
                )
            sound = read_sound(path, *window, rate)
            if sound is not None and round(sound[1], 3) != MINIMAX_H3_FPS:
                raise DifftuneError(
                    f"{path}: runs at {sound[1]:g} fps; MiniMax-H3 places sound and video by {MINIMAX_H3_FPS} frames a "
                    f"second: re-encode it (ffmpeg -i in.mp4 -r {MINIMAX_H3_FPS} out.mp4)"
                )
            heard.append(sound is not None)
            samples = window_samples(*window, MINIMAX_H3_FPS, rate)[1]
            waveforms.append(sound[0] if sound is not None else torch.zeros(MINIMAX_H3_AUDIO_CHANNELS, samples))
        weight = next(audio_vae.parameters())
        sides = torch.stack(waveforms).flatten(0, 1)[:, None].to(weight)  # (B * 2, 1, samples): each side mono
        latents = audio_vae.encode(sides).latent_dist.mode().float()[..., : audio_latent_num_frames(clips[0][1][1])]
        mean = torch.tensor(audio_vae.config.latents_mean, device=latents.device).view(1, -1, 1)
        std = torch.tensor(audio_vae.config.latents_std, device=latents.device).view(1, -1, 1)
        normalised = ((latents - mean) / std).unflatten(0, (len(clips), MINIMAX_H3_AUDIO_CHANNELS))
        rows = normalised.transpose(2, 3).flatten(1, 2)  # (B, 2 x latents, channels): channel-major
        return {"sound_latents": rows, "sound_heard": torch.tensor(heard, dtype=torch.float32)}

    def text_kept(self, components: Components) -> str:
        return ""


class MiniMaxH3(FlowMatchingFamily):
    name = "minimax_h3"
    layout = MiniMaxH3Layout()
    loading = MiniMaxH3Loading()
    conditioning = MiniMaxH3Conditioning()
    drawing = MiniMaxH3Drawing()
    targets = MiniMaxH3Targets()
    description = "MiniMax-H3"
    pipeline_class = MiniMaxH3ModularPipeline
    pipeline_classes = ("MiniMaxH3ModularPipeline",)
    denoiser_class = MiniMaxH3Transformer3DModel
    denoiser_name = "transformer"
    text_encoder_names = ("text_encoder",)
    tokenizer_names = ("tokenizer", "processor")
    drawing_part_names = ("audio_vae",)  # the pipeline draws sound beside every clip
    block_lists = ("transformer_blocks",)
    options_model = MiniMaxH3Options
    objective = PackedSoundAndVideoFlow()
    reads_clips = True

    def unsupported_settings(self, config: Config) -> list[str]:
        problems = []
        frames = config.sample.frames
        if frames > 1 and not SHORTEST_SECONDS <= frames / MINIMAX_H3_FPS <= LONGEST_SECONDS:
            problems.append(
                f"sample.frames = {frames}: MiniMax-H3 draws clips of {SHORTEST_SECONDS} to {LONGEST_SECONDS} "
                f"seconds at {MINIMAX_H3_FPS} fps: set {SHORTEST_SECONDS * MINIMAX_H3_FPS} to "
                f"{LONGEST_SECONDS * MINIMAX_H3_FPS} frames (or 1: an image, the first frame of a 5 s clip)"
            )
        return problems + (sound_setting_problems(config) if self.options(config.model).sound else [])

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_channels

    # The transformer.

    def unheard_sound_shape(self, components: Components, latents: torch.Tensor) -> tuple[int, int]:
        """(rows, channels) of the sound beside `latents` (an image's: one frame) where none is trained: as many
        latents a side as the pipeline makes for the clip's frames."""
        frames = clip_frames(latents.shape[2] if latents.dim() == 5 else 1)
        rows = MINIMAX_H3_AUDIO_CHANNELS * audio_latent_num_frames(frames)
        return rows, components.denoiser.config.audio_in_channels

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """The video's prediction beside sound rows of noise at sigma 1 (the batch's `sound_noise`, or one fixed draw
        where none was drawn: validation's, the memory plan's)."""
        sound = conditioning.get("sound_noise")
        if sound is None:
            shape = (len(noisy), *self.unheard_sound_shape(components, noisy))
            if noisy.is_meta:
                sound = noisy.new_zeros(shape)
            else:
                sound = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(noisy.device)
        silent = torch.full_like(timesteps, 1000.0)
        return self.predict(components, noisy, sound, timesteps, silent, conditioning)[0]

    def predict(self, components, noisy, noisy_sound, timesteps, sound_timesteps, conditioning):
        """Latents (B, C, [t,] h, w) and sound rows (B, rows, channels) at their noise levels (scheduler scale)
        through the transformer, each sample its own packed sequence as the pipeline lays it out: both predictions as
        velocities toward the noise."""
        denoiser = components.denoiser
        states, mask = conditioning["encoder_hidden_states"], conditioning["text_mask"]
        clip = noisy if noisy.dim() == 5 else noisy[:, :, None]
        patch = tuple(denoiser.config.patch_size)
        shape = tuple(clip.shape[1:])
        video_times, sound_times = 1 - timesteps.float() / 1000, 1 - sound_timesteps.float() / 1000
        videos, sounds = [], []
        for i in range(len(clip)):
            text = states[i : i + 1, : int(mask[i].sum())]
            tags = torch.full((text.shape[1],), MINIMAX_H3_TEXT_TAG, dtype=torch.long)
            positions, token_tags, video_rows, sound_rows, text_rows, _, _ = (
                MiniMaxH3PrepareLayoutStep.build_packed_sequence(
                    tags,
                    *shape[1:],
                    noisy_sound.shape[1] // MINIMAX_H3_AUDIO_CHANNELS,
                    patch,
                    MINIMAX_H3_AUDIO_CHANNELS,
                    MINIMAX_H3_AUDIO_TAG,
                    MINIMAX_H3_VIDEO_TAG,
                )
            )
            times, time_of_row = MiniMaxH3SetTimestepsStep.build_row_timesteps(
                video_rows, sound_rows, 0, 0, text.shape[1], float(video_times[i]), float(sound_times[i]), 1.0, 1.0
            )
            device = clip.device
            video, sound = denoiser(
                hidden_states=patchify_video_latents(clip[i : i + 1].float(), patch)[None],
                audio_hidden_states=noisy_sound[i : i + 1].float(),
                encoder_hidden_states=text,
                timestep=times.to(device),
                timestep_indices=time_of_row.to(device),
                token_tags=token_tags.to(device),
                position_ids=positions.to(device),
                video_indices=video_rows.to(device),
                audio_indices=sound_rows.to(device),
                text_indices=text_rows.to(device),
                return_dict=False,
            )
            videos.append(-unpatched(video[0], patch, shape))
            sounds.append(-sound)
        video = torch.cat(videos)
        return (video if noisy.dim() == 5 else video[:, :, 0]), torch.cat(sounds)

    def max_sequence_length(self, components: Components) -> int:
        return TEXT_TOKENS


FAMILY = MiniMaxH3()
