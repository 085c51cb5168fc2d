"""Micro Kandinsky 5 video: the image model's micro text encoders and transformer (reading a conditioning clip beside
the noisy one, as the Lite video models) over HunyuanVideo's causal video autoencoder. Its tokenizer spells the video
template's system prompt in 131 tokens (Qwen2.5-VL's: 128, which the pipeline drops): the micro model reads the
template's last 3 before the caption."""

import torch
from diffusers import Kandinsky5T2VPipeline

from difftune.families.kandinsky5 import CLIP_TOKENS
from difftune.families.kandinsky5_video import PROMPT_TEMPLATE
from difftune.models.autoencoders import encode_posterior
from difftune.toy.micro import MicroSizes
from difftune.toy.tiny import (
    QWEN_HIDDEN_SIZE,
    TEXT_HIDDEN_SIZE,
    build_hunyuan_video_vae,
    build_kandinsky5_tokenizer,
    build_kandinsky5_transformer,
    build_qwen_processor,
    build_qwen_text_encoder,
    build_sd3_scheduler,
    build_text_encoder,
    build_tokenizer,
    set_latent_scaling,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "kandinsky5_video_lora.toml"
JOB_ON_MICRO = True


def autoencoder(pixels):
    vae = build_hunyuan_video_vae()
    with torch.no_grad():
        set_latent_scaling(vae, encode_posterior(vae, pixels)[0], shift=False)
    return vae


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_kandinsky5_tokenizer(PROMPT_TEMPLATE)
    return Kandinsky5T2VPipeline(
        transformer=build_kandinsky5_transformer(
            sizes.flux_layers, sizes.flux_heads, text_hidden_size=width, pooled_size=TEXT_HIDDEN_SIZE, visual_cond=True
        ),
        vae=vae,
        text_encoder=build_qwen_text_encoder(tokenizer, width),
        tokenizer=build_qwen_processor(tokenizer),
        text_encoder_2=build_text_encoder(positions=CLIP_TOKENS),
        tokenizer_2=build_tokenizer(),
        scheduler=build_sd3_scheduler(),  # one shift at every size
    )
