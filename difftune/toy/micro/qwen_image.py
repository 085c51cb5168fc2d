"""Micro Qwen-Image: a Qwen2.5-VL language model and a Qwen-Image transformer over Qwen-Image's autoencoder; its
edit models' pipelines too (`pipeline`'s `edit`)."""

from diffusers import QwenImageEditPlusPipeline, QwenImagePipeline

from difftune.toy.micro import MicroSizes, TinyBase, mmdit
from difftune.toy.micro._latent_statistics import qwen_autoencoder
from difftune.toy.micro.flux import RECIPE as FLUX_RECIPE
from difftune.toy.tiny import (
    QWEN_HIDDEN_SIZE,
    build_qwen_processor,
    build_qwen_scheduler,
    build_qwen_text_encoder,
    build_qwen_tokenizer,
    build_qwen_transformer,
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
    autoencoder={"kind": "wan"},
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
