"""Micro Kandinsky 5 (text-to-image): a Qwen2.5-VL language model read through a Qwen2-VL processor, a CLIP text
model for the pooled condition, and a Kandinsky 5 transformer over a Flux.1-kind 16-channel autoencoder that
downsamples 8x (the pipeline assumes its real 8)."""

from diffusers import Kandinsky5T2IPipeline

from difftune.families.kandinsky5 import CLIP_TOKENS
from difftune.toy.micro import MicroSizes
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.tiny import (
    QWEN_HIDDEN_SIZE,
    TEXT_HIDDEN_SIZE,
    build_kandinsky5_tokenizer,
    build_kandinsky5_transformer,
    build_qwen_processor,
    build_qwen_text_encoder,
    build_sd3_scheduler,
    build_text_encoder,
    build_tokenizer,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "kandinsky5_1024_lora.toml"
JOB_ON_MICRO = True


def autoencoder(pixels):
    return kl_autoencoder(pixels, sixteen_channels=True, downsampling=8)


def pipeline(vae, sizes: MicroSizes):
    return Kandinsky5T2IPipeline(vae=vae, **parts(sizes))


def parts(sizes: MicroSizes, template: str | None = None, visual_cond: bool = False) -> dict:
    """Every part but the autoencoder, for the image pipeline or (a `template` of its own, `visual_cond`) the video
    one."""
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_kandinsky5_tokenizer(template)
    return {
        "transformer": build_kandinsky5_transformer(
            sizes.flux_layers,
            sizes.flux_heads,
            text_hidden_size=width,
            pooled_size=TEXT_HIDDEN_SIZE,
            visual_cond=visual_cond,
        ),
        "text_encoder": build_qwen_text_encoder(tokenizer, width),
        "tokenizer": build_qwen_processor(tokenizer),
        "text_encoder_2": build_text_encoder(positions=CLIP_TOKENS),
        "tokenizer_2": build_tokenizer(),
        "scheduler": build_sd3_scheduler(),  # one shift (3) at every size
    }
