"""Micro SDXL: two CLIP text encoders (the second pooled) and an SDXL UNet over a 4-channel KL autoencoder."""

from diffusers import StableDiffusionXLPipeline

from difftune.toy.micro import MicroSizes, TinyBase, unet
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.tiny import (
    TEXT_2_HIDDEN_SIZE,
    TEXT_2_PROJECTION_SIZE,
    build_noise_scheduler,
    build_text_encoder,
    build_tokenizer,
    build_unet,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them).
SHIPPED_JOB = "sdxl_lora.toml"
# tiny-sdxl at tiny-sd's 1300 steps drew seen shapes at 0.927 (8 samples per prompt), under the 0.95 target;
# it trains its two text encoders and wider cross-attention for longer.
TINY_BASE = TinyBase(
    architecture=(
        "Stable Diffusion XL's architecture at toy size, from the same classes (`UNet2DConditionModel` with\n"
        '`addition_embed_type = "text_time"` size/crop conditioning, `AutoencoderKL`, `CLIPTextModel` and\n'
        "`CLIPTextModelWithProjection` with character-level `CLIPTokenizer`s; the UNet keeps tiny-sd's attention\n"
        "placement)"
    ),
    denoiser=unet,
    recipe={"steps": 1700},
    autoencoders_from="tiny-sd",
)


def autoencoder(pixels):
    return kl_autoencoder(pixels, sixteen_channels=False)


def pipeline(vae, sizes: MicroSizes):
    text_encoder, tokenizer = build_text_encoder(), build_tokenizer()
    return StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=build_text_encoder(TEXT_2_HIDDEN_SIZE, TEXT_2_PROJECTION_SIZE),
        tokenizer_2=build_tokenizer(),
        unet=build_unet(sizes.unet_block_out_channels, sdxl=True),
        scheduler=build_noise_scheduler(),
        # Trained with empty-caption dropout, not SDXL's zeroed embeddings: "" is what an empty prompt means.
        force_zeros_for_empty_prompt=False,
        add_watermarker=False,
    )
