"""Micro HunyuanImage 2.1: a 3-layer Qwen2.5-VL language model (the pipeline reads its third-to-last state), a ByT5
encoder for quoted text, and a HunyuanImage transformer over a 4x autoencoder of its kind, scaled by its latents' std
(the real one: 64 channels at 32x)."""

from diffusers import AutoencoderKLHunyuanImage, FlowMatchEulerDiscreteScheduler, HunyuanImageTransformer2DModel

from difftune.families.hunyuan_image import HunyuanImageLoraPipeline
from difftune.families.qwen_image.micro import build_qwen_tokenizer
from difftune.toy.micro import MicroSizes
from difftune.toy.micro._kl import scaled_to
from difftune.toy.tiny import (
    FLUX_LATENT_CHANNELS,
    IMAGE_SIZE,
    QWEN_HIDDEN_SIZE,
    T5_HIDDEN_SIZE,
    build_byt5_tokenizer,
    build_qwen_text_encoder,
    build_t5_encoder,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "hunyuan_image_2048_lora.toml"
JOB_ON_MICRO = True
TEXT_LAYERS = 3  # the pipeline reads the third-to-last layer's states: 3 layers give it one layer below


def autoencoder(pixels):
    return scaled_to(build_hunyuan_image_vae(), pixels, shift=False)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer, glyph_tokenizer = build_qwen_tokenizer(), build_byt5_tokenizer()
    return HunyuanImageLoraPipeline(
        vae=vae,
        text_encoder=build_qwen_text_encoder(tokenizer, width, layers=TEXT_LAYERS),
        tokenizer=tokenizer,
        text_encoder_2=build_t5_encoder(len(glyph_tokenizer)),
        tokenizer_2=glyph_tokenizer,
        transformer=build_hunyuan_image_transformer(sizes.flux_layers, sizes.flux_heads, text_hidden_size=width),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),  # HunyuanImage 2.1's: one shift at every size
    )


def build_hunyuan_image_vae(latent_channels: int = FLUX_LATENT_CHANNELS) -> AutoencoderKLHunyuanImage:
    """HunyuanImage 2.1's autoencoder kind at 4x (its real one: 64 channels at 32x), scaling set by its caller."""
    return AutoencoderKLHunyuanImage(
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        block_out_channels=(32, 64, 64),
        layers_per_block=1,
        spatial_compression_ratio=4,
        sample_size=IMAGE_SIZE,
        scaling_factor=1.0,
    )


def build_hunyuan_image_transformer(
    layers: tuple[int, int] = (1, 1),
    heads: int = 2,
    head_dim: int = 16,
    text_hidden_size: int = QWEN_HIDDEN_SIZE,
    glyph_hidden_size: int = T5_HIDDEN_SIZE,
) -> HunyuanImageTransformer2DModel:
    """`layers` (double-stream, single-stream) HunyuanImage blocks over 16-channel latents, one token a latent pixel,
    a one-block token refiner of the language model's states and a ByT5 projection; the rotary axes split the head
    in two (row, column) as HunyuanImage 2.1's 64:64."""
    return HunyuanImageTransformer2DModel(
        in_channels=FLUX_LATENT_CHANNELS,
        out_channels=FLUX_LATENT_CHANNELS,
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        num_layers=layers[0],
        num_single_layers=layers[1],
        num_refiner_layers=1,
        patch_size=(1, 1),
        text_embed_dim=text_hidden_size,
        text_embed_2_dim=glyph_hidden_size,
        rope_axes_dim=(head_dim // 2, head_dim // 2),
    )
