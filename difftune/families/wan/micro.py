"""Micro Wan 2.1: a umT5 text encoder and a Wan transformer over Wan's causal video autoencoder; and Wan 2.2's two
kinds (`wan22_pipeline`)."""

import torch
from diffusers import (
    AutoencoderKLWan,
    UniPCMultistepScheduler,
    WanPipeline,
    WanTransformer3DModel,
    WanVACETransformer3DModel,
)
from transformers import UMT5Config, UMT5EncoderModel

from difftune.families.qwen_image.micro import RECIPE as QWEN_RECIPE
from difftune.toy.micro import MicroSizes, TinyBase, build_pipeline
from difftune.toy.micro._latent_statistics import qwen_autoencoder, with_latent_statistics
from difftune.toy.tiny import (
    FLUX_LATENT_CHANNELS,
    T5_HIDDEN_SIZE,
    build_t5_tokenizer,
    render_tensors,
    t5_encoder_settings,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "wan_image_lora.toml"
JOB_ON_MICRO = True
# tiny-wan: Wan 2.1's architecture over 32 px clips of 5 frames (tiny.moving_shape_clips: a shape sliding 8 px left,
# right, up or down). Its autoencoder is tiny-qwen_image's (the same causal video autoencoder, trained there on still
# renders), which drew a clip's first frame at 24.6 dB but the later ones at 12 (it had never seen time); trained on
# clips for 300 steps (232 s) every frame came to 23 dB. Its transformer has 4 blocks of width 128 (0.65 s a step at
# batch 64 over 5-frame clips, 3x an image's tokens), and UMT5 stays at its random init, its states cached, as
# tiny-flux2_klein's text encoder. Clips per (color, shape, direction): 40 to train on, 2 to validate. The first build
# (1500 steps, shapes of 30-45% sliding 12 px) drew the seen colors at 0.99 and the directions at 1.00, but the shapes
# at 0.38: its autoencoder's own reconstructions of such small shapes were named right in 0.69 of frames; with larger
# shapes (tiny.render_moving_shape) 0.97. At 2000 steps it drew the seen shapes at 0.89, its validation loss (EMA)
# still falling (0.3316; 0.3218 at 3000, where the shapes reached 0.96): 3000 here.
TINY_BASE = TinyBase(
    architecture=(
        "Wan 2.1's architecture at toy size, from the same classes (`WanTransformer3DModel` over 1x2x2 patches of\n"
        "clip latents, Wan's causal video autoencoder `AutoencoderKLWan` with per-channel statistics, a\n"
        "`UMT5EncoderModel` with a character-level `T5TokenizerFast`)"
    ),
    denoiser=lambda recipe: f"transformer ({recipe.dit_layers} Wan blocks, width {recipe.dit_heads * 16})",
    recipe=QWEN_RECIPE
    | {
        "steps": 3000,
        "batch_size": 64,
        "dit_layers": 4,
        "dit_heads": 8,
        "train_text_encoder": False,
        "vae_steps": 300,
        "vae_decoder_steps": 0,  # its clips' frames decode at 23 dB without a decoder phase (tiny_base.train_clip_vae)
        "train_images_per_prompt": 40,
        "validation_images_per_prompt": 2,
    },
    autoencoders_from="tiny-qwen_image",
    text_note="The text encoder is UMT5 at its random init (its states tell the captions apart; training caches them).",
)


def autoencoder(pixels):
    return qwen_autoencoder(pixels, wan=True)


def pipeline(vae, sizes: MicroSizes):
    tokenizer = build_t5_tokenizer()
    return WanPipeline(
        vae=vae,
        text_encoder=build_umt5_encoder(len(tokenizer)),
        tokenizer=tokenizer,
        transformer=build_wan_transformer(sizes.dit_layers or 2, sizes.dit_heads),
        scheduler=build_wan_scheduler(),
    )


def wan22_pipeline(seed: int = 0, kind: str = "a14b") -> WanPipeline:
    """A micro Wan 2.2 pipeline: `a14b`, two experts (`transformer` for high noise levels, `transformer_2` below the
    T2V `boundary_ratio` 0.875, as Wan2.2-T2V-A14B's); `ti2v`, TI2V-5B's kind: one transformer reading a time per
    latent token (`expand_timesteps`) over Wan 2.2's autoencoder, which patches 2x2 itself (8x here: 4x by its
    blocks)."""
    wan = build_pipeline(seed, family="wan")
    if kind == "a14b":
        torch.manual_seed(seed + 1)
        return WanPipeline(
            vae=wan.vae,
            text_encoder=wan.text_encoder,
            tokenizer=wan.tokenizer,
            scheduler=wan.scheduler,
            transformer=wan.transformer,
            transformer_2=build_wan_transformer(2, 2),
            boundary_ratio=0.875,
        )
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLWan(
        base_dim=16,
        z_dim=FLUX_LATENT_CHANNELS,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True],
        is_residual=True,
        patch_size=2,
        in_channels=12,
        out_channels=12,
        scale_factor_spatial=8,
        scale_factor_temporal=2,
    )
    return WanPipeline(
        vae=with_latent_statistics(vae, render_tensors(64, seed)),
        text_encoder=wan.text_encoder,
        tokenizer=wan.tokenizer,
        scheduler=wan.scheduler,
        transformer=wan.transformer,
        expand_timesteps=True,
    )


def build_wan_transformer(
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 16,
    in_channels: int = FLUX_LATENT_CHANNELS,
    image_dim: int | None = None,
    vace: dict | None = None,
) -> WanTransformer3DModel | WanVACETransformer3DModel:
    """`layers` Wan blocks (self-attention over 1x2x2 patches of 16-channel latents, cross-attention to UMT5's states,
    an MLP) with their rotary axes split over (time, row, column) from the head's width, as Wan's. `in_channels`: an
    image-to-video one's reads the first frame's mask and latents too (16 + the temporal factor + 16); `image_dim`:
    Wan 2.1 image-to-video's also reads CLIP image states of that width (its cross-attention's image key and value
    projections, to the block's width as Wan 2.1 I2V's); `vace`: a VACE transformer's `vace_layers` and
    `vace_in_channels`, its VACE blocks beside the Wan ones."""
    model_class = WanTransformer3DModel if vace is None else WanVACETransformer3DModel
    return model_class(
        **(vace or {}),
        image_dim=image_dim,
        added_kv_proj_dim=heads * head_dim if image_dim else None,
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=in_channels,
        out_channels=FLUX_LATENT_CHANNELS,
        text_dim=T5_HIDDEN_SIZE,
        freq_dim=32,
        ffn_dim=2 * heads * head_dim,
        num_layers=layers,
        rope_max_seq_len=64,
    )


def build_wan_scheduler() -> UniPCMultistepScheduler:
    """Wan 2.1 (480p)'s sampler config: UniPC on flow sigmas shifted by 3, the prediction the flow velocity."""
    return UniPCMultistepScheduler(
        num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )


def build_umt5_encoder(vocab_size: int) -> UMT5EncoderModel:
    """A 2-layer UMT5 encoder (Wan's text encoder: its last hidden state is the conditioning)."""
    return UMT5EncoderModel(UMT5Config(**t5_encoder_settings(vocab_size)))
