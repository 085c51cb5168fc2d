"""Micro Chroma: a T5 text encoder and a Chroma transformer over a 16-channel KL autoencoder."""

from diffusers import ChromaPipeline, ChromaTransformer2DModel

from difftune.families.flux.micro import RECIPE as FLUX_RECIPE
from difftune.toy.micro import MicroSizes, TinyBase, two_stream_transformer
from difftune.toy.micro._kl import kl_autoencoder
from difftune.toy.tiny import (
    FLUX_LATENT_CHANNELS,
    T5_HIDDEN_SIZE,
    build_flow_scheduler,
    build_t5_encoder,
    build_t5_tokenizer,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them).
SHIPPED_JOB = "chroma_lora.toml"
# tiny-chroma: Flux's recipe for Chroma's transformer (Flux's blocks, their modulation from one small approximator)
# reading T5 alone, over tiny-flux's autoencoders (Chroma's is Flux.1's), trained 4000 steps: after Flux's 1200 (515 s)
# it drew the seen prompts at 1.00 color / 0.97 shape, but every LoRA of the default job tried made its seen shapes
# wobbly (forgetting 0.12-0.24); after 2000 the job forgot 0.03-0.05 and drew purple squares at 0.75-0.88; after 4000
# it forgets 0-0.02 and, at the job's 2400 steps, draws purple squares at 1.00 (docs/benchmarks.md, Chroma).
TINY_BASE = TinyBase(
    architecture=(
        "Chroma's architecture at toy size, from the same classes (`ChromaTransformer2DModel`: Flux.1's blocks\n"
        "whose modulation one small approximator makes, over 2x2-packed latents of Flux.1's kind of 16-channel\n"
        "`AutoencoderKL` (tiny-flux's), `T5EncoderModel` alone with a character-level `T5TokenizerFast`; sample\n"
        "with classifier-free guidance, `guidance_scale`)"
    ),
    denoiser=two_stream_transformer,
    recipe=FLUX_RECIPE | {"steps": 4000},
    autoencoders_from="tiny-flux",
)


def autoencoder(pixels):
    return kl_autoencoder(pixels, sixteen_channels=True)


def pipeline(vae, sizes: MicroSizes):
    tokenizer = build_t5_tokenizer()
    return ChromaPipeline(
        vae=vae,
        text_encoder=build_t5_encoder(len(tokenizer)),
        tokenizer=tokenizer,
        transformer=build_chroma_transformer(sizes.flux_layers, sizes.flux_heads),
        scheduler=build_flow_scheduler(),
    )


def build_chroma_transformer(layers: tuple[int, int] = (1, 1), heads: int = 2, head_dim: int = 16):
    """Flux's micro transformer (`build_flux_transformer`) pruned as Chroma's is: a one-layer approximator makes
    every block's modulation."""
    axes = (head_dim // 8 * 2, head_dim * 3 // 8, head_dim * 3 // 8)
    return ChromaTransformer2DModel(
        patch_size=1,
        in_channels=4 * FLUX_LATENT_CHANNELS,
        num_layers=layers[0],
        num_single_layers=layers[1],
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=T5_HIDDEN_SIZE,
        axes_dims_rope=axes,
        approximator_num_channels=16,
        approximator_hidden_dim=32,
        approximator_layers=1,
    )
