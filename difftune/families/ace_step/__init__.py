"""ACE-Step 1.5 (ACE Studio's and StepFun's music model, `AceStepPipeline`): the first family that is not pictures. A
DiT over time (`AceStepTransformer1DModel`: self-attention, half of it in sliding windows, cross-attention to the
conditioning, 2-frame patches) over the latents of Stable Audio's kind of autoencoder (`AutoencoderOobleck`: 48 kHz
stereo into 64 channels, 25 latent frames a second), conditioned on a Qwen3 embedding model's states of the caption
and the lyrics through the pipeline's condition encoder. Trained by flow matching (flow.py).

- Data: sound files with their captions (sound_files.py), cut into windows of `model.family_options.seconds`; every
  window trains and every sample is drawn that long, and the prompt says so (its `duration`). difftune sees a sound
  as an image one row high (autoencoders.py): latents (B, 64, 1, frames).
- Text, exactly as `AceStepPipeline.encode_prompt`: the caption in the pipeline's own template (its text-to-music
  instruction, the caption, the metadata: no bpm, key or time signature, the duration), the Qwen3 model's last states;
  the lyrics (`split_lyrics`: after a `[lyrics]` line of the caption or prompt; none: an instrumental) in their
  template, as the embedding layer's token vectors alone; then the
  condition encoder (a frozen part, run as a text encoder: `text_encoder_names`) packs the lyric encoder's states, the
  timbre of the pipeline's learned silence (no reference sound) and the projected caption states into one sequence,
  which the transformer reads unmasked. So each sample is denoised with its own sequence at its own length, never
  padded: a batch's samples of several lengths run in one call each.
- Time: the transformer reads sigma in [0, 1] twice (t and r, equal outside mean-flow training) and predicts the flow
  velocity (noise minus sound), beside its context: the learned silence latents and a mask of ones (the pipeline's
  text-to-music context: the whole window is drawn).
- Guidance: the base (SFT) models guide as the pipeline does (adaptive projected guidance against the learned null
  condition, at `sample.guidance_scale`); the turbo models are guidance-distilled and drawn unguided (their pipeline
  ignores the scale). The pipeline takes no negative prompt. Sampling follows the pipeline's own schedule (shift 3).
  A dropped caption (`data.caption_dropout`, or an empty one) trains as that null condition over its sequence, as
  ACE-Step's own trainer drops its conditions (its `cfg_ratio`), not as the encoding of an empty caption.
- Files: diffusers' layout (`transformer.`, what `AceStepPipeline.load_lora_weights` reads); the kohya layout is the one
  ComfyUI maps from its ACE-Step 1.5 model, the original module names under `decoder.` (`lora_unet_decoder_layers_0_
  self_attn_q_proj`); ACE-Step's own trainer's files (`base_model.model.layers.0.self_attn.q_proj`) are read through
  diffusers' converter. A single file is the original checkpoint's decoder (`decoder.*`; its condition encoder and
  audio tokenizer come from `model.single_file_config`).
"""

from __future__ import annotations

import math
import re
from functools import partial

import torch
from diffusers import AceStepPipeline, AceStepTransformer1DModel
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ace_step_lora_to_diffusers
from pydantic import Field

from difftune.config import Config
from difftune.data.clips import Sound
from difftune.data.sound_files import SoundWindows
from difftune.errors import DifftuneError
from difftune.families.common.conditioning import NO_TOKEN, Conditioning, padded_token_ids, valid_token_states
from difftune.families.common.flow import FlowDrawing, FlowMatching, FlowMatchingFamily
from difftune.families.common.layouts import RenamedLayout
from difftune.families.common.loading import FamilyOptions, Loading
from difftune.families.common.targets import AdapterTargets
from difftune.models.components import Components

TEXT_TOKENS = 256  # the pipeline's `max_text_length`
LYRIC_TOKENS = 2048  # its `max_lyric_length`
CONDITION_TOKENS = LYRIC_TOKENS + 1 + TEXT_TOKENS  # the condition encoder's sequence: lyrics, the timbre, the caption
TIMBRE_SECONDS = 30  # the silence the pipeline's timbre encoder reads where no reference sound is given
SAMPLING_SHIFT = 3.0  # the pipeline's default `shift`
ATTENTION_TARGETS = [
    f"{attention}.{layer}"
    for attention in ("self_attn", "cross_attn")
    for layer in ("to_q", "to_k", "to_v", "to_out.0")
]
# diffusers name -> the original model's (ComfyUI's), for the names that differ; the original's under `decoder.`
ORIGINAL_NAMES = {
    "to_q": "q_proj",
    "to_k": "k_proj",
    "to_v": "v_proj",
    "to_out.0": "o_proj",
    "norm_q": "q_norm",
    "norm_k": "k_norm",
    "proj_in_conv": "proj_in.1",
    "proj_out_conv": "proj_out.1",
}
ORIGINAL_PREFIX = "decoder."
LYRICS_LINE = re.compile(r"^\[lyrics\][ \t]*$", re.MULTILINE | re.IGNORECASE)  # what starts a caption's lyrics


def split_lyrics(text: str) -> tuple[str, str]:
    """A caption or prompt as (its caption, its lyrics): the lyrics are what follows a line `[lyrics]` (none: "", an
    instrumental)."""
    caption, *lyrics = LYRICS_LINE.split(text, maxsplit=1)
    return caption.strip(), lyrics[0].strip() if lyrics else ""


def _renamed(name: str, names: dict[str, str]) -> str:
    """`name` with each of `names`' keys, as whole dotted parts of it, put as its value."""
    for old, new in names.items():
        name = re.sub(rf"(^|\.){re.escape(old)}(?=\.|$)", rf"\g<1>{new}", name)
    return name


def original_name(name: str) -> str:
    """A transformer module's or weight's name in the original model."""
    return ORIGINAL_PREFIX + _renamed(name, ORIGINAL_NAMES)


def diffusers_name(name: str) -> str:
    """Inverse of `original_name`."""
    return _renamed(name.removeprefix(ORIGINAL_PREFIX), {new: old for old, new in ORIGINAL_NAMES.items()})


class AceStepLayout(RenamedLayout):
    """ACE-Step's files in other tools' layouts (see the module's docstring)."""

    kohya_prefixes = {"transformer": "lora_unet_"}
    kohya_text_model_parts = ()
    kohya_model_version = "ace_step_1_5"
    kohya_layout_name = "ACE-Step 1.5"
    single_file_layout = "the original checkpoint's decoder (decoder.*)"
    denoiser_file_key = "decoder.proj_in.1.weight"

    def original_name(self, module: str) -> str | None:
        return original_name(module)

    def diffusers_names(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The decoder's weights under diffusers' names; an original checkpoint's other parts (its condition encoder,
        audio tokenizer, null condition) are `model.single_file_config`'s to give."""
        if self.denoiser_file_key not in weights:
            return weights
        return {diffusers_name(key): value for key, value in weights.items() if key.startswith(ORIGINAL_PREFIX)}

    def to_single_file(self, components: Components) -> dict[str, torch.Tensor]:
        return {original_name(key): value.contiguous() for key, value in components.denoiser.state_dict().items()}

    def read_original_layout(self, tensors):
        """ACE-Step's own trainer's files (peft's `base_model.model.layers.0.self_attn.q_proj.lora_A.weight`), through
        diffusers' own reader of them."""
        if not any(key.startswith("base_model.model.layers.") for key in tensors):
            return None
        return _convert_non_diffusers_ace_step_lora_to_diffusers(dict(tensors))


class AceStepOptions(FamilyOptions):
    seconds: float = Field(
        30.0,
        gt=0,
        description="How long every window trained and every sample drawn is, in seconds: a sound file is cut into "
        "windows of it back to back (one shorter is one window, padded with silence), and the prompt says it (its "
        "`duration`). ACE-Step's pipeline draws 60 s unless asked; its LoRA trainers cut songs into 30 to 60 s pieces.",
    )


class AceStepTargets(AdapterTargets):
    default_targets = {"transformer": ATTENTION_TARGETS}  # ACE-Step's own trainer's q, k, v and o of both attentions
    lora_text_encoders = ()  # AceStepPipeline's LoRA loader reads the transformer's adapters alone
    recorded_options = ("seconds",)  # a file's samples are drawn as long as it trained (export.base_for_adapters)

    def combined_option(self, name: str, values: set) -> object | None:
        return max(values)  # files trained at several lengths draw the longest


class AceStepLoading(Loading):
    # Single files: the decoder of an original checkpoint; the other parts come from `model.single_file_config`.
    single_file_pipeline = Loading.pipeline_around_denoiser_file


class AceStepDrawing(FlowDrawing):
    def draw(self, pipeline, options, prompt, controls, height, width, **arguments) -> list:
        raise DifftuneError(f"{self.family.description} bases draw sounds (`draw_sounds`), not pictures")

    def draw_sounds(self, pipeline, options: AceStepOptions, prompt, **arguments) -> list[Sound]:
        captions, lyrics = zip(*map(split_lyrics, [prompt] if isinstance(prompt, str) else prompt), strict=True)
        audios = pipeline(
            prompt=list(captions), lyrics=list(lyrics), audio_duration=options.seconds, output_type="pt", **arguments
        ).audios
        return [Sound(audio.float().cpu().numpy(), pipeline.sample_rate) for audio in audios]

    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """The pipeline's own guidance (none at 1, and none for a turbo base whatever the scale) and schedule."""
        return {"guidance_scale": guidance_scale, "shift": SAMPLING_SHIFT}


class AceStepConditioning(Conditioning):
    padded_text_tokens = CONDITION_TOKENS

    def data_settings(self, data):
        """Sounds are never flipped, cropped to buckets or masked."""
        return data.model_copy(update={"random_flip": False, "buckets": False, "masks": "off"})

    def frame_windows(self, data, components: Components) -> SoundWindows:
        rate = components.samples_per_second
        return SoundWindows(rate, components.family_options.seconds, components.pixels_per_latent)

    def tokenizer(self, components: Components):
        return partial(self.tokenize, components.tokenizers, seconds=components.family_options.seconds)

    def tokenize(self, tokenizers, captions, controls=None, seconds: float = 30.0) -> dict[str, torch.Tensor]:
        """Each caption in the pipeline's template, and its lyrics (`split_lyrics`) in theirs, padded with -1 (no
        token's id) to the pipeline's lengths."""
        texts, lyrics = zip(
            *(
                AceStepPipeline._format_prompt(AceStepPipeline, caption, lyrics, audio_duration=seconds)
                for caption, lyrics in map(split_lyrics, captions)
            ),
            strict=True,
        )
        tokenizer = tokenizers["tokenizer"]
        text_ids = tokenizer(list(texts), truncation=True, max_length=TEXT_TOKENS).input_ids
        lyric_ids = tokenizer(list(lyrics), truncation=True, max_length=LYRIC_TOKENS).input_ids
        return {
            "text_encoder": padded_token_ids(text_ids, TEXT_TOKENS),
            "condition_encoder": padded_token_ids(lyric_ids, LYRIC_TOKENS),
        }

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The condition encoder's sequence at each caption's own tokens (zero-padded after them, with their mask),
        and the silence latents the transformer's context reads, as the pipeline makes both."""
        encoder, conditions = components.text_encoders["text_encoder"], components.text_encoders["condition_encoder"]
        text, text_mask = _trimmed(token_ids["text_encoder"])
        lyrics, lyric_mask = _trimmed(token_ids["condition_encoder"])
        text_states = encoder(input_ids=text.masked_fill(~text_mask, 0)).last_hidden_state  # unmasked, as the pipeline
        lyric_states = encoder.get_input_embeddings()(lyrics.masked_fill(~lyric_mask, 0))
        batch, silence = len(text), conditions.silence_latent
        timbre_frames = math.ceil(TIMBRE_SECONDS * components.samples_per_second / components.pixels_per_latent)
        states, mask = conditions(
            text_hidden_states=text_states,
            text_attention_mask=text_mask,
            lyric_hidden_states=lyric_states,
            lyric_attention_mask=lyric_mask,
            refer_audio_acoustic_hidden_states_packed=silence[:, :timbre_frames].to(text_states).expand(batch, -1, -1),
            refer_audio_order_mask=torch.arange(batch, device=text_states.device),
        )
        # A dropped (empty) caption is the learned null condition over its sequence, as ACE-Step's trainer drops its
        # conditions and its pipeline guides against them.
        empty = self.tokenize(components.tokenizers, [""], seconds=components.family_options.seconds)["text_encoder"]
        dropped = (token_ids["text_encoder"] == empty.to(token_ids["text_encoder"].device)).all(dim=1)
        null = conditions.null_condition_emb.to(states)
        states = torch.where(dropped[:, None, None] & mask.bool()[..., None], null, states)
        frames = math.ceil(
            components.family_options.seconds * components.samples_per_second / components.pixels_per_latent
        )
        return valid_token_states(states, mask.bool(), 0, CONDITION_TOKENS) | {
            "silence": silence[0, :frames].to(states).expand(batch, -1, -1)
        }

    def encoder_tokenizers(self) -> list[tuple[str, str]]:
        return [("text_encoder", "tokenizer"), ("condition_encoder", "tokenizer")]


def _trimmed(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded ids cut to the batch's longest (the pipeline pads to it) and their mask."""
    mask = ids != NO_TOKEN
    longest = int(mask.sum(dim=1).max())
    return ids[:, :longest], mask[:, :longest]


class AceStep(FlowMatchingFamily):
    name = "ace_step"
    layout = AceStepLayout()
    loading = AceStepLoading()
    conditioning = AceStepConditioning()
    drawing = AceStepDrawing()
    targets = AceStepTargets()
    description = "ACE-Step"
    pipeline_class = AceStepPipeline
    pipeline_classes = ("AceStepPipeline",)
    denoiser_class = AceStepTransformer1DModel
    denoiser_name = "transformer"
    text_encoder_names = ("text_encoder", "condition_encoder")  # the condition encoder turns them into one sequence
    tokenizer_names = ("tokenizer",)
    # What turns a source sound into codes and back (the pipeline's cover task): never read by text-to-music
    fixed_pipeline_arguments = {"audio_tokenizer": None, "audio_token_detokenizer": None}
    block_lists = ("layers",)
    options_model = AceStepOptions
    objective = FlowMatching(lambda components, tokens: SAMPLING_SHIFT)
    reads_sound = True

    def unsupported_settings(self, config: Config) -> list[str]:
        if config.sample.negative_prompt:
            return ["sample.negative_prompt: its pipeline guides against a learned null condition; leave it empty"]
        return []

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.audio_acoustic_hidden_dim

    def image_tokens(self, latents: torch.Tensor) -> int:
        return latents.shape[-1] // self.patch_size  # 2-frame patches of a sound

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """Sounds' latents (B, C, 1, frames) as the pipeline reads them, (B, frames, C), beside their context; each
        sample's conditioning at its own length (the transformer masks none), one call per length."""
        states, silence = conditioning["encoder_hidden_states"], conditioning["silence"]
        sounds = noisy[:, :, 0].transpose(1, 2).to(states.dtype)
        frames = sounds.shape[1]
        context = torch.cat([silence[:, :frames], torch.ones_like(silence[:, :frames])], dim=-1)
        time = (timesteps / 1000).to(states.dtype)
        lengths = conditioning["text_mask"].sum(dim=1).long()
        prediction = torch.empty_like(sounds)
        for length in sorted(set(lengths.tolist())):
            rows = (lengths == length).nonzero().flatten()
            prediction[rows] = components.denoiser(
                hidden_states=sounds[rows],
                timestep=time[rows],
                timestep_r=time[rows],
                encoder_hidden_states=states[rows, :length],
                context_latents=context[rows],
                return_dict=False,
            )[0]
        return prediction.transpose(1, 2)[:, :, None]

    # Sampling.

    def max_sequence_length(self, components: Components) -> int:
        return TEXT_TOKENS


FAMILY = AceStep()
