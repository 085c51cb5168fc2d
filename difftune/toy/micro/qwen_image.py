"""Micro Qwen-Image: a Qwen2.5-VL language model and a Qwen-Image transformer over Qwen-Image's autoencoder; its
edit models' pipelines too (`pipeline`'s `edit`)."""

from diffusers import QwenImageEditPlusPipeline, QwenImagePipeline

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._latent_statistics import qwen_autoencoder
from difftune.toy.tiny import (
    QWEN_HIDDEN_SIZE,
    build_qwen_processor,
    build_qwen_scheduler,
    build_qwen_text_encoder,
    build_qwen_tokenizer,
    build_qwen_transformer,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them).
SHIPPED_JOB = "qwen_image_1024_lora.toml"


def autoencoder(pixels):
    return qwen_autoencoder(pixels)


def pipeline(vae, sizes: MicroSizes, edit_pipeline=None):
    """`edit_pipeline`: Qwen-Image-Edit's or Edit-Plus's class (their tokenizer shows images; Plus's transformer has
    2511's zero-conditioning time)."""
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_qwen_tokenizer(edit_pipeline is not None, sizes.caption_words)
    parts = {
        "vae": vae,
        "text_encoder": build_qwen_text_encoder(tokenizer, width),
        "tokenizer": tokenizer,
        "transformer": build_qwen_transformer(
            sizes.dit_layers or 1,
            sizes.dit_heads,
            text_hidden_size=width,
            zero_cond_t=edit_pipeline is QwenImageEditPlusPipeline,
        ),
        "scheduler": build_qwen_scheduler(),
    }
    if edit_pipeline is None:
        return QwenImagePipeline(**parts)
    return edit_pipeline(**parts, processor=build_qwen_processor(tokenizer))
