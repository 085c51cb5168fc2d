"""Micro SD3.5: CLIP-L and CLIP-G (narrower here, their widths side by side under T5's), T5 and an MMDiT over a
16-channel KL autoencoder."""

from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

from difftune.families.qwen_image.micro import RECIPE as QWEN_RECIPE
from difftune.toy.micro import MicroSizes, TinyBase, mmdit
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.tiny import (
    FLUX_LATENT_CHANNELS,
    IMAGE_SIZE,
    T5_HIDDEN_SIZE,
    TEXT_HIDDEN_SIZE,
    build_sd3_scheduler,
    build_t5_encoder,
    build_t5_tokenizer,
    build_text_encoder,
    build_tokenizer,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them).
SHIPPED_JOB = "sd3_lora.toml"
# tiny-sd3: Flux's recipe (2000 steps, as tiny-chroma's) for an SD3.5-style MMDiT of 4 blocks, width 96 (the first
# with SD3.5's second image attention), reading two CLIPs (trained with it) and T5 (kept at its random init: the
# pipeline's LoRA loader never adapts it), over tiny-flux's autoencoders (SD3's is the same kind: 16 channels, a shift).
TINY_BASE = TinyBase(
    architecture=(
        "Stable Diffusion 3.5's architecture at toy size, from the same classes (`SD3Transformer2DModel`, an MMDiT\n"
        "whose first block has SD3.5's second image attention, over Flux.1's kind of 16-channel `AutoencoderKL`\n"
        "(tiny-flux's, SD3's kind too), two `CLIPTextModelWithProjection`s and `T5EncoderModel`, with\n"
        "character-level tokenizers)"
    ),
    denoiser=mmdit,
    recipe=QWEN_RECIPE | {"steps": 2000, "dit_layers": 4, "dit_heads": 6},
    autoencoders_from="tiny-flux",
)


def autoencoder(pixels):
    return kl_autoencoder(pixels, sixteen_channels=True)


def pipeline(vae, sizes: MicroSizes):
    t5_tokenizer = build_t5_tokenizer()
    return StableDiffusion3Pipeline(
        vae=vae,
        text_encoder=build_text_encoder(32, 32),
        tokenizer=build_tokenizer(),
        text_encoder_2=build_text_encoder(24, 24),
        tokenizer_2=build_tokenizer(),
        text_encoder_3=build_t5_encoder(len(t5_tokenizer)),
        tokenizer_3=t5_tokenizer,
        transformer=build_sd3_transformer(sizes.dit_layers or 2, sizes.dit_heads, pooled_size=32 + 24),
        scheduler=build_sd3_scheduler(),
    )


def build_sd3_transformer(
    layers: int = 2, heads: int = 2, head_dim: int = 16, pooled_size: int = 2 * TEXT_HIDDEN_SIZE // 2
) -> SD3Transformer2DModel:
    """`layers` MMDiT blocks over 2x2 patches of 16-channel latents, the first with SD3.5's second image attention
    and both with its q/k RMS norms; caption states as wide as T5's."""
    return SD3Transformer2DModel(
        sample_size=IMAGE_SIZE // 4,
        patch_size=2,
        in_channels=FLUX_LATENT_CHANNELS,
        num_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=T5_HIDDEN_SIZE,
        caption_projection_dim=heads * head_dim,
        pooled_projection_dim=pooled_size,
        out_channels=FLUX_LATENT_CHANNELS,
        pos_embed_max_size=16,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    )
