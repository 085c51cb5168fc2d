"""Micro Z-Image: a Qwen3 text encoder and a Z-Image transformer over a 16-channel KL autoencoder."""

from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

from difftune.families.flux.micro import AUTOENCODER as FLUX_AUTOENCODER
from difftune.families.qwen_image.micro import RECIPE as QWEN_RECIPE
from difftune.toy.micro import MicroSizes, TinyBase
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.tiny import FLUX_LATENT_CHANNELS, QWEN_HIDDEN_SIZE, build_qwen3_text_encoder, build_qwen3_tokenizer

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them).
SHIPPED_JOB = "z_image_lora.toml"
# tiny-z_image: Qwen-Image's recipe for a Z-Image DiT (4 single-stream blocks after one image and one caption refiner
# block) reading a 3-layer Qwen3, over tiny-flux's autoencoders (Z-Image's is Flux.1's). Its blocks see ~2x Qwen's
# tokens (image and caption each padded to a multiple of 32), so it is narrower (96) and trains 2000 steps to fit
# 25 minutes: 20-step pilots at batch 128 took 0.90 s a step at width 128, 0.68 at 96.
TINY_BASE = TinyBase(
    architecture=(
        "Z-Image's architecture at toy size, from the same classes (`ZImageTransformer2DModel`, a\n"
        "single-stream DiT with image and caption refiner blocks, over Flux.1's kind of 16-channel\n"
        "`AutoencoderKL` (tiny-flux's), a `Qwen3Model` language model read through its chat template, with a\n"
        "byte-level `Qwen2Tokenizer` built here)"
    ),
    denoiser=lambda recipe: (
        f"transformer ({recipe.dit_layers} single-stream blocks after 1 image and 1 caption refiner block, "
        f"width {recipe.dit_heads * 16})"
    ),
    recipe=QWEN_RECIPE | {"dit_heads": 6, "steps": 2000},
    autoencoders_from="tiny-flux",
    autoencoder=FLUX_AUTOENCODER,
)


def autoencoder(pixels):
    return kl_autoencoder(pixels, sixteen_channels=True)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_qwen3_tokenizer()
    return ZImagePipeline(
        vae=vae,
        text_encoder=build_qwen3_text_encoder(tokenizer, width),
        tokenizer=tokenizer,
        scheduler=build_z_image_scheduler(),
        transformer=build_z_image_transformer(sizes.dit_layers or 1, heads=sizes.dit_heads, text_hidden_size=width),
    )


def build_z_image_transformer(
    layers: int = 1,
    refiner_layers: int = 1,
    heads: int = 2,
    head_dim: int = 16,
    text_hidden_size: int = QWEN_HIDDEN_SIZE,
    siglip_width: int | None = None,
) -> ZImageTransformer2DModel:
    """`layers` single-stream blocks after `refiner_layers` image and caption refiner blocks each, over 2x2 patches of
    16-channel latents; rotary axes split the head 1:1.5:1.5 (caption position, row, column) as Z-Image's 32:48:48.
    `siglip_width`: Z-Image Omni's, reading SigLIP features of that width too."""
    return ZImageTransformer2DModel(
        siglip_feat_dim=siglip_width,
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=FLUX_LATENT_CHANNELS,
        dim=heads * head_dim,
        n_layers=layers,
        n_refiner_layers=refiner_layers,
        n_heads=heads,
        n_kv_heads=heads,
        cap_feat_dim=text_hidden_size,
        axes_dims=[head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8],
        axes_lens=[1024, 64, 64],
    )


def build_z_image_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Z-Image's scheduler config: one shift (3) at every size."""
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
