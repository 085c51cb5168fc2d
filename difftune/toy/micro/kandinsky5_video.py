"""Micro Kandinsky 5 video: the image model's micro text encoders and transformer (reading a conditioning clip beside
the noisy one, as the Lite video models) over HunyuanVideo's causal video autoencoder. Its tokenizer spells the video
template's system prompt in 131 tokens (Qwen2.5-VL's: 128, which the pipeline drops): the micro model reads the
template's last 3 before the caption."""

import torch
from diffusers import Kandinsky5T2VPipeline

from difftune.families.kandinsky5_video import PROMPT_TEMPLATE
from difftune.models.autoencoders import encode_posterior
from difftune.toy.micro import MicroSizes
from difftune.toy.micro.kandinsky5 import parts
from difftune.toy.tiny import build_hunyuan_video_vae, set_latent_scaling

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
    return Kandinsky5T2VPipeline(vae=vae, **parts(sizes, PROMPT_TEMPLATE, visual_cond=True))
