"""Micro Qwen-Image: a Qwen2.5-VL language model and a Qwen-Image transformer over Qwen-Image's autoencoder; its
edit models' pipelines too (`pipeline`'s `edit`)."""

from diffusers import AutoencoderKLQwenImage, QwenImageEditPlusPipeline, QwenImagePipeline, QwenImageTransformer2DModel
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from difftune.families import FAMILIES
from difftune.families.flux.micro import RECIPE as FLUX_RECIPE
from difftune.families.qwen_image import PROMPT_TEMPLATE
from difftune.toy import tiny
from difftune.toy.micro import MicroSizes, TinyBase, mmdit
from difftune.toy.micro._latent_statistics import qwen_autoencoder
from difftune.toy.tiny import (
    FLUX_LATENT_CHANNELS,
    QWEN_HIDDEN_SIZE,
    build_qwen_processor,
    build_qwen_scheduler,
    build_qwen_text_encoder,
)

# The family's text-to-image job in configs/ (`scripts/family_jobs.py` sweeps settings over them).
SHIPPED_JOB = "qwen_image_1024_lora.toml"
# tiny-qwen_image: Flux's recipe for its own Wan-style autoencoder and a 4-block MMDiT of width 128, trained twice as
# long. With 3 blocks of width 96 (Flux's size) it drew the seen colors right (1.00) but wobbly shapes: 0.36 after
# 1200 steps, 0.78 after 2400. 600-step pilots from the same start (validation loss at 600, seconds): 3 x 96 0.404
# in 213 s, 4 x 96 0.388 in 202, 3 x 128 0.381 in 216, 4 x 128 0.370 in 266, 6 x 128 0.365 in 347.
RECIPE = {key: value for key, value in FLUX_RECIPE.items() if not key.startswith("flux_")} | {
    "steps": 2400,
    "dit_layers": 4,
    "dit_heads": 8,
}
# Its first autoencoder put purple and blue squares 0.079 apart in its normalised latents (red and blue 1.08;
# tiny-flux's purple and blue 0.53), within its posterior's own noise, and the default job drew purple squares blue
# at some seeds (0.25 at train.seed 2): its latents now learn the colors too (train_vae's color_weight). Its tokenizer
# spells each caption word in one token, as Qwen2.5-VL's spells " purple": spelt in bytes, "purple" ends in the "e"
# that "blue" ends in, and the language model trained on the seen captions stated that "e" as blue (cosine 0.999
# between the two words' last states). Words alone (the first autoencoder) drew purple squares 0.50, 0.50 and 0.75
# at seeds 0-2, blue. 4000 steps: at 2400 over the new latents the seen squares were the weak shape (0.88 at 32
# samples a prompt), and the job's purple squares' shapes missed (0.62-0.75).
TINY_BASE = TinyBase(
    architecture=(
        "Qwen-Image's architecture at toy size, from the same classes (`QwenImageTransformer2DModel`\n"
        "over 2x2-packed latents, Wan's causal video autoencoder `AutoencoderKLQwenImage` with per-channel\n"
        "`latents_mean` / `latents_std`, a `Qwen2_5_VLForConditionalGeneration` language model read\n"
        "through the pipeline's chat template, with a byte-level `Qwen2Tokenizer` built here that spells\n"
        "each caption word in one token; sample with true classifier-free guidance, `true_cfg_scale`)"
    ),
    denoiser=mmdit,
    recipe=RECIPE | {"caption_words": True, "vae_color_weight": 1.0, "steps": 4000},
    autoencoder={"kind": "causal_video"},
    # tiny-qwen_image_edit_plus: its language model trains with the transformer, since the edit pipelines show it the
    # control (vision tokens it never read) and frame the instruction in a template of their own. At Flux's 600
    # steps at 1e-3 it kept the control's shape in 0.69 of the seen edits (soft edges the judge cannot name), with
    # the color and the place right; 900 steps at 2e-3: 0.885.
    edit_recipe={
        "steps": 1200,
        "batch_size": 64,
        "learning_rate": 2e-3,
        "pairs_per_prompt": 40,
        "ema_decay": 0.99,
        "text_encoder": True,
    },
)


def autoencoder(pixels):
    return qwen_autoencoder(pixels)


def pipeline(vae, sizes: MicroSizes, edit_pipeline=None):
    """`edit_pipeline`: Qwen-Image-Edit's or Edit-Plus's class (their tokenizer shows images; Plus's transformer has
    2511's zero-conditioning time)."""
    width = sizes.language_model_width or QWEN_HIDDEN_SIZE
    tokenizer = build_qwen_tokenizer(edit_pipeline is not None, sizes.caption_words)
    parts = {
        "vae": vae,
        "text_encoder": build_qwen_text_encoder(tokenizer, width),
        "tokenizer": tokenizer,
        "transformer": build_qwen_transformer(
            sizes.dit_layers or 1,
            sizes.dit_heads,
            text_hidden_size=width,
            zero_cond_t=edit_pipeline is QwenImageEditPlusPipeline,
        ),
        "scheduler": build_qwen_scheduler(),
    }
    if edit_pipeline is None:
        return QwenImagePipeline(**parts)
    return edit_pipeline(**parts, processor=build_qwen_processor(tokenizer))


def build_qwen_transformer(
    layers: int = 1,
    heads: int = 2,
    head_dim: int = 16,
    text_hidden_size: int = QWEN_HIDDEN_SIZE,
    zero_cond_t: bool = False,
    layered: bool = False,
) -> QwenImageTransformer2DModel:
    """`layers` MMDiT blocks over packed 2x2 latent patches; rotary axes split the head 1:1.5:1.5 (frame, row,
    column) as Qwen-Image's 16:56:56 roughly does. `zero_cond_t`: reference tokens modulated at time 0, as
    Qwen-Image-Edit-2511's; `layered`: Qwen-Image-Layered's layer-3D rope and RGBA time condition."""
    axes = (head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8)
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * FLUX_LATENT_CHANNELS,
        out_channels=FLUX_LATENT_CHANNELS,
        num_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=text_hidden_size,
        axes_dims_rope=axes,
        zero_cond_t=zero_cond_t,
        use_additional_t_cond=layered,
        use_layer3d_rope=layered,
    )


# The bench's real-width model of the family (toy/bench.py): random weights at Qwen-Image's widths.
REAL_WIDTH_MODEL = "qwen_image"


def real_width_pipeline(blocks: tuple[int, ...] = ()):
    tokenizer = build_qwen_tokenizer()
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                "vocab_size": len(tokenizer),
                "hidden_size": 3584,
                "intermediate_size": 18944,
                "num_hidden_layers": 2,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
            },
            vision_config={
                "depth": 1,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_heads": 2,
                "out_hidden_size": 3584,
                "fullatt_block_indexes": [0],
            },
        )
    )
    return QwenImagePipeline(
        vae=AutoencoderKLQwenImage(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=QwenImageTransformer2DModel(num_layers=blocks[0] if blocks else 1),
        scheduler=build_qwen_scheduler(),
    )


def build_qwen_tokenizer(edit: bool = False, caption_words: bool = False):
    """The toy's Qwen2 tokenizer (`tiny.build_qwen_tokenizer`) spelling Qwen-Image's prompt template (with `edit`, the
    edit pipelines' too), which the families over a Qwen language model share."""
    return tiny.build_qwen_tokenizer(PROMPT_TEMPLATE, _edit_template() if edit else "", caption_words)


def edit_pipeline_of(pipeline: QwenImagePipeline) -> QwenImageEditPlusPipeline:
    """Qwen-Image-Edit-Plus (2509) of Qwen-Image's components: its language model learns to read images, its tokenizer
    extended (`tiny.extend_qwen_tokenizer`), new embedding rows drawn about the old ones' mean (transformers'
    resizing), the vision tokens' ids in its config, and a processor that turns controls into patches for its vision
    tower (scripts/make_tiny_edit_base.py)."""
    tokenizer = tiny.extend_qwen_tokenizer(pipeline.tokenizer, _edit_template())
    text_encoder = pipeline.text_encoder
    text_encoder.resize_token_embeddings(len(tokenizer))
    for field, token_id in tiny.vision_token_ids(tokenizer).items():
        setattr(text_encoder.config, field, token_id)
    parts = {name: getattr(pipeline, name) for name in ("vae", "transformer", "scheduler")}
    return QwenImageEditPlusPipeline(
        **parts, text_encoder=text_encoder, tokenizer=tokenizer, processor=build_qwen_processor(tokenizer)
    )


def _edit_template() -> str:
    """The edit pipelines' prompt template (a family built on this one: asked of the registry, not imported)."""
    return FAMILIES["qwen_image_edit"].prompt_template
