"""Micro HunyuanVideo: a Llama 3-style language model and CLIP-L (pooled) as its text encoders, and a HunyuanVideo
transformer (a guidance embedding, as the published model's) over HunyuanVideo's causal video autoencoder (Kandinsky 5
video's micro one). Its tokenizer spells the prompt template before the caption in 95 tokens, the pipeline's
`crop_start`, as Llama 3's does: the states kept start at the caption."""

from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline, HunyuanVideoTransformer3DModel
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
from transformers import LlamaConfig, LlamaModel

from difftune.families.hunyuan_video import CLIP_TOKENS, CROP_START
from difftune.families.kandinsky5_video.micro import autoencoder  # HunyuanVideo's, as Kandinsky 5 video's
from difftune.toy.micro import MicroSizes
from difftune.toy.tiny import (
    FLUX_LATENT_CHANNELS,
    QWEN_HIDDEN_SIZE,
    TEXT_HIDDEN_SIZE,
    build_llama_tokenizer,
    build_text_encoder,
    build_tokenizer,
)

SHIPPED_JOB = "hunyuan_video_lora.toml"
JOB_ON_MICRO = True

__all__ = ["autoencoder", "pipeline"]


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_template_tokenizer()
    return HunyuanVideoPipeline(
        vae=vae,
        text_encoder=build_llama_model(len(tokenizer), width),
        tokenizer=tokenizer,
        text_encoder_2=build_text_encoder(positions=CLIP_TOKENS),
        tokenizer_2=build_tokenizer(),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        transformer=build_hunyuan_video_transformer(sizes.dit_layers or 1, sizes.dit_heads, text_hidden_size=width),
    )


def build_template_tokenizer():
    """Llama 3's layout (build_llama_tokenizer), padded with `<|end_of_text|>`, with the template's text before the
    caption as `CROP_START` - 1 added tokens: `CROP_START` with the BOS token."""
    tokenizer = build_llama_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    prefix = DEFAULT_PROMPT_TEMPLATE["template"].split("{}")[0]
    # Pieces of one length, the rest in the last (an added token matches the longest first: a shorter piece that began
    # another would split the text otherwise).
    size = len(prefix) // (CROP_START - 1)
    tokenizer.add_tokens(
        [prefix[i * size : (i + 1) * size] for i in range(CROP_START - 2)] + [prefix[(CROP_START - 2) * size :]]
    )
    assert len(tokenizer(prefix)["input_ids"]) == CROP_START, "the template's prefix must be `CROP_START` tokens"
    return tokenizer


def build_llama_model(vocab_size: int, hidden_size: int, layers: int = 3) -> LlamaModel:
    """A Llama 3-style language model (the pipeline reads its third-to-last layer's states)."""
    return LlamaModel(
        LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=512,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        )
    )


def build_hunyuan_video_transformer(
    layers: int = 1, heads: int = 2, head_dim: int = 32, text_hidden_size: int = QWEN_HIDDEN_SIZE
) -> HunyuanVideoTransformer3DModel:
    """`layers` double- and as many single-stream blocks after one caption refiner block, over 1x2x2 patches of the
    16-channel latents, with a guidance embedding; the rotary axes split the head 2:3:3 (time, row, column), as the
    published 16:56:56 nearly does."""
    return HunyuanVideoTransformer3DModel(
        in_channels=FLUX_LATENT_CHANNELS,
        out_channels=FLUX_LATENT_CHANNELS,
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        num_layers=layers,
        num_single_layers=layers,
        num_refiner_layers=1,
        patch_size=2,
        patch_size_t=1,
        guidance_embeds=True,
        text_embed_dim=text_hidden_size,
        pooled_projection_dim=TEXT_HIDDEN_SIZE,
        rope_axes_dim=(head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8),
    )
