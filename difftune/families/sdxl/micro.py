"""Micro SDXL: two CLIP text encoders (the second pooled) and an SDXL UNet over a 4-channel KL autoencoder."""

from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel

from difftune.families.sd.micro import build_unet
from difftune.toy.micro import MicroSizes, TinyBase, unet
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.real_width import clip_text_encoder, clip_tokenizer, sd_autoencoder
from difftune.toy.tiny import (
    TEXT_2_HIDDEN_SIZE,
    TEXT_2_PROJECTION_SIZE,
    build_noise_scheduler,
    build_text_encoder,
    build_tokenizer,
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


# The bench's real-width model of the family (toy/bench.py): random weights at SDXL's sizes.
REAL_WIDTH_MODEL = "sdxl"


def real_width_pipeline(blocks: tuple[int, ...] = ()):
    unet = UNet2DConditionModel(
        sample_size=128,
        layers_per_block=2,
        block_out_channels=(320, 640, 1280),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10),
        attention_head_dim=(5, 10, 20),
        cross_attention_dim=2048,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816,
    )
    return StableDiffusionXLPipeline(
        vae=sd_autoencoder(0.13025),
        text_encoder=clip_text_encoder(768, 12, 12, "quick_gelu"),
        tokenizer=clip_tokenizer(),
        text_encoder_2=clip_text_encoder(1280, 32, 20, "gelu", projection=1280),
        tokenizer_2=clip_tokenizer(),
        unet=unet,
        scheduler=build_noise_scheduler(),
        add_watermarker=False,
    )
