"""Micro Sana: a Gemma 2 text encoder and a Sana transformer over a deep-compression autoencoder (`AutoencoderDC`) that
downsamples 8x, with the sampler diffusers' Sana conversion makes (DPM-Solver on flow sigmas shifted by 3)."""

from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel

from difftune.families.lumina2.micro import build_gemma2_text_encoder
from difftune.families.sana import instruction_lines
from difftune.toy.micro import MicroSizes
from difftune.toy.micro._kl import scaled_to
from difftune.toy.tiny import QWEN_HIDDEN_SIZE, build_t5_tokenizer

SHIPPED_JOB = "sana_1024_lora.toml"
JOB_ON_MICRO = True
LATENT_CHANNELS = 8
TEXT_POSITIONS = 512  # the instruction's tokens (a line each here) and the 298 of the caption after them


def autoencoder(pixels):
    """ResBlocks only, 3 downsamplings (8x; the published one's 32x would leave the 32 px shapes one latent pixel),
    its scaling factor from the shapes' latents."""
    blocks = 4
    vae = AutoencoderDC(
        latent_channels=LATENT_CHANNELS,
        attention_head_dim=8,
        encoder_block_types="ResBlock",
        decoder_block_types="ResBlock",
        encoder_block_out_channels=(8, 16, 16, 16),
        decoder_block_out_channels=(8, 16, 16, 16),
        encoder_layers_per_block=(1,) * blocks,
        decoder_layers_per_block=(1,) * blocks,
        encoder_qkv_multiscales=((),) * blocks,
        decoder_qkv_multiscales=((),) * blocks,
        downsample_block_type="conv",
        upsample_block_type="interpolate",
    )
    return scaled_to(vae, pixels, shift=False)


def pipeline(vae, sizes: MicroSizes):
    return sana_pipeline(SanaPipeline, vae, sizes, 3.0, build_sana_transformer)


def sana_pipeline(pipeline_class: type, vae, sizes: MicroSizes, flow_shift: float, build_transformer):
    """A micro pipeline of `pipeline_class` (Sana's, Sana-Video's) around `vae`: a Gemma 2, a character-level
    tokenizer with the pipeline's instruction, the sampler diffusers' conversions make (DPM-Solver on flow
    sigmas shifted by `flow_shift`) and `build_transformer(layers, heads, text_hidden_size=...)`'s transformer."""
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_t5_tokenizer()
    # The instruction the pipeline puts before each caption, a token a line (Gemma's vocabulary spells it in about
    # 260; single characters would take 1,400, which the micro language model would read at every validation).
    tokenizer.add_tokens(instruction_lines(pipeline_class))
    return pipeline_class(
        vae=vae,
        text_encoder=build_gemma2_text_encoder(tokenizer, width, positions=TEXT_POSITIONS),
        tokenizer=tokenizer,
        scheduler=DPMSolverMultistepScheduler(
            flow_shift=flow_shift, use_flow_sigmas=True, prediction_type="flow_prediction"
        ),
        transformer=build_transformer(sizes.dit_layers or 1, sizes.dit_heads, text_hidden_size=width),
    )


def build_sana_transformer(
    layers: int = 1, heads: int = 2, head_dim: int = 16, text_hidden_size: int = QWEN_HIDDEN_SIZE
) -> SanaTransformer2DModel:
    """`layers` Sana blocks over 1x1 patches of the latents."""
    return SanaTransformer2DModel(
        in_channels=LATENT_CHANNELS,
        out_channels=LATENT_CHANNELS,
        sample_size=4,
        patch_size=1,
        **sana_blocks(layers, heads, head_dim, text_hidden_size),
    )


def sana_blocks(layers: int, heads: int, head_dim: int, text_hidden_size: int) -> dict:
    """A Sana transformer's blocks (Sana's and Sana-Video's): linear self-attention, cross-attention with as many
    heads to the language model's states, the GLU convolution."""
    return {
        "num_attention_heads": heads,
        "attention_head_dim": head_dim,
        "num_layers": layers,
        "num_cross_attention_heads": heads,
        "cross_attention_head_dim": head_dim,
        "cross_attention_dim": heads * head_dim,
        "caption_channels": text_hidden_size,
    }
