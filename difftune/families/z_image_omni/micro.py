"""Micro Z-Image Omni: Z-Image's micro parts with the omni transformer (SigLIP features' embedder and refiner) and a
micro SigLIP2 vision model and processor, which read an edit's reference images, in `ZImageOmniPipeline`."""

import torch
from diffusers import ZImageOmniPipeline
from transformers import Siglip2ImageProcessorPil, Siglip2VisionConfig, Siglip2VisionModel

from difftune.families.z_image.micro import build_z_image_scheduler, build_z_image_transformer
from difftune.toy.micro import MicroSizes
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.tiny import QWEN_HIDDEN_SIZE, build_qwen3_text_encoder, build_qwen3_tokenizer

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "z_image_omni_1024_lora.toml"
JOB_ON_MICRO = True
SIGLIP_WIDTH = 24  # the micro SigLIP features' (SigLIP2 so400m's: 1152)


def autoencoder(pixels):
    return kl_autoencoder(pixels, sixteen_channels=True)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_qwen3_tokenizer()
    siglip, siglip_processor = build_siglip2(SIGLIP_WIDTH)
    return ZImageOmniPipeline(
        scheduler=build_z_image_scheduler(),
        vae=vae,
        text_encoder=build_qwen3_text_encoder(tokenizer, width),
        tokenizer=tokenizer,
        transformer=build_z_image_transformer(
            sizes.dit_layers or 1, heads=sizes.dit_heads, text_hidden_size=width, siglip_width=SIGLIP_WIDTH
        ),
        siglip=siglip,
        siglip_processor=siglip_processor,
    )


def build_siglip2(width: int) -> tuple[Siglip2VisionModel, Siglip2ImageProcessorPil]:
    """A one-layer SigLIP2 vision model (its naflex kind: images at their own aspect, as Z-Image Omni's so400m reads
    references) of `width`, with its processor: 8 px patches, at most 16 of them (a 32 px control is 4 x 4 patches)."""
    torch.manual_seed(0)
    config = Siglip2VisionConfig(
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=1,
        num_attention_heads=2,
        patch_size=8,
        num_patches=16,
        vision_use_head=False,
    )
    # The processor's PIL backend: its default one needs torchvision, which difftune does not install.
    return Siglip2VisionModel(config), Siglip2ImageProcessorPil(patch_size=8, max_num_patches=16)
