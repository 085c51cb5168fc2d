"""Micro LTX-2: a 2-layer Gemma 3 (with a tiny SigLIP tower, as the real `Gemma3ForConditionalGeneration`) whose every
hidden state the text connectors read, an audio-video transformer over a causal video autoencoder of LTX-2's kind at 4x
in space and time (the real one: 32x and 8x), its latents' per-channel statistics those of the shapes, and the audio
autoencoder and vocoder its pipeline draws sound with."""

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._latent_statistics import with_latent_statistics
from difftune.toy.tiny import (
    QWEN_HIDDEN_SIZE,
    build_gemma3_text_encoder,
    build_llama_tokenizer,
    build_ltx2_parts,
    build_ltx2_vae,
)

# The family's text-to-video job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "ltx2_lora.toml"
JOB_ON_MICRO = True
TEXT_LAYERS = 2


def autoencoder(pixels):
    vae = build_ltx2_vae()
    with torch.no_grad():
        # The encoder's last output channel is the posterior's log-variance (one for all channels): a trained
        # autoencoder's posterior is nearly a point, a random one's as wide as its means are apart.
        vae.encoder.conv_out.conv.bias[-1] = -12.0
    return with_latent_statistics(vae, pixels)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_llama_tokenizer()
    text_encoder = build_gemma3_text_encoder(tokenizer, width, layers=TEXT_LAYERS)
    parts = build_ltx2_parts(
        width,
        TEXT_LAYERS,
        layers=sizes.dit_layers or 1,
        heads=sizes.dit_heads,
        latent_channels=vae.config.latent_channels,
    )
    # LTX-2's schedule, as diffusers' conversion script writes the base model's: a dynamic shift over a clip's tokens.
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
    )
    return LTX2Pipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler, **parts)
