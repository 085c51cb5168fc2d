"""Micro MiniMax-H3: its transformer over its video autoencoder at 4x in space (the real one: 16x; the clip geometry,
17n + 5 frames to 5n + 2 latent frames, the real one's), its audio autoencoder at 32 kHz and 40 latents a second (the
real hop, narrow layers), and a Qwen3-VL language model of 51 narrow layers (the pipeline reads layer 50), in
MiniMax-H3's modular pipeline's text-to-video workflow."""

from diffusers import (
    AutoencoderKLMiniMaxH3,
    AutoencoderKLMiniMaxH3Audio,
    MiniMaxH3Scheduler,
    MiniMaxH3Transformer3DModel,
)

from difftune.families.minimax_h3 import TEXT_LAYER
from difftune.toy.micro import MicroSizes
from difftune.toy.micro._latent_statistics import with_latent_statistics
from difftune.toy.tiny import QWEN_HIDDEN_SIZE, build_qwen3_vl_processor, build_qwen3_vl_text_encoder

LATENT_CHANNELS = 8
SOUND_CHANNELS = 8


def autoencoder(pixels):
    return with_latent_statistics(build_minimax_h3_vae(), pixels)


def build_minimax_h3_vae(latent_channels: int = LATENT_CHANNELS) -> AutoencoderKLMiniMaxH3:
    """Two downsamplings in space and two in time (4x each; chunks of 17 frames keep 5 latent frames, 3 dropped), a
    one-block ViT decoder."""
    return AutoencoderKLMiniMaxH3(
        latent_channels=latent_channels,
        block_out_channels=(8, 16),
        layers_per_block=1,
        spatial_downsample_factors=(2, 2),
        temporal_downsample_factors=(2, 2),
        norm_num_groups=4,
        decoder_num_layers=1,
        decoder_num_attention_heads=2,
        decoder_attention_head_dim=8,
        decoder_num_register_tokens=1,
        latents_mean=(0.0,) * latent_channels,
        latents_std=(1.0,) * latent_channels,
    )


def build_minimax_h3_audio_vae(latent_channels: int = SOUND_CHANNELS) -> AutoencoderKLMiniMaxH3Audio:
    """The real hop (800 samples at 32 kHz) in four decoder stages, narrow; per-channel statistics 0 and 1."""
    return AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4,
        latent_dim=32,
        latent_channels=latent_channels,
        num_attention_heads=2,
        decoder_dim=32,
        decoder_rates=(5, 5, 4, 8),
        decoder_kernel_sizes=(9, 9, 8, 16),
        resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1,),),
        latents_mean=[0.0] * latent_channels,
        latents_std=[1.0] * latent_channels,
    )


def build_minimax_h3_transformer(layers: int = 2, heads: int = 2, text_width: int = QWEN_HIDDEN_SIZE):
    """`layers` blocks after a one-block token refiner, width 32, heads of 32 (as the real model, wider than the
    width), rotary axes of 4 frequencies each."""
    return MiniMaxH3Transformer3DModel(
        num_attention_heads=heads,
        attention_head_dim=32,
        hidden_size=32,
        num_layers=layers,
        num_refiner_layers=1,
        ffn_dim=64,
        in_channels=LATENT_CHANNELS,
        audio_in_channels=SOUND_CHANNELS,
        text_dim=text_width,
        freq_dim=32,
        time_embed_hidden_dim=32,
        time_embed_dim=16,
        rope_freq_dim=4,
    )


def pipeline(vae, sizes: MicroSizes):
    from difftune.families import FAMILIES

    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    processor = build_qwen3_vl_processor("")
    text_encoder = build_qwen3_vl_text_encoder(processor.tokenizer, width, layers=TEXT_LAYER + 1, with_head=True)
    modular = FAMILIES["minimax_h3"].loading.modular_pipeline()
    modular.update_components(
        vae=vae,
        audio_vae=build_minimax_h3_audio_vae(),
        text_encoder=text_encoder,
        tokenizer=processor.tokenizer,
        processor=processor,
        transformer=build_minimax_h3_transformer(sizes.dit_layers or 2, sizes.dit_heads, width),
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
    )
    return modular
