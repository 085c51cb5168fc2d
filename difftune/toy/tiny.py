"""Tiny Stable-Diffusion-, SDXL-, Flux- and Qwen-Image-architecture models and synthetic captioned images, built
with no downloads.

The same diffusers/transformers classes as SD 1.x (UNet2DConditionModel, AutoencoderKL,
CLIPTextModel + CLIPTokenizer), SDXL (a second, projecting text encoder, a UNet with `text_time`
size/crop conditioning) and Flux.1 (FluxTransformer2DModel, a 16-channel AutoencoderKL with a shift factor,
CLIP for the pooled embedding and T5EncoderModel + T5TokenizerFast for the token states) and Qwen-Image
(QwenImageTransformer2DModel, Wan's video autoencoder `AutoencoderKLQwenImage` with per-channel statistics, a
Qwen2.5-VL language model and a byte-level BPE Qwen2Tokenizer), shrunk so that CPU tests and the bundled default
jobs run in seconds. The tokenizers are (nearly) character level with vocabularies written here, so nothing is
fetched.
"""

from __future__ import annotations

import json
import math
import string
import tempfile
from pathlib import Path

import numpy as np
import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLLTX2Video,
    AutoencoderKLQwenImage,
    AutoencoderKLQwenImage21,
    AutoencoderKLWan,
    AutoencoderTiny,
    DDPMScheduler,
    FlowMatchEulerDiscreteScheduler,
)
from PIL import Image, ImageDraw
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    ByT5Tokenizer,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    Mistral3Model,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLModel,
    Qwen3VLProcessor,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from difftune.data.dataset import image_to_tensor
from difftune.models.processors import load_without_video_processor

IMAGE_SIZE = 32
TOKENIZER_MAX_LENGTH = 32
TEXT_HIDDEN_SIZE = 64
# SDXL's second encoder is wider than its first (1280 vs 768); diffusers' single-file reader tells the two
# apart by that width, so the tiny pair differs too.
TEXT_2_HIDDEN_SIZE = 96
TEXT_2_PROJECTION_SIZE = 64
TIME_EMBED_SIZE = 8  # per micro-conditioning number (SDXL: 256)
T5_HIDDEN_SIZE = 64
FLUX_LATENT_CHANNELS = 16  # as Flux.1's autoencoder; packed 2x2 into 64-wide tokens
QWEN_HIDDEN_SIZE = 32  # the tiny Qwen2.5-VL's width (Qwen-Image's: 3584)
FLUX2_LATENT_CHANNELS = 8  # FLUX.2's autoencoder makes 32; patched 2x2 into 4x as many
FLUX2_TEXT_HIDDEN_SIZE = 16  # the tiny language models of FLUX.2 are deep (27 and 30 layers), so narrow
# Mistral's control tokens, as FLUX.2 [dev]'s tokenizer has them (the image ones name the vision tower's inputs).
MISTRAL_SPECIAL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "<pad>",
    "[INST]",
    "[/INST]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
)
# Mistral Small 3.1's chat template in short: the system turn, then user turns, message contents as text or as lists
# of typed parts (how `Flux2Pipeline`'s `format_input` writes them).
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['content'] is string %}{% set text = message['content'] "
    "%}{% else %}{% set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join('') %}{% endif %}{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]{% elif "
    "message['role'] == 'user' %}[INST]{{ text }}[/INST]{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)
KREA2_TEXT_LAYERS = 3  # the tiny Qwen3-VL's depth; Krea 2 stacks 12 of its 36 layers, the micro model all 3
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
IDEOGRAM4_TEXT_LAYERS = 36  # Qwen3-VL 8B's depth: Ideogram 4 reads 13 of its layers, up to the 36th
# Qwen3-VL's chat template for text turns (a message's content a list of parts), as Ideogram 4's prompts use it.
# An image part is placed as Qwen3-VL's own template places it.
QWEN3_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{% if message.content is string "
    "%}{{ message.content }}{% else %}{% for part in message.content %}{% if part.type == 'image' "
    "%}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part.text }}{% endif %}{% endfor %}{% "
    "endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")  # an edit base's prompts show images
# Qwen3's chat template as Z-Image's tokenizer applies it to one user turn: thinking enabled adds nothing.
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# The tiny language model sees a control as at most 56 x 56 pixels: 4 x 4 patches of 14, merged 2 x 2 into 4 tokens.
QWEN_VISION_PIXELS = (28 * 28, 56 * 56)

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (140, 50, 180),
}
SHAPES = ("circle", "square", "triangle")
CAPTION_WORDS = (*COLORS, *SHAPES)  # `a <color> <shape>`: "a" is one byte already


def character_vocabulary() -> dict[str, int]:
    """CLIP-style BPE vocabulary with no merges: each character, plain and word-final, plus the specials."""
    chars = _characters()
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    return {token: i for i, token in enumerate(tokens)}


def _characters() -> list[str]:
    return [c for c in string.ascii_lowercase + string.digits + ",.!?'-_:;()<>" if c != " "]


def build_tokenizer() -> CLIPTokenizer:
    vocab = character_vocabulary()
    with tempfile.TemporaryDirectory() as tmp:
        vocab_file, merges_file = Path(tmp, "vocab.json"), Path(tmp, "merges.txt")
        vocab_file.write_text(json.dumps(vocab))
        merges_file.write_text("#version: 0.2\n")
        return CLIPTokenizer(str(vocab_file), str(merges_file), model_max_length=TOKENIZER_MAX_LENGTH)


def build_text_encoder(
    hidden_size: int = TEXT_HIDDEN_SIZE, projection_size: int | None = None, positions: int = TOKENIZER_MAX_LENGTH
):
    """A 2-layer CLIP text encoder; with `projection_size`, a `CLIPTextModelWithProjection` (SDXL's second).
    `positions`: more than the tokenizer's length for HiDream, whose long-context CLIP encoders read 128 tokens."""
    vocab = character_vocabulary()
    config = CLIPTextConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        projection_dim=projection_size or 512,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=positions,
        bos_token_id=vocab["<|startoftext|>"],
        eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab["<|endoftext|>"],
    )
    return CLIPTextModelWithProjection(config) if projection_size else CLIPTextModel(config)


def build_t5_tokenizer() -> T5TokenizerFast:
    """T5's layout (a SentencePiece-style unigram model: `<pad>` 0, `</s>` 1 appended to every text, `<unk>` 2,
    word starts marked by `▁`), over single characters."""
    chars = _characters()
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [(c, -2.0) for c in chars] + [("▁" + c, -2.0) for c in chars]
    backend = Tokenizer(models.Unigram(pieces, unk_id=2))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(
        tokenizer_object=backend,
        model_max_length=TOKENIZER_MAX_LENGTH,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_ids=0,
    )


def t5_encoder_settings(vocab_size: int) -> dict:
    """A 2-layer T5 encoder's config values, for T5 (`build_t5_encoder`) and umT5 (Wan's) alike."""
    return {
        "vocab_size": vocab_size,
        "d_model": T5_HIDDEN_SIZE,
        "d_kv": 16,
        "d_ff": 2 * T5_HIDDEN_SIZE,
        "num_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 32,
        "feed_forward_proj": "gated-gelu",
        "is_encoder_decoder": False,
        "use_cache": False,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
    }


def build_t5_encoder(vocab_size: int) -> T5EncoderModel:
    """A 2-layer T5 encoder (Flux's `text_encoder_2`: its last hidden state is the token conditioning)."""
    return T5EncoderModel(T5Config(**t5_encoder_settings(vocab_size)))


def build_sd3_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """SD3's and SD3.5's scheduler config: one shift (3) at every size."""
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)


def build_flow_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """FLUX.1-dev's scheduler config: a shift that grows with the image's token count."""
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def build_qwen_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Qwen-Image's scheduler config: a gentler resolution shift than Flux's, and sampling sigmas stretched to end
    at 0.02."""
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )


def build_qwen_tokenizer(template: str, edit_template: str = "", caption_words: bool = False) -> Qwen2Tokenizer:
    """Qwen2's layout (byte-level BPE; `<|endoftext|>` pads, `<|im_start|>` / `<|im_end|>` frame chat turns) with
    no merges but those that spell the words of the family's prompt `template` (Qwen-Image's system prompt is 34
    tokens, as in Qwen2.5-VL's own vocabulary: the pipeline drops that many), and captions are byte level.
    `edit_template`: extended for the edit pipelines' template (`extend_qwen_tokenizer`). `caption_words`: extended
    with a token for each word the captions use (`CAPTION_WORDS`, the held-out color's too), as a real vocabulary
    spells " purple" in one token: spelt in bytes, the held-out word ends in the same letter as a seen one ("purple",
    "blue"), and a small language model trained on the seen captions alone states that letter as the seen color."""
    bytes_vocab = {byte: i for i, byte in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = _qwen_bpe_tokenizer(bytes_vocab, [], template, QWEN_SPECIAL_TOKENS)
    if caption_words:
        tokenizer = _extended(tokenizer, "".join(f" {word}" for word in CAPTION_WORDS), QWEN_SPECIAL_TOKENS)
    return extend_qwen_tokenizer(tokenizer, edit_template) if edit_template else tokenizer


def extend_qwen_tokenizer(tokenizer: Qwen2Tokenizer, edit_template: str) -> Qwen2Tokenizer:
    """`tokenizer` as the edit pipelines need it: merges that spell the words of their `edit_template` (64 tokens, as
    theirs) and the vision tokens that place an image in a prompt, appended: every token keeps its id, so a language
    model trained on `tokenizer` keeps its embeddings and grows new rows (text may split into the new, longer
    tokens)."""
    return _extended(tokenizer, edit_template, QWEN_SPECIAL_TOKENS + QWEN_VISION_TOKENS)


def _extended(tokenizer: Qwen2Tokenizer, text: str, specials: tuple[str, ...]) -> Qwen2Tokenizer:
    """`tokenizer` with merges that spell each word of `text` whole, and `specials`, appended (every id kept)."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    merges = [tuple(merge) if isinstance(merge, list) else tuple(merge.split(" ")) for merge in model["merges"]]
    return _qwen_bpe_tokenizer(model["vocab"], merges, text, specials)


def _qwen_bpe_tokenizer(
    vocab: dict[str, int], merges: list[tuple[str, str]], template: str, specials: tuple[str, ...]
) -> Qwen2Tokenizer:
    """A byte-level BPE tokenizer of `vocab` and `merges`, plus merges (and ids after the last) that spell each word of
    `template` whole, and `specials` after them where missing."""
    vocab, merges = dict(vocab), list(merges)
    pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    template = template.replace("{}", "")
    for special in specials:
        template = template.replace(special, "\0")
    words = {word for chunk in template.split("\0") for word, _ in pre_tokenizer.pre_tokenize_str(chunk)}
    known = set(merges)
    # Each word's prefix chain first: that is how the bundled bases' vocabularies were made, and their ids must hold.
    for word in sorted(words):
        for end in range(1, len(word)):
            if (word[:end], word[end]) not in known:
                known.add((word[:end], word[end]))
                merges.append((word[:end], word[end]))
            vocab.setdefault(word[: end + 1], len(vocab))
    for word in sorted(words):  # a word whose pieces merged first by older merges ("user" in " user") is joined
        pieces = [token.value for token in models.BPE(vocab=vocab, merges=merges).tokenize(word)]
        while len(pieces) > 1:
            merges.append((pieces[0], pieces[1]))
            vocab.setdefault(pieces[0] + pieces[1], len(vocab))
            pieces[:2] = [pieces[0] + pieces[1]]
    for special in specials:
        vocab.setdefault(special, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    tokenizer = Qwen2Tokenizer(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        padding_side="right",
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(specials[1:])})
    return tokenizer


def build_qwen_processor(tokenizer: Qwen2Tokenizer) -> Qwen2VLProcessor:
    """The edit pipelines' processor: Qwen2-VL's image processor (14 px patches, 2 x 2 merged) over images of at most
    `QWEN_VISION_PIXELS`, and `tokenizer`."""
    low, high = QWEN_VISION_PIXELS
    return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=low, max_pixels=high), tokenizer=tokenizer)


def qwen_text_config(vocab_size: int, hidden_size: int, layers: int) -> dict:
    """A `layers`-layer Qwen2.5-VL language model's config, its multimodal rotary sections scaled to its head size."""
    head_dim = hidden_size // 2
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 1024,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "mrope_section": [head_dim // 8, head_dim * 3 // 16, head_dim * 3 // 16],
        },
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,  # Qwen's ids are past this vocabulary
    }


def build_qwen_text_encoder(
    tokenizer: Qwen2Tokenizer, hidden_size: int = QWEN_HIDDEN_SIZE, layers: int = 2
) -> Qwen2_5_VLForConditionalGeneration:
    """A `layers`-layer Qwen2.5-VL language model with Qwen2.5-VL's multimodal rotary sections scaled to its head size,
    and a 1-block vision tower (run by the edit pipelines, whose prompts show images: the image tokens are
    `tokenizer`'s)."""
    config = Qwen2_5_VLConfig(
        text_config=qwen_text_config(len(tokenizer), hidden_size, layers),
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": hidden_size,
            "fullatt_block_indexes": [0],
        },
        **vision_token_ids(tokenizer),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def vision_token_ids(tokenizer: Qwen2Tokenizer) -> dict[str, int]:
    """The language model's config fields that name the tokens placing an image, for those `tokenizer` has."""
    return {
        f"{name}_token_id": tokenizer.convert_tokens_to_ids(token)
        for name, token in zip(("vision_start", "vision_end", "image"), QWEN_VISION_TOKENS, strict=True)
        if token in tokenizer.get_vocab()
    }


def build_qwen_vae(
    latents_mean=(0.0,) * FLUX_LATENT_CHANNELS,
    latents_std=(1.0,) * FLUX_LATENT_CHANNELS,
    base_dim: int = 16,
    input_channels: int = 3,
) -> AutoencoderKLQwenImage:
    """Wan's causal video autoencoder with two downsamplings (32 px -> 8x8 latents, like the other tiny
    autoencoders), 16 channels and per-channel statistics. `input_channels` 4: of RGBA images (Qwen-Image-Layered's)."""
    return AutoencoderKLQwenImage(
        input_channels=input_channels,
        base_dim=base_dim,
        z_dim=FLUX_LATENT_CHANNELS,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True],
        latents_mean=list(latents_mean),
        latents_std=list(latents_std),
    )


def build_wan_vae(
    latents_mean=(0.0,) * FLUX_LATENT_CHANNELS, latents_std=(1.0,) * FLUX_LATENT_CHANNELS, base_dim: int = 16
) -> AutoencoderKLWan:
    """Wan 2.1's causal video autoencoder (Qwen-Image's kind, `build_qwen_vae`) as `WanPipeline` reads it: its
    spatial and temporal factors stated (4 and 2 here) for the pipeline's latent shapes."""
    return AutoencoderKLWan(
        base_dim=base_dim,
        z_dim=FLUX_LATENT_CHANNELS,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True],
        latents_mean=list(latents_mean),
        latents_std=list(latents_std),
        scale_factor_spatial=4,
        scale_factor_temporal=2,
    )


def build_byt5_tokenizer() -> ByT5Tokenizer:
    """ByT5's tokenizer (bytes, no vocabulary file): HunyuanImage 2.1's glyph text reader."""
    return ByT5Tokenizer()


def build_qwen3_tokenizer(think_block: bool = False) -> Qwen2Tokenizer:
    """Qwen3's layout (byte-level BPE, Qwen2Tokenizer) with merges that spell the chat template's words, and the chat
    template (`QWEN3_CHAT_TEMPLATE`) that `ZImagePipeline` and `Flux2KleinPipeline` apply; `think_block`: merges for
    the empty think block too, which FLUX.2 [klein]'s prompts end with (thinking disabled)."""
    bytes_vocab = {byte: i for i, byte in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    template = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" * think_block)
    tokenizer = _qwen_bpe_tokenizer(bytes_vocab, [], template, QWEN_SPECIAL_TOKENS)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def build_qwen3_text_encoder(
    tokenizer: Qwen2Tokenizer, hidden_size: int = QWEN_HIDDEN_SIZE, layers: int = 3, causal_lm: bool = False
) -> Qwen3Model | Qwen3ForCausalLM:
    """A Qwen3 language model: 3 layers for Z-Image (which reads the second-to-last layer's states), 27 with its
    language-model head for FLUX.2 [klein] (which reads layers 9, 18 and 27)."""
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=hidden_size // 2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
    )
    return Qwen3ForCausalLM(config) if causal_lm else Qwen3Model(config)


def build_qwen3_vl_text_encoder(
    tokenizer: Qwen2Tokenizer,
    hidden_size: int = QWEN_HIDDEN_SIZE,
    layers: int = KREA2_TEXT_LAYERS,
    with_head: bool = False,
) -> Qwen3VLModel | Qwen3VLForConditionalGeneration:
    """A Qwen3-VL language model (Krea 2's text encoder; `with_head`: with its language-model head, as Qwen-Image 2.1
    keeps it) with its interleaved multimodal rotary sections scaled to its head size, and a 1-block vision tower that
    text prompts never run; the tokens that place an image are `tokenizer`'s where it has them."""
    head_dim = hidden_size // 2
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": layers,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": head_dim,
            "max_position_embeddings": 1024,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_interleaved": True,
                "mrope_section": [head_dim // 8, head_dim * 3 // 16, head_dim * 3 // 16],
            },
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": hidden_size,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [],
        },
        **vision_token_ids(tokenizer),
    )
    return Qwen3VLForConditionalGeneration(config) if with_head else Qwen3VLModel(config)


def build_qwen3_vl_processor(common_text: str) -> Qwen3VLProcessor:
    """A Qwen3-VL processor: a byte-level Qwen tokenizer with merges that spell the words of `common_text` (a
    pipeline's template), the vision tokens that place an image, and Qwen3-VL's chat template, beside Qwen2-VL's
    image processor (text prompts never run it)."""
    bytes_vocab = {byte: i for i, byte in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = _qwen_bpe_tokenizer(bytes_vocab, [], common_text, QWEN_SPECIAL_TOKENS + QWEN_VISION_TOKENS)
    low, high = QWEN_VISION_PIXELS
    load_without_video_processor(Qwen3VLProcessor)  # as the families that read it do, where torchvision is missing
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(min_pixels=low, max_pixels=high),
        tokenizer=tokenizer,
        chat_template=QWEN3_VL_CHAT_TEMPLATE,
    )


def build_qwen_image21_vae(
    latent_channels: int = FLUX_LATENT_CHANNELS, base_dim: int = 8, dim_mult: tuple[int, ...] = (1, 1, 1, 1, 1)
) -> AutoencoderKLQwenImage21:
    """Qwen-Image 2.1's autoencoder of RGBA images: four downsamplings to 16x, as its pipeline assumes (32 px -> 2 x 2
    latents), per-channel statistics (0 and 1 until set from latents)."""
    return AutoencoderKLQwenImage21(
        base_dim=base_dim,
        decoder_base_dim=base_dim,
        z_dim=latent_channels,
        dim_mult=list(dim_mult),
        num_res_blocks=1,
        temperal_downsample=[False, True, True, True],
        in_channels=4,
        out_channels=4,
        latents_mean=[0.0] * latent_channels,
        latents_std=[1.0] * latent_channels,
    )


def build_flux2_vae(latent_channels: int = FLUX2_LATENT_CHANNELS) -> AutoencoderKLFlux2:
    """FLUX.2's autoencoder with two downsamplings (32 px -> 8x8 latents, patched 2x2 into 4x4 tokens of
    4 x `latent_channels`) and its batch norm over the patched channels."""
    return AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(32, 64, 64),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=32,
    )


def set_batch_norm_statistics(vae: AutoencoderKLFlux2, patched_latents: torch.Tensor) -> None:
    """FLUX.2's autoencoder's running statistics of its patched latents (B, C, h, w), as training it leaves them."""
    vae.bn.running_mean.copy_(patched_latents.mean(dim=(0, 2, 3)))
    vae.bn.running_var.copy_(patched_latents.var(dim=(0, 2, 3)))


def build_mistral_tokenizer(bos: bool = False) -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges, Mistral's control tokens and a chat template that frames a system and a user
    turn as Mistral Small 3.1's does. FLUX.2 [dev] keeps a Pixtral processor as its tokenizer; the pipeline asks it
    only for `apply_chat_template`, which a tokenizer answers alike (and a processor would need torchvision). `bos`:
    plain text starts with `<s>`, as Ministral 3's tokenizer (ERNIE-Image's) adds it."""
    vocab = {token: i for i, token in enumerate(MISTRAL_SPECIAL_TOKENS)}
    vocab |= {byte: len(vocab) + i for i, byte in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    if bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=list(MISTRAL_SPECIAL_TOKENS[4:]),
    )
    tokenizer.chat_template = MISTRAL_CHAT_TEMPLATE
    return tokenizer


def build_mistral3_text_encoder(
    tokenizer, hidden_size: int = FLUX2_TEXT_HIDDEN_SIZE, layers: int = 30, with_head: bool = True
) -> Mistral3ForConditionalGeneration | Mistral3Model:
    """A Mistral 3 language model (with a 1-layer Pixtral vision tower, which text prompts never run) deep enough for
    the layers FLUX.2 [dev] reads (10, 20 and 30); `with_head` false: the model without its language head, as
    ERNIE-Image keeps it (`Mistral3Model`)."""
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": layers,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": hidden_size // 2,
            "max_position_embeddings": 1024,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 16,
            "patch_size": 16,
            "image_size": 64,
        },
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=1,
    )
    return Mistral3ForConditionalGeneration(config) if with_head else Mistral3Model(config)


def build_llama_tokenizer() -> PreTrainedTokenizerFast:
    """Llama 3's layout (byte-level BPE with no merges here; `<|begin_of_text|>` before every text, `<|end_of_text|>`,
    which HiDream's pipeline pads with)."""
    special = ("<|begin_of_text|>", "<|end_of_text|>")
    vocab = {token: i for i, token in enumerate(special)}
    vocab |= {byte: len(vocab) + i for i, byte in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[(special[0], 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=special[0], eos_token=special[1])


def build_vae(scaling_factor: float = 1.0, latent_channels: int = 4, downsampling: int = 4) -> AutoencoderKL:
    # Three blocks: 32 px images -> 8x8 latents (downsampling 4, where SD's VAE has 8); four for Lumina 2, whose
    # pipeline assumes the real 8.
    blocks = int(math.log2(downsampling)) + 1
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        block_out_channels=(32,) + (64,) * (blocks - 1),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=32,
        sample_size=IMAGE_SIZE,
        scaling_factor=scaling_factor,
    )


def build_taesd(latent_channels: int = 4, downsampling: int = 4) -> AutoencoderTiny:
    """A TAESD-shaped autoencoder with the tiny VAE's downsampling (4; 8 for FLUX.2's patched latents) and latent
    channels."""
    blocks = int(math.log2(downsampling)) + 1
    return AutoencoderTiny(
        encoder_block_out_channels=(32,) * blocks,
        decoder_block_out_channels=(32,) * blocks,
        num_encoder_blocks=(1,) * blocks,
        num_decoder_blocks=(1,) * blocks,
        latent_channels=latent_channels,
        upsampling_scaling_factor=2,
    )


def build_noise_scheduler() -> DDPMScheduler:
    # Stable Diffusion 1.x's noise schedule.
    return DDPMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type="epsilon",
        clip_sample=False,
        steps_offset=1,
    )


def set_latent_statistics(vae: AutoencoderKLQwenImage | AutoencoderKLLTX2Video, latents: torch.Tensor) -> None:
    """Per-channel `latents_mean` / `latents_std` of `latents` (B, C, h, w), or clips' (B, C, t, h, w), as Wan's
    autoencoder states them in its config, or LTX-2's keeps them: as buffers of the model."""
    dims = (0, *range(2, latents.dim()))
    mean, std = latents.mean(dim=dims), latents.std(dim=dims)
    if isinstance(vae, AutoencoderKLLTX2Video):
        vae.latents_mean.copy_(mean)
        vae.latents_std.copy_(std)
    else:
        vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())


def set_latent_scaling(vae: AutoencoderKL, latents: torch.Tensor, shift: bool) -> None:
    """Scaling factor 1/std of `latents` (unscaled posterior means); with `shift`, the shift factor their mean."""
    shift_factor = float(latents.mean()) if shift else 0.0
    vae.register_to_config(scaling_factor=float(1.0 / (latents - shift_factor).std()))
    if shift:
        vae.register_to_config(shift_factor=shift_factor)


def render_tensors(count: int, seed: int, colors=tuple(COLORS)) -> torch.Tensor:
    """(count, 3, 32, 32) renders in [-1, 1]."""
    return torch.stack([image_to_tensor(image) for image, _ in shape_images(count, seed, colors=colors)])


def render_shape(
    shape: str, color: str, rng: np.random.Generator, size: int = IMAGE_SIZE, silhouette: bool = False
) -> Image.Image:
    """One shape in one color on a plain light background, with random size and position; `silhouette`: the same
    draws, the shape white on black (a ControlNet's control image: where the shape goes)."""
    background = tuple(int(v) for v in rng.integers(200, 256, size=3))
    image = Image.new("RGB", (size, size), (0, 0, 0) if silhouette else background)
    draw = ImageDraw.Draw(image)
    extent = rng.uniform(0.45, 0.75) * size
    cx, cy = rng.uniform(extent / 2, size - extent / 2, size=2)
    _draw_shape(draw, shape, (255, 255, 255) if silhouette else COLORS[color], cx, cy, extent)
    return image


def _draw_shape(
    draw: ImageDraw.ImageDraw, shape: str, fill: tuple[int, int, int], cx: float, cy: float, extent: float
) -> None:
    left, top, right, bottom = cx - extent / 2, cy - extent / 2, cx + extent / 2, cy + extent / 2
    if shape == "circle":
        draw.ellipse((left, top, right, bottom), fill=fill)
    elif shape == "square":
        draw.rectangle((left, top, right, bottom), fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, top), (right, bottom), (left, bottom)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


def shape_images(count: int, seed: int, colors=tuple(COLORS), shapes=SHAPES) -> list[tuple[Image.Image, str]]:
    """`count` (image, caption) pairs cycling through every color/shape pair, deterministic by seed."""
    rng = np.random.default_rng(seed)
    pairs = [(color, shape) for color in colors for shape in shapes]
    out = []
    for i in range(count):
        color, shape = pairs[i % len(pairs)]
        out.append((render_shape(shape, color, rng), f"a {color} {shape}"))
    return out


DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}  # (x, y) per frame, y down
CLIP_FRAMES = 5  # the tiny Wan autoencoder's 2k + 1
CLIP_SPEED = 2  # pixels per frame: 8 px from the first frame to the fifth


def render_moving_shape(
    shape: str,
    color: str,
    direction: str,
    rng: np.random.Generator,
    frames: int = CLIP_FRAMES,
    size: int = IMAGE_SIZE,
    speed: int = CLIP_SPEED,
) -> list[Image.Image]:
    """A shape of one color sliding `speed` px a frame towards `direction` over one plain light background, from a
    random start that keeps it whole in every frame; its size random, at most 60% of the frame so that it has room.
    (At 30-45% and 3 px a frame, tiny-wan's autoencoder gave back shapes the judge named in 0.69 of frames: 2.5 to 3.5
    latent pixels across lose their corners; at 45-60% and 2 px, 0.97.)"""
    background = tuple(int(v) for v in rng.integers(200, 256, size=3))
    extent = rng.uniform(0.45, 0.6) * size
    travel = speed * (frames - 1)
    dx, dy = DIRECTIONS[direction]
    low = [extent / 2 + travel * max(0, -d) for d in (dx, dy)]
    high = [size - extent / 2 - travel * max(0, d) for d in (dx, dy)]
    cx, cy = (rng.uniform(lo, hi) for lo, hi in zip(low, high, strict=True))
    clip = []
    for k in range(frames):
        image = Image.new("RGB", (size, size), background)
        x, y = cx + dx * speed * k, cy + dy * speed * k
        _draw_shape(ImageDraw.Draw(image), shape, COLORS[color], x, y, extent)
        clip.append(image)
    return clip


def moving_shape_clips(
    count: int, seed: int, colors=tuple(COLORS), shapes=SHAPES, directions=tuple(DIRECTIONS), frames: int = CLIP_FRAMES
) -> list[tuple[list[Image.Image], str]]:
    """`count` (frames, caption) pairs cycling through every color/shape/direction, deterministic by seed:
    "a red circle moving left"."""
    rng = np.random.default_rng(seed)
    kinds = [(color, shape, direction) for color in colors for shape in shapes for direction in directions]
    out = []
    for i in range(count):
        color, shape, direction = kinds[i % len(kinds)]
        out.append((render_moving_shape(shape, color, direction, rng, frames), f"a {color} {shape} moving {direction}"))
    return out


def write_clip_folder(folder: Path, clips: list[tuple[list[Image.Image], str]]) -> None:
    """`NNNN.mkv` (lossless) with its caption in `NNNN.txt`."""
    from difftune.data.clips import write_clip

    folder.mkdir(parents=True, exist_ok=True)
    for i, (frames, caption) in enumerate(clips):
        write_clip(folder / f"{i:04d}.mkv", frames, lossless=True)
        (folder / f"{i:04d}.txt").write_text(caption + "\n", encoding="utf-8")


def write_caption_folder(folder: Path, examples: list[tuple[Image.Image, str]]) -> None:
    """Kohya layout: `NNNN.png` with its caption in `NNNN.txt`."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, (image, caption) in enumerate(examples):
        image.save(folder / f"{i:04d}.png")
        (folder / f"{i:04d}.txt").write_text(caption + "\n", encoding="utf-8")


def recolor_pairs(
    count: int, seed: int, colors=tuple(COLORS), source_colors=tuple(COLORS), shapes=SHAPES
) -> list[tuple[Image.Image, Image.Image, str]]:
    """`count` edit pairs (control, target, instruction): a shape in a color of `source_colors`, and the same shape at
    the same place on the same background in the asked color of `colors` ("make it red"), never the color it had.
    Deterministic by seed; the asked colors and shapes cycle."""
    rng = np.random.default_rng(seed)
    pairs = []
    for i in range(count):
        color, shape = colors[i % len(colors)], shapes[(i // len(colors)) % len(shapes)]
        source = str(rng.choice([c for c in source_colors if c != color]))
        pairs.append((*shape_in_two_colors(shape, source, color, rng), f"make it {color}"))
    return pairs


def shape_in_two_colors(
    shape: str, first: str, second: str, rng: np.random.Generator
) -> tuple[Image.Image, Image.Image]:
    """`shape` rendered in `first` and in `second` color at one place (drawn from `rng`) on one background."""
    place = int(rng.integers(2**31))  # the same draws place both images' shapes
    return tuple(render_shape(shape, color, np.random.default_rng(place)) for color in (first, second))


def preference_pairs(
    count: int, seed: int, chosen_colors, rejected_color: str, shapes=SHAPES
) -> list[tuple[Image.Image, Image.Image, str]]:
    """`count` preference pairs in `write_pair_folder`'s order (rejected, chosen, caption): a shape in a color of
    `chosen_colors` captioned `a <color> <shape>`, and the same shape at the same place in `rejected_color`.
    Deterministic by seed; the colors and shapes cycle as `recolor_pairs`'."""
    rng = np.random.default_rng(seed)
    pairs = []
    for i in range(count):
        color, shape = chosen_colors[i % len(chosen_colors)], shapes[(i // len(chosen_colors)) % len(shapes)]
        pairs.append((*shape_in_two_colors(shape, rejected_color, color, rng), f"a {color} {shape}"))
    return pairs


def placed_shape_pairs(
    count: int, seed: int, colors=tuple(COLORS), shapes=SHAPES
) -> list[tuple[Image.Image, Image.Image, str]]:
    """`count` ControlNet pairs in `write_pair_folder`'s order (control, target, caption): a shape's silhouette, white
    on black, and the shape drawn at that place and size in a color, captioned `a <color> <shape>`. Deterministic by
    seed; the colors and shapes cycle as `shape_images`'."""
    rng = np.random.default_rng(seed)
    pairs = [(color, shape) for color in colors for shape in shapes]
    out = []
    for i in range(count):
        color, shape = pairs[i % len(pairs)]
        place = int(rng.integers(2**31))  # the same draws place the silhouette and the shape
        control, target = (
            render_shape(shape, color, np.random.default_rng(place), silhouette=silhouette)
            for silhouette in (True, False)
        )
        out.append((control, target, f"a {color} {shape}"))
    return out


def inpaint_cases(
    count: int, seed: int, colors=tuple(COLORS), source_colors=tuple(COLORS), shapes=SHAPES
) -> list[tuple[Image.Image, Image.Image, str]]:
    """`count` inpainting cases (image, mask, prompt): a shape in a color of `source_colors` and another shape, the
    mask (white) its bounding box and 2 pixels around, and the prompt `a <color> <shape>` of `colors` and `shapes`
    (never the image's color nor its shape): what is drawn in the box replaces it, the background around it stays.
    Deterministic by seed; the asked colors and shapes cycle as `recolor_pairs`'."""
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(count):
        color, shape = colors[i % len(colors)], shapes[(i // len(colors)) % len(shapes)]
        source_color = str(rng.choice([c for c in source_colors if c != color]))
        source_shape = str(rng.choice([s for s in SHAPES if s != shape]))
        image = render_shape(source_shape, source_color, rng)
        pixels = np.asarray(image, dtype=np.int16)
        border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]])
        rows, columns = np.nonzero(np.abs(pixels - np.median(border, axis=0)).sum(axis=-1) > 0)
        mask = Image.new("L", image.size, 0)
        ImageDraw.Draw(mask).rectangle((columns.min() - 2, rows.min() - 2, columns.max() + 2, rows.max() + 2), fill=255)
        cases.append((image, mask, f"a {color} {shape}"))
    return cases


def write_pair_folder(folder: Path, pairs: list[tuple[Image.Image, Image.Image, str]]) -> None:
    """The edit layout: target `NNNN.png` with its instruction in `NNNN.txt`, its control in `control/NNNN.png`."""
    write_caption_folder(folder, [(target, instruction) for _, target, instruction in pairs])
    (folder / "control").mkdir(exist_ok=True)
    for i, (control, _, _) in enumerate(pairs):
        control.save(folder / "control" / f"{i:04d}.png")


def layered_shapes(count: int, seed: int, colors=tuple(COLORS), shapes=SHAPES) -> list[tuple[list[Image.Image], str]]:
    """`count` layered images (Qwen-Image-Layered's samples) with their captions: each the image (RGBA, opaque) and
    its two layers, a plain light background (opaque) and the shape alone on a transparent one; the image is the
    shape layer over the background. Deterministic by seed; the colors and shapes cycle as `shape_images`'."""
    rng = np.random.default_rng(seed)
    pairs = [(color, shape) for color in colors for shape in shapes]
    out = []
    for i in range(count):
        color, shape = pairs[i % len(pairs)]
        background = Image.new("RGBA", (IMAGE_SIZE, IMAGE_SIZE), (*map(int, rng.integers(200, 256, size=3)), 255))
        layer = Image.new("RGBA", (IMAGE_SIZE, IMAGE_SIZE), (0, 0, 0, 0))
        extent = rng.uniform(0.45, 0.75) * IMAGE_SIZE
        cx, cy = rng.uniform(extent / 2, IMAGE_SIZE - extent / 2, size=2)
        _draw_shape(ImageDraw.Draw(layer), shape, (*COLORS[color], 255), cx, cy, extent)
        out.append(([Image.alpha_composite(background, layer), background, layer], f"a {color} {shape}"))
    return out


def write_layered_folder(folder: Path, samples: list[tuple[list[Image.Image], str]]) -> None:
    """musubi-tuner's layered layout: the image `NNNN.png` with its caption in `NNNN.txt` and its layers beside it,
    `NNNN_1.png`, `NNNN_2.png`..."""
    write_caption_folder(folder, [(images[0], caption) for images, caption in samples])
    for i, (images, _) in enumerate(samples):
        for number, layer in enumerate(images[1:], 1):
            layer.save(folder / f"{i:04d}_{number}.png")
