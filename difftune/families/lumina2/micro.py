"""Micro Lumina 2: a Gemma 2 text encoder and a Lumina 2 transformer over a 16-channel KL autoencoder that
downsamples 8x, with Lumina-Image 2.0's scheduler (one shift, 6, at every size)."""

from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel
from transformers import Gemma2Config, Gemma2Model

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.tiny import FLUX_LATENT_CHANNELS, QWEN_HIDDEN_SIZE, build_t5_tokenizer

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "lumina2_1024_lora.toml"
JOB_ON_MICRO = True


def autoencoder(pixels):
    return kl_autoencoder(pixels, sixteen_channels=True, downsampling=8)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_t5_tokenizer()
    return Lumina2Pipeline(
        vae=vae,
        text_encoder=build_gemma2_text_encoder(tokenizer, width),
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=6.0, use_dynamic_shifting=False),
        transformer=build_lumina2_transformer(sizes.dit_layers or 1, heads=sizes.dit_heads, text_hidden_size=width),
    )


def build_lumina2_transformer(
    layers: int = 1,
    refiner_layers: int = 1,
    heads: int = 2,
    head_dim: int = 16,
    text_hidden_size: int = QWEN_HIDDEN_SIZE,
) -> Lumina2Transformer2DModel:
    """`layers` joint blocks after `refiner_layers` image and caption refiner blocks each, over 2x2 patches of
    16-channel latents; rotary axes split the head 1:1.5:1.5 (caption position, row, column)."""
    return Lumina2Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=FLUX_LATENT_CHANNELS,
        hidden_size=heads * head_dim,
        num_layers=layers,
        num_refiner_layers=refiner_layers,
        num_attention_heads=heads,
        num_kv_heads=heads,
        multiple_of=16,
        axes_dim_rope=(head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8),
        axes_lens=(300, 64, 64),
        cap_feat_dim=text_hidden_size,
    )


def build_gemma2_text_encoder(
    tokenizer, hidden_size: int = QWEN_HIDDEN_SIZE, layers: int = 3, positions: int = 512
) -> Gemma2Model:
    """A Gemma 2 language model (Lumina 2's text encoder, which reads the second-to-last layer's states; Sana's, which
    reads its last over a long instruction: `positions` enough for it)."""
    config = Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=hidden_size // 2,
        max_position_embeddings=positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=None,
    )
    return Gemma2Model(config)
