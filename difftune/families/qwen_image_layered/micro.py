"""Micro Qwen-Image-Layered: Qwen-Image's language model and transformer (with its layer-3D rope and its RGBA
time condition) over Qwen-Image's autoencoder of RGBA images, in the layered pipeline."""

from diffusers import QwenImageLayeredPipeline

from difftune.families.qwen_image.micro import build_qwen_tokenizer, build_qwen_transformer
from difftune.toy.micro import MicroSizes
from difftune.toy.micro._latent_statistics import with_latent_statistics
from difftune.toy.tiny import (
    QWEN_HIDDEN_SIZE,
    build_qwen_processor,
    build_qwen_scheduler,
    build_qwen_text_encoder,
    build_qwen_vae,
)


def autoencoder(pixels):
    return with_latent_statistics(build_qwen_vae(input_channels=4), pixels)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_qwen_tokenizer(edit=True)  # its processor shows the captioner the image
    return QwenImageLayeredPipeline(
        vae=vae,
        text_encoder=build_qwen_text_encoder(tokenizer, width),
        tokenizer=tokenizer,
        processor=build_qwen_processor(tokenizer),
        transformer=build_qwen_transformer(
            sizes.dit_layers or 1, sizes.dit_heads, text_hidden_size=width, layered=True
        ),
        scheduler=build_qwen_scheduler(),  # the pipeline gives it its own mu
    )
