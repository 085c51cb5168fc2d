"""Micro FLUX.2 [klein]: a deep Qwen3 language model (its think block in the template) and a FLUX.2 transformer
over FLUX.2's autoencoder."""

from diffusers import Flux2KleinPipeline

from difftune.families.flux.micro import RECIPE as FLUX_RECIPE
from difftune.families.flux2.micro import autoencoder, build_flux2_transformer
from difftune.toy.micro import MicroSizes, TinyBase, two_stream_transformer
from difftune.toy.tiny import (
    FLUX2_LATENT_CHANNELS,
    FLUX2_TEXT_HIDDEN_SIZE,
    build_flow_scheduler,
    build_qwen3_text_encoder,
    build_qwen3_tokenizer,
)

__all__ = ["autoencoder", "pipeline"]

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them).
SHIPPED_JOB = "flux2_klein_lora.toml"
# tiny-flux2_klein: Flux's recipe for FLUX.2's transformer (2 double- and 2 single-stream blocks, width 96) over its own
# FLUX.2 autoencoder (8 channels, patched 2x2 into 32), reading a 27-layer Qwen3 of width 32 (layers 9, 18 and 27)
# that stays at its random init: 27 layers over every caption token each step would not fit the build's time, and
# its states, cached once, tell the captions apart. Captions are read at 48 tokens (the tokenizer's
# `model_max_length`), not the pipeline's 512: the transformer attends to every one of them. With the text cached a
# step takes 0.33 s at batch 128 (30-step pilot), so it trains 2000 steps where Flux's takes 1200.
TINY_BASE = TinyBase(
    architecture=(
        "FLUX.2 [klein]'s architecture at toy size, from the same classes (`Flux2Transformer2DModel`,\n"
        "FLUX.2's `AutoencoderKLFlux2` with its batch norm over 2x2-patched latents, a 27-layer\n"
        "`Qwen3ForCausalLM` read at layers 9, 18 and 27 through its chat template, with a byte-level\n"
        "`Qwen2Tokenizer` built here whose `model_max_length` (48) is the caption length read: pass\n"
        "`max_sequence_length=48` to `Flux2KleinPipeline`)"
    ),
    denoiser=two_stream_transformer,
    recipe=FLUX_RECIPE | {"language_model_width": 32, "train_text_encoder": False, "text_tokens": 48, "steps": 2000},
    autoencoder={"kind": "batch_norm", "latent_channels": FLUX2_LATENT_CHANNELS},
)


def pipeline(vae, sizes: MicroSizes):
    width = sizes.language_model_width or FLUX2_TEXT_HIDDEN_SIZE
    tokenizer = build_qwen3_tokenizer(think_block=True)
    if sizes.text_tokens:
        tokenizer.model_max_length = sizes.text_tokens
    return Flux2KleinPipeline(
        vae=vae,
        text_encoder=build_qwen3_text_encoder(tokenizer, width, layers=27, causal_lm=True),
        tokenizer=tokenizer,
        scheduler=build_flow_scheduler(),
        transformer=build_flux2_transformer(sizes.flux_layers, sizes.flux_heads, text_hidden_size=3 * width),
    )
