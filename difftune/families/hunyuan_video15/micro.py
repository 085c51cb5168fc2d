"""Micro HunyuanVideo 1.5: a 3-layer Qwen2.5-VL language model (the pipeline reads its third-to-last state), a ByT5
encoder for quoted text, and a HunyuanVideo 1.5 transformer over a 4x causal video autoencoder of its kind, scaled by
its latents' std (the real one: 32 channels at 16x). Its tokenizer spells the system message in whole words, so the
pipeline's fixed 108 dropped tokens end inside it: the micro model reads the message's last words before the caption.
"""

from diffusers import (
    AutoencoderKLHunyuanVideo15,
    ClassifierFreeGuidance,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15Transformer3DModel,
)
from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, Qwen2Tokenizer

from difftune.families.hunyuan_video15 import HunyuanVideo15
from difftune.families.qwen_image.micro import build_qwen_tokenizer
from difftune.toy import tiny
from difftune.toy.micro import MicroSizes
from difftune.toy.micro._kl import scaled_to
from difftune.toy.tiny import (
    FLUX_LATENT_CHANNELS,
    QWEN3_VL_CHAT_TEMPLATE,
    QWEN_HIDDEN_SIZE,
    QWEN_SPECIAL_TOKENS,
    T5_HIDDEN_SIZE,
    _extended,
    build_byt5_tokenizer,
    build_t5_encoder,
)

# The family's text-to-video job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "hunyuan_video15_lora.toml"
JOB_ON_MICRO = True
TEXT_LAYERS = 3  # the pipeline reads the third-to-last layer's states: 3 layers give it one layer below


def autoencoder(pixels):
    return scaled_to(build_hunyuan_video15_vae(), pixels, shift=False)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer, glyph_tokenizer = build_hunyuan_video15_tokenizer(), build_byt5_tokenizer()
    return HunyuanVideo15.pipeline_class(
        vae=vae,
        text_encoder=build_qwen_language_model(tokenizer, width, layers=TEXT_LAYERS),
        tokenizer=tokenizer,
        text_encoder_2=build_t5_encoder(len(glyph_tokenizer)),
        tokenizer_2=glyph_tokenizer,
        transformer=build_hunyuan_video15_transformer(sizes.dit_layers or 1, sizes.dit_heads, text_hidden_size=width),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),  # the 480p models'
        guider=ClassifierFreeGuidance(guidance_scale=6.0),  # the published folders'
    )


def build_hunyuan_video15_transformer(
    layers: int = 1,
    heads: int = 2,
    head_dim: int = 16,
    text_hidden_size: int = QWEN_HIDDEN_SIZE,
    glyph_hidden_size: int = T5_HIDDEN_SIZE,
    latent_channels: int = FLUX_LATENT_CHANNELS,
) -> HunyuanVideo15Transformer3DModel:
    """`layers` HunyuanVideo 1.5 double-stream blocks, one token a latent pixel, reading the noisy latents, a
    conditioning clip and its mask (2C + 1 channels), a one-block token refiner of the language model's states, a ByT5
    projection and an image-state projection; the rotary axes split the head (time, row, column) as its 16:56:56."""
    return HunyuanVideo15Transformer3DModel(
        in_channels=2 * latent_channels + 1,
        out_channels=latent_channels,
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        num_layers=layers,
        num_refiner_layers=1,
        text_embed_dim=text_hidden_size,
        text_embed_2_dim=glyph_hidden_size,
        image_embed_dim=16,
        rope_axes_dim=(head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8),
    )


def build_hunyuan_video15_vae(latent_channels: int = FLUX_LATENT_CHANNELS) -> AutoencoderKLHunyuanVideo15:
    """HunyuanVideo 1.5's causal video autoencoder kind with three blocks: 4x in space (its real one: 16x, 32
    channels) and 4x in time (clips of 4k + 1 frames); scaling set by its caller."""
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=latent_channels,
        block_out_channels=(16, 32, 2 * latent_channels),
        layers_per_block=1,
        spatial_compression_ratio=4,
        temporal_compression_ratio=4,
        scaling_factor=1.0,
    )
    vae.enable_slicing()  # one clip at a time (see families/hunyuan_video15/)
    return vae


def build_hunyuan_video15_tokenizer() -> Qwen2Tokenizer:
    """`build_qwen_tokenizer`'s, with merges that spell the words of HunyuanVideo 1.5's system message, and the chat
    template its pipeline applies (Qwen2.5-VL's renders text turns as Qwen3-VL's does)."""
    from difftune.families.hunyuan_video15 import SYSTEM_MESSAGE

    tokenizer = _extended(build_qwen_tokenizer(), SYSTEM_MESSAGE, QWEN_SPECIAL_TOKENS)
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    return tokenizer


def build_qwen_language_model(
    tokenizer: Qwen2Tokenizer, hidden_size: int = tiny.QWEN_HIDDEN_SIZE, layers: int = 2
) -> Qwen2_5_VLTextModel:
    """`build_qwen_text_encoder`'s language model alone (HunyuanVideo 1.5's text encoder is Qwen2.5-VL's without its
    vision tower)."""
    return Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**tiny.qwen_text_config(len(tokenizer), hidden_size, layers)))
