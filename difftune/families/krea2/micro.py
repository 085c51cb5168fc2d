"""Micro Krea 2: a Qwen3-VL language model (its tokenizer spells Qwen-Image's template, which Krea 2's prompts use)
and a Krea 2 transformer over Qwen-Image's autoencoder."""

from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline, Krea2Transformer2DModel

from difftune.families.qwen_image.micro import build_qwen_tokenizer
from difftune.toy.micro import MicroSizes
from difftune.toy.micro._latent_statistics import qwen_autoencoder
from difftune.toy.tiny import (
    FLUX_LATENT_CHANNELS,
    KREA2_TEXT_LAYERS,
    QWEN_HIDDEN_SIZE,
    build_qwen3_vl_text_encoder,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "krea2_1024_lora.toml"
JOB_ON_MICRO = True


def autoencoder(pixels):
    return qwen_autoencoder(pixels)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_qwen_tokenizer()
    return Krea2Pipeline(
        vae=vae,
        text_encoder=build_qwen3_vl_text_encoder(tokenizer, width),
        tokenizer=tokenizer,
        scheduler=build_krea2_scheduler(),
        transformer=build_krea2_transformer(sizes.dit_layers or 1, sizes.dit_heads, text_hidden_size=width),
        text_encoder_select_layers=tuple(range(1, KREA2_TEXT_LAYERS + 1)),
    )


def build_krea2_transformer(
    layers: int = 1,
    heads: int = 2,
    head_dim: int = 16,
    text_hidden_size: int = QWEN_HIDDEN_SIZE,
    text_layers: int = KREA2_TEXT_LAYERS,
) -> Krea2Transformer2DModel:
    """`layers` single-stream blocks over 2x2 patches of 16-channel latents, after a text fusion of one layer-wise and
    one refiner block over the stacked states of `text_layers` language-model layers; rotary axes split the head
    1:1.5:1.5 (time, row, column) as Krea 2's 32:48:48."""
    return Krea2Transformer2DModel(
        in_channels=4 * FLUX_LATENT_CHANNELS,
        num_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        num_key_value_heads=1,
        intermediate_size=2 * heads * head_dim,
        timestep_embed_dim=32,
        text_hidden_dim=text_hidden_size,
        num_text_layers=text_layers,
        text_num_attention_heads=2,
        text_num_key_value_heads=2,
        text_intermediate_size=2 * text_hidden_size,
        num_layerwise_text_blocks=1,
        num_refiner_text_blocks=1,
        axes_dims_rope=(head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8),
    )


def build_krea2_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Krea 2's scheduler config: the shift follows the image's token count (the pipeline computes mu)."""
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        use_dynamic_shifting=True,
        base_image_seq_len=256,
        max_image_seq_len=6400,
        base_shift=0.5,
        max_shift=1.15,
    )
