"""Micro Anima: a Qwen3 language model (without its head, as Anima keeps Qwen3 0.6B), a T5 tokenizer for the text
conditioner's queries, Anima's text conditioner and a Cosmos-Predict2 transformer over Qwen-Image's autoencoder, in
Anima's modular pipeline."""

from diffusers import AnimaTextConditioner, CosmosTransformer3DModel

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._latent_statistics import qwen_autoencoder
from difftune.toy.tiny import (
    FLUX_LATENT_CHANNELS,
    QWEN_HIDDEN_SIZE,
    build_qwen3_text_encoder,
    build_qwen3_tokenizer,
    build_sd3_scheduler,
    build_t5_tokenizer,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "anima_1024_lora.toml"
JOB_ON_MICRO = True


def autoencoder(pixels):
    return qwen_autoencoder(pixels)


def pipeline(vae, sizes: MicroSizes):
    from difftune.families import FAMILIES

    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer, t5_tokenizer = build_qwen3_tokenizer(), build_t5_tokenizer()
    text_encoder = build_qwen3_text_encoder(tokenizer, width)
    text_conditioner = build_anima_text_conditioner(width, width, len(t5_tokenizer))
    family = FAMILIES["anima"]
    modular = family.loading.modular_pipeline()
    modular.update_components(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        t5_tokenizer=t5_tokenizer,
        text_conditioner=text_conditioner,
        transformer=build_cosmos_transformer(sizes.dit_layers or 1, sizes.dit_heads, text_hidden_size=width),
        scheduler=build_sd3_scheduler(),  # Anima's: one shift (3) at every size
    )
    return modular


def build_cosmos_transformer(
    layers: int = 1, heads: int = 2, head_dim: int = 16, text_hidden_size: int = 32
) -> CosmosTransformer3DModel:
    """Anima's DiT (Cosmos-Predict2's text-to-image `CosmosTransformer3DModel`): `layers` blocks over 2x2 patches of
    16-channel latents with the padding mask as a 17th channel, no learnable position embedding, and Anima's 3-D
    rotary scales."""
    return CosmosTransformer3DModel(
        in_channels=FLUX_LATENT_CHANNELS,
        out_channels=FLUX_LATENT_CHANNELS,
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        num_layers=layers,
        text_embed_dim=text_hidden_size,
        adaln_lora_dim=8,
        max_size=(8, 64, 64),
        rope_scale=(1.0, 4.0, 4.0),
        concat_padding_mask=True,
        extra_pos_embed_type=None,
    )


def build_anima_text_conditioner(
    source_dim: int, target_dim: int, vocab_size: int, layers: int = 1, heads: int = 2
) -> AnimaTextConditioner:
    """Anima's LLM adapter: T5 token embeddings (the queries) cross-attending to a Qwen3's states, out at the
    transformer's text width, padded to 512 tokens as Anima's is."""
    return AnimaTextConditioner(
        source_dim=source_dim,
        target_dim=target_dim,
        model_dim=target_dim,
        num_layers=layers,
        num_attention_heads=heads,
        target_vocab_size=vocab_size,
    )
