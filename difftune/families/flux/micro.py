"""Micro FLUX.1: CLIP and T5 text encoders and a Flux transformer over a 16-channel KL autoencoder."""

from diffusers import FluxKontextPipeline, FluxPipeline, FluxTransformer2DModel
from transformers import T5Config, T5EncoderModel

from difftune.toy.micro import MicroSizes, TinyBase, two_stream_transformer
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.real_width import clip_text_encoder, clip_tokenizer, sd_autoencoder
from difftune.toy.tiny import (
    FLUX_LATENT_CHANNELS,
    T5_HIDDEN_SIZE,
    TEXT_HIDDEN_SIZE,
    build_flow_scheduler,
    build_t5_encoder,
    build_t5_tokenizer,
    build_text_encoder,
    build_tokenizer,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them).
SHIPPED_JOB = "flux_lora.toml"
# tiny-flux: a 1.1M-parameter transformer (2 double- and 2 single-stream blocks, width 96) steps in ~0.45 s at batch
# 128 on 2 cores, so its build fits 20 minutes with fewer autoencoder steps (16 latent channels reconstruct
# 32 px shapes more easily than 4). Learning rate, measured on 400-step pilots (validation loss at step 400):
# 1e-3 0.804, 2e-3 0.729, 4e-3 0.670 (width 128 at 1e-3: 0.738, 1.5x the time). At 1e-3 for 1400 steps it reached
# 0.638 and drew seen shapes at 0.54 (wobbly squares and circles).
RECIPE = {
    "steps": 1200,
    "learning_rate": 4e-3,
    "flux_layers": (2, 2),
    "flux_heads": 6,
    "vae_steps": 500,
    "vae_decoder_steps": 500,
    "taesd_steps": 300,
    "weighting": "auto",
    "flow_shift_by_resolution": True,
}
AUTOENCODER = {"latent_channels": FLUX_LATENT_CHANNELS, "shift": True}  # Flux.1's: 16 channels and a shift factor
TINY_BASE = TinyBase(
    architecture=(
        "Flux.1's architecture at toy size, from the same classes (`FluxTransformer2DModel` over 2x2-packed\n"
        "latents, a 16-channel `AutoencoderKL` with a shift factor, `CLIPTextModel` for the pooled embedding and\n"
        "`T5EncoderModel` for the token states, with character-level `CLIPTokenizer` and `T5TokenizerFast`; no\n"
        "guidance embedding: sample with true classifier-free guidance)"
    ),
    denoiser=two_stream_transformer,
    recipe=RECIPE,
    autoencoder=AUTOENCODER,
    # tiny-flux_kontext: its transformer taught to edit on recolor pairs of the seen colors, its text encoders kept
    # (FLUX.1 Kontext is FLUX.1's components with an edit-trained transformer).
    edit_recipe={
        "steps": 600,
        "batch_size": 64,
        "learning_rate": 1e-3,
        "pairs_per_prompt": 40,
        "ema_decay": 0.99,
        "text_encoder": False,
    },
)


def autoencoder(pixels):
    return kl_autoencoder(pixels, sixteen_channels=True)


def pipeline(vae, sizes: MicroSizes, pipeline_class=FluxPipeline, guidance: bool = False):
    """`pipeline_class` and `guidance` (a guidance embedding besides `sizes.guidance`): FLUX.1 Kontext's too."""
    text_encoder, tokenizer = build_text_encoder(), build_tokenizer()
    t5_tokenizer = build_t5_tokenizer()
    return pipeline_class(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=build_t5_encoder(len(t5_tokenizer)),
        tokenizer_2=t5_tokenizer,
        transformer=build_flux_transformer(sizes.flux_layers, sizes.flux_heads, guidance=sizes.guidance or guidance),
        scheduler=build_flow_scheduler(),
    )


def build_flux_transformer(
    layers: tuple[int, int] = (1, 1), heads: int = 2, head_dim: int = 16, guidance: bool = False
) -> FluxTransformer2DModel:
    """`layers` (double-stream, single-stream) blocks over packed 2x2 latent patches; the rotary axes split the
    head dimension 1:2.5:2.5 (text index, row, column) as Flux.1's 16:56:56. `guidance`: a guidance embedding,
    as guidance-distilled bases (FLUX.1-dev) have."""
    axes = (head_dim // 8 * 2, head_dim * 3 // 8, head_dim * 3 // 8)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * FLUX_LATENT_CHANNELS,
        num_layers=layers[0],
        num_single_layers=layers[1],
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=T5_HIDDEN_SIZE,
        pooled_projection_dim=TEXT_HIDDEN_SIZE,
        guidance_embeds=guidance,
        axes_dims_rope=axes,
    )


# The bench's real-width model of the family (toy/bench.py): random weights at FLUX.1's widths.
REAL_WIDTH_MODEL = "flux"


def real_width_pipeline(blocks: tuple[int, ...] = ()):
    t5_tokenizer = build_t5_tokenizer()
    t5_tokenizer.model_max_length = 512  # FLUX.1-dev's max_sequence_length
    return FluxPipeline(
        vae=sd_autoencoder(
            0.3611, latent_channels=16, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False
        ),
        text_encoder=clip_text_encoder(768, 12, 12, "quick_gelu"),
        tokenizer=clip_tokenizer(),
        text_encoder_2=T5EncoderModel(
            T5Config(
                vocab_size=len(t5_tokenizer),
                d_model=4096,
                d_kv=64,
                d_ff=10240,
                num_layers=2,
                num_heads=64,
                feed_forward_proj="gated-gelu",
                is_encoder_decoder=False,
                use_cache=False,
            )
        ),
        tokenizer_2=t5_tokenizer,
        transformer=FluxTransformer2DModel(
            num_layers=blocks[0] if blocks else 1,
            num_single_layers=blocks[1] if blocks else 2,
            guidance_embeds=True,
        ),
        scheduler=build_flow_scheduler(),
    )


def edit_pipeline_of(pipeline: FluxPipeline) -> FluxKontextPipeline:
    """FLUX.1 Kontext of FLUX.1's components: the same parts (scripts/make_tiny_edit_base.py)."""
    return FluxKontextPipeline(**pipeline.components)
