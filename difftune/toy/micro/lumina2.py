"""Micro Lumina 2: a Gemma 2 text encoder and a Lumina 2 transformer over a 16-channel KL autoencoder that
downsamples 8x, with Lumina-Image 2.0's scheduler (one shift, 6, at every size)."""

from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.tiny import QWEN_HIDDEN_SIZE, build_gemma2_text_encoder, build_lumina2_transformer, build_t5_tokenizer

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "lumina2_1024_lora.toml"
JOB_ON_MICRO = True


def autoencoder(pixels):
    return kl_autoencoder(pixels, sixteen_channels=True, downsampling=8)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_t5_tokenizer()
    return Lumina2Pipeline(
        vae=vae,
        text_encoder=build_gemma2_text_encoder(tokenizer, width),
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=6.0, use_dynamic_shifting=False),
        transformer=build_lumina2_transformer(sizes.dit_layers or 1, heads=sizes.dit_heads, text_hidden_size=width),
    )
