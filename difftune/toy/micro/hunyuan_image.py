"""Micro HunyuanImage 2.1: a 3-layer Qwen2.5-VL language model (the pipeline reads its third-to-last state), a ByT5
encoder for quoted text, and a HunyuanImage transformer over a 4x autoencoder of its kind, scaled by its latents' std
(the real one: 64 channels at 32x)."""

from diffusers import FlowMatchEulerDiscreteScheduler

from difftune.families.hunyuan_image import HunyuanImageLoraPipeline
from difftune.toy.micro import MicroSizes
from difftune.toy.micro._kl import scaled_to
from difftune.toy.tiny import (
    QWEN_HIDDEN_SIZE,
    build_byt5_tokenizer,
    build_hunyuan_image_transformer,
    build_hunyuan_image_vae,
    build_qwen_text_encoder,
    build_qwen_tokenizer,
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
