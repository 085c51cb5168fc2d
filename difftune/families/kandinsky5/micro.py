"""Micro Kandinsky 5 (text-to-image): a Qwen2.5-VL language model read through a Qwen2-VL processor, a CLIP text
model for the pooled condition, and a Kandinsky 5 transformer over a Flux.1-kind 16-channel autoencoder that
downsamples 8x (the pipeline assumes its real 8)."""

import torch
from diffusers import Kandinsky5T2IPipeline, Kandinsky5Transformer3DModel
from transformers import Qwen2Tokenizer

from difftune.families.kandinsky5 import CLIP_TOKENS
from difftune.families.qwen_image.micro import build_qwen_tokenizer
from difftune.toy.micro import MicroSizes
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.tiny import (
    FLUX_LATENT_CHANNELS,
    QWEN_HIDDEN_SIZE,
    QWEN_SPECIAL_TOKENS,
    TEXT_HIDDEN_SIZE,
    _extended,
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


def build_kandinsky5_tokenizer(template: str | None = None) -> Qwen2Tokenizer:
    """`build_qwen_tokenizer`'s, with merges that spell the words of a Kandinsky 5 prompt template too (`template`;
    None: the image models', whose system prompt is then 40 tokens, as in Qwen2.5-VL's own vocabulary)."""
    from difftune.families.kandinsky5 import PROMPT_TEMPLATE

    return _extended(build_qwen_tokenizer(), template or PROMPT_TEMPLATE, QWEN_SPECIAL_TOKENS)


def build_kandinsky5_transformer(
    layers: tuple[int, int] = (1, 1),
    heads: int = 2,
    head_dim: int = 16,
    text_hidden_size: int = 32,
    pooled_size: int = 64,
    visual_cond: bool = False,
) -> Kandinsky5Transformer3DModel:
    """`layers` (text, visual) Kandinsky 5 blocks over 2x2 patches of 16-channel latents, reading a language model's
    states and a CLIP's pooled output; 3-D rotary axes (time, rows, columns) over each head; `visual_cond`: reading a
    conditioning clip and its mask beside the noisy one (the video models'). Its class starts every
    modulation at zero (a trained model's are not): drawn at random here, so the micro model's prediction depends on
    its time and its text."""
    model = Kandinsky5Transformer3DModel(
        in_visual_dim=FLUX_LATENT_CHANNELS,
        out_visual_dim=FLUX_LATENT_CHANNELS,
        in_text_dim=text_hidden_size,
        in_text_dim2=pooled_size,
        time_dim=16,
        model_dim=heads * head_dim,
        ff_dim=2 * heads * head_dim,
        num_text_blocks=layers[0],
        num_visual_blocks=layers[1],
        axes_dims=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8),
        visual_cond=visual_cond,
    )
    for name, parameter in model.named_parameters():
        if "modulation.out_layer" in name:
            torch.nn.init.normal_(parameter, std=0.02)
    return model
