"""Micro LTX-2: a 2-layer Gemma 3 (with a tiny SigLIP tower, as the real `Gemma3ForConditionalGeneration`) whose every
hidden state the text connectors read, an audio-video transformer over a causal video autoencoder of LTX-2's kind at 4x
in space and time (the real one: 32x and 8x), its latents' per-channel statistics those of the shapes, and the audio
autoencoder and vocoder its pipeline draws sound with."""

import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

from difftune.families.wan.micro import TINY_BASE as WAN_TINY_BASE
from difftune.toy.micro import MicroSizes, TinyBase
from difftune.toy.micro._latent_statistics import with_latent_statistics
from difftune.toy.tiny import QWEN_HIDDEN_SIZE, build_llama_tokenizer

# The family's text-to-video job for the real model in configs/ (`scripts/family_jobs.py` sweeps settings over them);
# CI runs it as shipped on this micro model (the tiny base's own job, ltx2_lora.toml, is in the quality test).
SHIPPED_JOB = "ltx2_512_lora.toml"
JOB_ON_MICRO = True
TEXT_LAYERS = 2


def narrow_posterior(vae):
    """`vae` with its posterior nearly a point: the encoder's last output channel is the posterior's log-variance (one
    for all channels); a trained autoencoder's is small, a random one's as wide as its means are apart."""
    with torch.no_grad():
        vae.encoder.conv_out.conv.bias[-1] = -12.0
    return vae


def autoencoder(pixels):
    return with_latent_statistics(narrow_posterior(build_ltx2_vae()), pixels)


def tiny_base_autoencoder():
    """tiny-ltx2's autoencoder at its init: 16 channels, blocks of 32 and 64, its posterior narrow from the start."""
    return narrow_posterior(build_ltx2_vae(latent_channels=16, channels=(32, 64)))


# tiny-ltx2: LTX-2's architecture over tiny-wan's 32 px clips of 5 frames. Its autoencoder is LTX-2's kind at 4x in
# space and time (a clip's latents: 2 frames of 8 x 8), 16 channels, trained on clips from its random init with its
# posterior narrow from the start (there is no still-image autoencoder of its kind to start from, as tiny-wan's started
# from tiny-qwen_image's): 1000 steps drew clips back at 24.5 dB. Its transformer's video stream has 4 blocks of 16
# heads of 8 (width 128, tiny-wan's); the stream between video and audio is as wide as 2 rope values per video head
# need. Gemma 3 and the text connectors stay at their random init, their states cached, as tiny-wan's UMT5. Captions
# are read at 64 tokens (the tokenizer's `model_max_length`; the pipeline's 1024 made a step 2.4 s at batch 64, the
# K/V projections of the padding dominating; 64: 0.77 s). Clips per (color, shape, direction): 40 to train on, 2 to
# validate, as tiny-wan's. 4000 steps: validation loss (EMA) 0.2569 at 2500 (the first build's count, seen shapes
# 0.931), 0.2487 at 4000, still falling slowly (seen shapes 0.948). The committed base then trained 3000 steps more
# from its saved weights (`make_tiny_base.py --family ltx2 --continue-steps 3000`, lr 0.002, 69 minutes): 0.2429,
# seen shapes 0.971 -> 0.992, and its job's purple squares at seeds 0-2 0.93 / 0.90 / 0.82 -> 0.90 / 0.95 / 0.95.
TINY_BASE = TinyBase(
    architecture=(
        "LTX-2's architecture at toy size, from the same classes (`LTX2VideoTransformer3DModel`, its video\n"
        "stream over every latent pixel of LTX-2's causal video autoencoder `AutoencoderKLLTX2Video`, with its audio\n"
        "stream, `AutoencoderKLLTX2Audio` and `LTX2Vocoder` beside it at their random init; a\n"
        "`Gemma3ForConditionalGeneration` read through the pipeline's `LTX2TextConnectors`)"
    ),
    denoiser=lambda recipe: f"transformer ({recipe.dit_layers} LTX-2 blocks, video width {recipe.dit_heads * 8})",
    # tiny-wan's recipe (its batch, blocks, frozen text encoder and clips), with these changes:
    # and a decoder phase: after the first build (4000 steps) the autoencoder alone named squares right in 0.875 of
    # frames (24.5 dB); its decoder trained alone for 1500 steps brought that to 1.000 (31.8 dB; 600 steps: 0.96 at
    # 26.6 dB), the latents unchanged.
    recipe=WAN_TINY_BASE.recipe
    | {"steps": 4000, "dit_heads": 16, "text_tokens": 64, "vae_steps": 1000, "vae_decoder_steps": 1500},
    clip_autoencoder=tiny_base_autoencoder,
    text_note="The text encoder is Gemma 3, with the pipeline's text connectors, at their random init (their states "
    "tell the\ncaptions apart; training caches them).",
)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_llama_tokenizer()
    if sizes.text_tokens:  # a tiny base's captions: a few dozen bytes, not the pipeline's 1024 tokens
        tokenizer.model_max_length = sizes.text_tokens
    text_encoder = build_gemma3_text_encoder(tokenizer, width, layers=TEXT_LAYERS)
    parts = build_ltx2_parts(
        width,
        TEXT_LAYERS,
        layers=sizes.dit_layers or 1,
        heads=sizes.dit_heads,
        latent_channels=vae.config.latent_channels,
    )
    scheduler = build_ltx2_scheduler()
    return LTX2Pipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler, **parts)


def build_ltx2_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """LTX-2's schedule, as diffusers' conversion script writes the base model's: a dynamic shift over a clip's
    tokens."""
    return FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
    )


def build_ltx2_parts(
    text_width: int,
    text_layers: int,
    layers: int = 1,
    heads: int = 2,
    latent_channels: int = 8,
    connector_options: dict | None = None,
    transformer_options: dict | None = None,
):
    """LTX-2's text connectors (with learnable registers in the padding, as the real ones), its audio-video
    transformer (a video stream of `heads` x 8 and an audio stream of 2 x 2 `heads`), its audio autoencoder
    (2-channel mel spectrograms of 8 bins) and its vocoder, as diffusers' own LTX-2 tests build them small; the
    connectors' and the transformer's arguments updated by `connector_options` and `transformer_options` (a later
    generation's configuration)."""
    connectors = LTX2TextConnectors(
        **{
            "caption_channels": text_width,
            "text_proj_in_factor": text_layers + 1,  # every hidden state, the embeddings' too
            "video_connector_num_attention_heads": 2,
            "video_connector_attention_head_dim": text_width // 2,
            "video_connector_num_layers": 1,
            "video_connector_num_learnable_registers": 8,
            "audio_connector_num_attention_heads": 2,
            "audio_connector_attention_head_dim": text_width // 2,
            "audio_connector_num_layers": 1,
            "audio_connector_num_learnable_registers": 8,
            "connector_rope_base_seq_len": 32,
            "rope_double_precision": False,
            "causal_temporal_positioning": False,
            "rope_type": "split",
        }
        | (connector_options or {})
    )
    transformer = LTX2VideoTransformer3DModel(
        **{
            "in_channels": latent_channels,
            "out_channels": latent_channels,
            "num_attention_heads": heads,
            "attention_head_dim": 8,
            "cross_attention_dim": heads * 8,
            "audio_in_channels": 4,
            "audio_out_channels": 4,
            # The rope of the attention between the streams spans the audio width and splits over the video heads (2
            # per head at least): the audio stream widens with them (2 x 4 beside 2 video heads).
            "audio_num_attention_heads": 2,
            "audio_attention_head_dim": 2 * heads,
            "audio_cross_attention_dim": 4 * heads,
            "num_layers": layers,
            "caption_channels": text_width,
            "vae_scale_factors": (4, 4, 4),
            "rope_double_precision": False,
            "rope_type": "split",
        }
        | (transformer_options or {})
    )
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1, 2, 4),  # 4x in time and mel bins, as the pipeline takes it: 8 bins -> 2 x 2 latent channels
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=8,
    )
    vocoder = LTX2Vocoder(
        in_channels=2 * 8,
        hidden_channels=32,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000,
    )
    return {"connectors": connectors, "transformer": transformer, "audio_vae": audio_vae, "vocoder": vocoder}


def build_ltx2_vae(latent_channels: int = 8, channels: tuple[int, int] = (8, 16)) -> AutoencoderKLLTX2Video:
    """LTX-2's causal video autoencoder at 4x in space and time (the real one: 32x and 8x, 128 channels), its two
    blocks `channels` wide."""
    return AutoencoderKLLTX2Video(
        latent_channels=latent_channels,
        block_out_channels=channels,
        decoder_block_out_channels=channels,
        layers_per_block=(1, 1, 1),
        decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, True),
        decoder_spatio_temporal_scaling=(True, True),
        decoder_inject_noise=(False, False, False),
        downsample_type=("spatiotemporal", "spatiotemporal"),
        upsample_type=("spatiotemporal", "spatiotemporal"),
        upsample_residual=(False, False),
        upsample_factor=(1, 1),
        patch_size=1,
        decoder_causal=False,
    )


def gemma_text_sizes(tokenizer, hidden_size: int, layers: int) -> dict:
    """A micro Gemma's text model (3's and 4's config classes alike): `layers` layers `hidden_size` wide, 2 heads over
    1 key/value head, a window of 16 tokens."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": hidden_size // 2,
        "max_position_embeddings": 2048,
        "sliding_window": 16,
        "pad_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def build_gemma3_text_encoder(tokenizer, hidden_size: int = QWEN_HIDDEN_SIZE, layers: int = 2):
    """A Gemma 3 model with its (tiny) SigLIP vision tower, as LTX-2's text encoder is one
    (`Gemma3ForConditionalGeneration`); its pipeline reads every layer's states of the text alone."""
    text = Gemma3TextConfig(**gemma_text_sizes(tokenizer, hidden_size, layers))
    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    return Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=1))
