"""Micro HiDream-I1: long-context CLIP-L and CLIP-G (pooled), T5 and Llama 3.1 (every layer's states) and a HiDream
transformer over a 16-channel KL autoencoder, with HiDream-I1-Full's shift (3)."""

from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.tiny import (
    QWEN_HIDDEN_SIZE,
    build_hidream_transformer,
    build_llama_text_encoder,
    build_llama_tokenizer,
    build_t5_encoder,
    build_t5_tokenizer,
    build_text_encoder,
    build_tokenizer,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "hidream_1024_lora.toml"
JOB_ON_MICRO = True


def autoencoder(pixels):
    return kl_autoencoder(pixels, sixteen_channels=True)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    t5_tokenizer, llama_tokenizer = build_t5_tokenizer(), build_llama_tokenizer()
    return HiDreamImagePipeline(
        vae=vae,
        text_encoder=build_text_encoder(32, 32, positions=128),
        tokenizer=build_tokenizer(),
        text_encoder_2=build_text_encoder(24, 32, positions=128),
        tokenizer_2=build_tokenizer(),
        text_encoder_3=build_t5_encoder(len(t5_tokenizer)),
        tokenizer_3=t5_tokenizer,
        text_encoder_4=build_llama_text_encoder(llama_tokenizer, width),
        tokenizer_4=llama_tokenizer,
        transformer=build_hidream_transformer(sizes.flux_layers, sizes.flux_heads, pooled_size=2 * 32),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
    )
