"""Micro Stable Diffusion 1.x: a CLIP text encoder and a two-level UNet over a 4-channel KL autoencoder."""

from diffusers import StableDiffusionPipeline

from difftune.toy.micro import MicroSizes, TinyBase, unet
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.tiny import build_noise_scheduler, build_text_encoder, build_tokenizer, build_unet

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them).
SHIPPED_JOB = "sd15_lora.toml"
TINY_BASE = TinyBase(
    architecture=(
        "Stable Diffusion 1.x's architecture at toy size, from the same classes (`UNet2DConditionModel`,\n"
        "`AutoencoderKL`, `CLIPTextModel` with a character-level `CLIPTokenizer`)"
    ),
    denoiser=unet,
)


def autoencoder(pixels):
    return kl_autoencoder(pixels, sixteen_channels=False)


def pipeline(vae, sizes: MicroSizes):
    text_encoder, tokenizer = build_text_encoder(), build_tokenizer()
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=build_unet(sizes.unet_block_out_channels),
        scheduler=build_noise_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
