"""Micro HiDream-I1: long-context CLIP-L and CLIP-G (pooled), T5 and Llama 3.1 (every layer's states) and a HiDream
transformer over a 16-channel KL autoencoder, with HiDream-I1-Full's shift (3)."""

from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline, HiDreamImageTransformer2DModel
from transformers import LlamaConfig, LlamaForCausalLM

from difftune.toy.micro import MicroSizes
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.tiny import (
    FLUX_LATENT_CHANNELS,
    QWEN_HIDDEN_SIZE,
    T5_HIDDEN_SIZE,
    build_llama_tokenizer,
    build_t5_encoder,
    build_t5_tokenizer,
    build_text_encoder,
    build_tokenizer,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them); CI runs it as
# shipped on this micro model, the family having no bundled tiny base of it.
SHIPPED_JOB = "hidream_1024_lora.toml"
JOB_ON_MICRO = True


def autoencoder(pixels):
    return kl_autoencoder(pixels, sixteen_channels=True)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    t5_tokenizer, llama_tokenizer = build_t5_tokenizer(), build_llama_tokenizer()
    return HiDreamImagePipeline(
        vae=vae,
        text_encoder=build_text_encoder(32, 32, positions=128),
        tokenizer=build_tokenizer(),
        text_encoder_2=build_text_encoder(24, 32, positions=128),
        tokenizer_2=build_tokenizer(),
        text_encoder_3=build_t5_encoder(len(t5_tokenizer)),
        tokenizer_3=t5_tokenizer,
        text_encoder_4=build_llama_text_encoder(llama_tokenizer, width),
        tokenizer_4=llama_tokenizer,
        transformer=build_hidream_transformer(sizes.flux_layers, sizes.flux_heads, pooled_size=2 * 32),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
    )


def build_hidream_transformer(
    layers: tuple[int, int] = (1, 1),
    heads: int = 2,
    head_dim: int = 16,
    pooled_size: int = 2 * 32,
    llama_layers: int = 2,
) -> HiDreamImageTransformer2DModel:
    """`layers` (double-stream, single-stream) HiDream blocks whose feed-forwards are a mixture of 2 experts (1 chosen
    per token) beside a shared one, over 2x2 patches of 16-channel latents; each block reads its own language-model
    layer (`llama_layers` of them, in turn), the T5 states and the pooled CLIP embeddings; rotary axes split the head
    2:1:1 (time, row, column) as HiDream's 64:32:32."""
    return HiDreamImageTransformer2DModel(
        patch_size=2,
        in_channels=FLUX_LATENT_CHANNELS,
        num_layers=layers[0],
        num_single_layers=layers[1],
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        caption_channels=[T5_HIDDEN_SIZE, QWEN_HIDDEN_SIZE],
        text_emb_dim=pooled_size,
        num_routed_experts=2,
        num_activated_experts=1,
        axes_dims_rope=(head_dim // 2, head_dim // 4, head_dim // 4),
        max_resolution=(32, 32),
        llama_layers=[i % llama_layers for i in range(sum(layers))],
    )


def build_llama_text_encoder(tokenizer, hidden_size: int = QWEN_HIDDEN_SIZE, layers: int = 2) -> LlamaForCausalLM:
    """A Llama 3.1-style language model (HiDream's fourth text encoder: every layer's states are its text)."""
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )
