"""Micro HunyuanVideo 1.5: a 3-layer Qwen2.5-VL language model (the pipeline reads its third-to-last state), a ByT5
encoder for quoted text, and a HunyuanVideo 1.5 transformer over a 4x causal video autoencoder of its kind, scaled by
its latents' std (the real one: 32 channels at 16x). Its tokenizer spells the system message in whole words, so the
pipeline's fixed 108 dropped tokens end inside it: the micro model reads the message's last words before the caption.
"""

from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler

from difftune.families.hunyuan_video15 import HunyuanVideo15
from difftune.toy.micro import MicroSizes
from difftune.toy.micro._kl import scaled_to
from difftune.toy.tiny import (
    QWEN_HIDDEN_SIZE,
    build_byt5_tokenizer,
    build_hunyuan_video15_tokenizer,
    build_hunyuan_video15_transformer,
    build_hunyuan_video15_vae,
    build_qwen_language_model,
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
