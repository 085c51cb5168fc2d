"""What the families' real-width models (`real_width_pipeline` in their micro modules, for toy/bench.py) share: CLIP
text encoders and SD's autoencoder at their published widths, random weights, over the character-level tokenizer built
here (a small vocabulary, whose embedding table does not change a step's time)."""

from __future__ import annotations

from diffusers import AutoencoderKL
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from difftune.toy import tiny


def clip_text_encoder(hidden: int, layers: int, heads: int, act: str, projection: int | None = None):
    config = CLIPTextConfig(
        vocab_size=49408,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=77,
        hidden_act=act,
        projection_dim=projection or 512,
    )
    return CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)


def sd_autoencoder(scaling_factor: float, latent_channels: int = 4, **config) -> AutoencoderKL:
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512),
        layers_per_block=2,
        latent_channels=latent_channels,
        sample_size=512,
        scaling_factor=scaling_factor,
        **config,
    )


def clip_tokenizer():
    tokenizer = tiny.build_tokenizer()
    tokenizer.model_max_length = 77
    return tokenizer
