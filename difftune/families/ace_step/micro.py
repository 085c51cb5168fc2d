"""Micro ACE-Step: a Qwen3 text encoder, ACE-Step's condition encoder and transformer over a small Oobleck autoencoder
(6.4 kHz stereo, 200 latent frames a second)."""

import torch
from diffusers import AceStepPipeline, AceStepTransformer1DModel, AutoencoderOobleck, FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.ace_step.modeling_ace_step import AceStepConditionEncoder

from difftune.toy.micro import MicroSizes
from difftune.toy.tiny import QWEN_HIDDEN_SIZE, build_qwen3_text_encoder, build_qwen3_tokenizer

SAMPLE_RATE = 6400  # samples a second: tones and their third harmonics (toy/tones.py) up to 3.2 kHz
# 32 samples a latent frame: 200 frames a second. A hop of 128 (ACE-Step's 25 a second at 6.4 kHz) left the tiny
# base's autoencoder, trained for minutes, unable to make tones again (none judged right after 600 steps at width 32).
DOWNSAMPLING = (2, 4, 4)
LATENT_CHANNELS = 8
HEAD_DIM = 16
SLIDING_WINDOW = 16  # latent patches a sliding layer sees either side (ACE-Step's 128, at its 12.5 a second)


def autoencoder(pixels) -> AutoencoderOobleck:
    """Stable Audio's kind of autoencoder at micro size (the shapes' `pixels` say nothing of sound: unused)."""
    return sound_autoencoder()


def sound_autoencoder(decoder_channels: int = 8) -> AutoencoderOobleck:
    """Stable Audio's kind of autoencoder at toy size: `decoder_channels` wide at its widest (the tiny base's is
    wider than the micro's)."""
    return AutoencoderOobleck(
        encoder_hidden_size=2 * LATENT_CHANNELS,  # the posterior's mean and scale
        downsampling_ratios=list(DOWNSAMPLING),
        channel_multiples=[1, 2, 4],
        decoder_channels=decoder_channels,
        decoder_input_channels=LATENT_CHANNELS,
        audio_channels=2,
        sampling_rate=SAMPLE_RATE,
    )


def pipeline(vae: AutoencoderOobleck, sizes: MicroSizes) -> AceStepPipeline:
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_qwen3_tokenizer()
    text_encoder = build_qwen3_text_encoder(tokenizer, width)
    condition_encoder = build_condition_encoder(width, heads=sizes.dit_heads)
    condition_encoder.silence_latent.copy_(silence_latents(vae, condition_encoder.silence_latent.shape[1]))
    return AceStepPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=build_transformer(sizes.dit_layers or 2, heads=sizes.dit_heads, width=width),
        condition_encoder=condition_encoder,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1, shift=1.0),  # the pipeline shifts its sigmas
    )


def silence_latents(vae: AutoencoderOobleck, frames: int) -> torch.Tensor:
    """What ACE-Step's condition encoder keeps as its learned silence (1, frames, C): the autoencoder's encoding of
    silence, as ACE-Step's is (a short silence's steady middle frame repeated: away from its edges silence encodes
    alike everywhere)."""
    with torch.no_grad():
        silence = torch.zeros(1, vae.config.audio_channels, 16 * vae.hop_length)
        middle = vae.encode(silence).latent_dist.mean[:, :, 8:9]
    return middle.transpose(1, 2).repeat(1, frames, 1)


def build_condition_encoder(text_width: int, heads: int = 2, layers: int = 1) -> AceStepConditionEncoder:
    """The lyric and timbre encoders (`layers` each) and the caption's projection, into the transformer's width."""
    return AceStepConditionEncoder(
        hidden_size=heads * HEAD_DIM,
        intermediate_size=4 * heads * HEAD_DIM,
        text_hidden_dim=text_width,
        timbre_hidden_dim=LATENT_CHANNELS,
        num_lyric_encoder_hidden_layers=layers,
        num_timbre_encoder_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        sliding_window=SLIDING_WINDOW,
    )


def build_transformer(layers: int = 2, heads: int = 2, width: int = QWEN_HIDDEN_SIZE) -> AceStepTransformer1DModel:
    """`layers` blocks (sliding and full attention in turn, as ACE-Step's), over 2-frame patches of the latents beside
    their context (silence latents and a mask: twice the channels)."""
    return AceStepTransformer1DModel(
        hidden_size=heads * HEAD_DIM,
        intermediate_size=4 * heads * HEAD_DIM,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=HEAD_DIM,
        in_channels=3 * LATENT_CHANNELS,
        audio_acoustic_hidden_dim=LATENT_CHANNELS,
        patch_size=2,
        sliding_window=SLIDING_WINDOW,
        encoder_hidden_size=heads * HEAD_DIM,
    )
