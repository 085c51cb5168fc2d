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
    AnimaTextConditioner,
    AutoencoderKL,
    AutoencoderKLFlux2,
    AutoencoderKLHunyuanImage,
    AutoencoderKLHunyuanVideo,
    AutoencoderKLHunyuanVideo15,
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    AutoencoderKLQwenImage,
    AutoencoderKLQwenImage21,
    AutoencoderKLWan,
    AutoencoderTiny,
    ChromaTransformer2DModel,
    CosmosTransformer3DModel,
    DDPMScheduler,
    ErnieImageTransformer2DModel,
    FlowMatchEulerDiscreteScheduler,
    Flux2Transformer2DModel,
    Flux3Transformer2DModel,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
    HiDreamImageTransformer2DModel,
    HunyuanImageTransformer2DModel,
    HunyuanVideo15Transformer3DModel,
    Ideogram4Transformer2DModel,
    Kandinsky5Transformer3DModel,
    Krea2Transformer2DModel,
    LTX2VideoTransformer3DModel,
    Lumina2Transformer2DModel,
    QwenImage21Transformer2DModel,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    UNet2DConditionModel,
    UniPCMultistepScheduler,
    WanTransformer3DModel,
    ZImageTransformer2DModel,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from PIL import Image, ImageDraw
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    ByT5Tokenizer,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    Gemma2Config,
    Gemma2Model,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    Mistral3Model,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
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
    Siglip2ImageProcessorPil,
    Siglip2VisionConfig,
    Siglip2VisionModel,
    SiglipVisionConfig,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
    UMT5Config,
    UMT5EncoderModel,
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


def build_t5_encoder(vocab_size: int) -> T5EncoderModel:
    """A 2-layer T5 encoder (Flux's `text_encoder_2`: its last hidden state is the token conditioning)."""
    return T5EncoderModel(
        T5Config(
            vocab_size=vocab_size,
            d_model=T5_HIDDEN_SIZE,
            d_kv=16,
            d_ff=2 * T5_HIDDEN_SIZE,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
            feed_forward_proj="gated-gelu",
            is_encoder_decoder=False,
            use_cache=False,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
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


def build_sd3_transformer(
    layers: int = 2, heads: int = 2, head_dim: int = 16, pooled_size: int = 2 * TEXT_HIDDEN_SIZE // 2
) -> SD3Transformer2DModel:
    """`layers` MMDiT blocks over 2x2 patches of 16-channel latents, the first with SD3.5's second image attention
    and both with its q/k RMS norms; caption states as wide as T5's."""
    return SD3Transformer2DModel(
        sample_size=IMAGE_SIZE // 4,
        patch_size=2,
        in_channels=FLUX_LATENT_CHANNELS,
        num_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=T5_HIDDEN_SIZE,
        caption_projection_dim=heads * head_dim,
        pooled_projection_dim=pooled_size,
        out_channels=FLUX_LATENT_CHANNELS,
        pos_embed_max_size=16,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    )


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


def build_qwen_tokenizer(edit: bool = False, caption_words: bool = False) -> Qwen2Tokenizer:
    """Qwen2's layout (byte-level BPE; `<|endoftext|>` pads, `<|im_start|>` / `<|im_end|>` frame chat turns) with
    no merges but those that spell the words of Qwen-Image's prompt template: the template's system prompt is 34
    tokens, as in Qwen2.5-VL's own vocabulary (the pipeline drops that many), and captions are byte level. `edit`:
    extended for the edit pipelines (`extend_qwen_tokenizer`). `caption_words`: extended with a token for each word
    the captions use (`CAPTION_WORDS`, the held-out color's too), as a real vocabulary spells " purple" in one token:
    spelt in bytes, the held-out word ends in the same letter as a seen one ("purple", "blue"), and a small language
    model trained on the seen captions alone states that letter as the seen color."""
    from difftune.families.qwen_image import PROMPT_TEMPLATE

    bytes_vocab = {byte: i for i, byte in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = _qwen_bpe_tokenizer(bytes_vocab, [], PROMPT_TEMPLATE, QWEN_SPECIAL_TOKENS)
    if caption_words:
        tokenizer = _extended(tokenizer, "".join(f" {word}" for word in CAPTION_WORDS), QWEN_SPECIAL_TOKENS)
    return extend_qwen_tokenizer(tokenizer) if edit else tokenizer


def build_kandinsky5_tokenizer(template: str | None = None) -> Qwen2Tokenizer:
    """`build_qwen_tokenizer`'s, with merges that spell the words of a Kandinsky 5 prompt template too (`template`;
    None: the image models', whose system prompt is then 40 tokens, as in Qwen2.5-VL's own vocabulary)."""
    from difftune.families.kandinsky5 import PROMPT_TEMPLATE

    return _extended(build_qwen_tokenizer(), template or PROMPT_TEMPLATE, QWEN_SPECIAL_TOKENS)


def extend_qwen_tokenizer(tokenizer: Qwen2Tokenizer) -> Qwen2Tokenizer:
    """`tokenizer` as the edit pipelines need it: merges that spell the words of their template (64 tokens, as
    theirs) and the vision tokens that place an image in a prompt, appended: every token keeps its id, so a language
    model trained on `tokenizer` keeps its embeddings and grows new rows (text may split into the new, longer
    tokens)."""
    from difftune.families.qwen_image_edit import EDIT_PROMPT_TEMPLATE

    return _extended(tokenizer, EDIT_PROMPT_TEMPLATE, QWEN_SPECIAL_TOKENS + QWEN_VISION_TOKENS)


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


def _qwen_text_config(vocab_size: int, hidden_size: int, layers: int) -> dict:
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


def build_qwen_language_model(
    tokenizer: Qwen2Tokenizer, hidden_size: int = QWEN_HIDDEN_SIZE, layers: int = 2
) -> Qwen2_5_VLTextModel:
    """`build_qwen_text_encoder`'s language model alone (HunyuanVideo 1.5's text encoder is Qwen2.5-VL's without its
    vision tower)."""
    return Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**_qwen_text_config(len(tokenizer), hidden_size, layers)))


def build_qwen_text_encoder(
    tokenizer: Qwen2Tokenizer, hidden_size: int = QWEN_HIDDEN_SIZE, layers: int = 2
) -> Qwen2_5_VLForConditionalGeneration:
    """A `layers`-layer Qwen2.5-VL language model with Qwen2.5-VL's multimodal rotary sections scaled to its head size,
    and a 1-block vision tower (run by the edit pipelines, whose prompts show images: the image tokens are
    `tokenizer`'s)."""
    config = Qwen2_5_VLConfig(
        text_config=_qwen_text_config(len(tokenizer), hidden_size, layers),
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": hidden_size,
            "fullatt_block_indexes": [0],
        },
        **_vision_token_ids(tokenizer),
    )
    return Qwen2_5_VLForConditionalGeneration(config)


def _vision_token_ids(tokenizer: Qwen2Tokenizer) -> dict[str, int]:
    """The language model's config fields that name the tokens placing an image, for those `tokenizer` has."""
    return {
        f"{name}_token_id": tokenizer.convert_tokens_to_ids(token)
        for name, token in zip(("vision_start", "vision_end", "image"), QWEN_VISION_TOKENS, strict=True)
        if token in tokenizer.get_vocab()
    }


def edit_pipeline_of(pipeline):
    """The edit pipeline of a text-to-image one's components: FLUX.1 Kontext of FLUX.1 (the same parts), and
    Qwen-Image-Edit-Plus (2509) of Qwen-Image, whose language model learns to read images: its tokenizer extended
    (`extend_qwen_tokenizer`), new embedding rows drawn about the old ones' mean (transformers' resizing), the vision
    tokens' ids in its config, and a processor that turns controls into patches for its vision tower."""
    if isinstance(pipeline, FluxPipeline):
        return FluxKontextPipeline(**pipeline.components)
    if not isinstance(pipeline, QwenImagePipeline):
        raise ValueError(f"no edit pipeline of {type(pipeline).__name__}: FluxPipeline or QwenImagePipeline")
    tokenizer = extend_qwen_tokenizer(pipeline.tokenizer)
    text_encoder = pipeline.text_encoder
    text_encoder.resize_token_embeddings(len(tokenizer))
    for field, token_id in _vision_token_ids(tokenizer).items():
        setattr(text_encoder.config, field, token_id)
    parts = {name: getattr(pipeline, name) for name in ("vae", "transformer", "scheduler")}
    return QwenImageEditPlusPipeline(
        **parts, text_encoder=text_encoder, tokenizer=tokenizer, processor=build_qwen_processor(tokenizer)
    )


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


def build_hunyuan_video_vae() -> AutoencoderKLHunyuanVideo:
    """HunyuanVideo's causal video autoencoder (Kandinsky 5's video models'), with three blocks: 4x in space (32 px
    -> 8x8 latents, like the other tiny autoencoders) and 4x in time (its smallest: clips of 4k + 1 frames)."""
    return AutoencoderKLHunyuanVideo(
        latent_channels=FLUX_LATENT_CHANNELS,
        down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3,
        block_out_channels=(8, 16, 16),
        layers_per_block=1,
        norm_num_groups=4,
        spatial_compression_ratio=4,
        temporal_compression_ratio=4,
        mid_block_add_attention=False,
    )


def build_umt5_encoder(vocab_size: int) -> UMT5EncoderModel:
    """A 2-layer UMT5 encoder (Wan's text encoder: its last hidden state is the conditioning)."""
    return UMT5EncoderModel(
        UMT5Config(
            vocab_size=vocab_size,
            d_model=T5_HIDDEN_SIZE,
            d_kv=16,
            d_ff=2 * T5_HIDDEN_SIZE,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
            feed_forward_proj="gated-gelu",
            is_encoder_decoder=False,
            use_cache=False,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    )


def build_wan_transformer(
    layers: int = 2,
    heads: int = 2,
    head_dim: int = 16,
    in_channels: int = FLUX_LATENT_CHANNELS,
    image_dim: int | None = None,
) -> WanTransformer3DModel:
    """`layers` Wan blocks (self-attention over 1x2x2 patches of 16-channel latents, cross-attention to UMT5's states,
    an MLP) with their rotary axes split over (time, row, column) from the head's width, as Wan's. `in_channels`: an
    image-to-video one's reads the first frame's mask and latents too (16 + the temporal factor + 16); `image_dim`:
    Wan 2.1 image-to-video's also reads CLIP image states of that width (its cross-attention's image key and value
    projections, to the block's width as Wan 2.1 I2V's)."""
    return WanTransformer3DModel(
        image_dim=image_dim,
        added_kv_proj_dim=heads * head_dim if image_dim else None,
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=in_channels,
        out_channels=FLUX_LATENT_CHANNELS,
        text_dim=T5_HIDDEN_SIZE,
        freq_dim=32,
        ffn_dim=2 * heads * head_dim,
        num_layers=layers,
        rope_max_seq_len=64,
    )


def build_byt5_tokenizer() -> ByT5Tokenizer:
    """ByT5's tokenizer (bytes, no vocabulary file): HunyuanImage 2.1's glyph text reader."""
    return ByT5Tokenizer()


def build_hunyuan_video15_transformer(
    layers: int = 1,
    heads: int = 2,
    head_dim: int = 16,
    text_hidden_size: int = QWEN_HIDDEN_SIZE,
    glyph_hidden_size: int = T5_HIDDEN_SIZE,
    latent_channels: int = FLUX_LATENT_CHANNELS,
) -> HunyuanVideo15Transformer3DModel:
    """`layers` HunyuanVideo 1.5 double-stream blocks, one token a latent pixel, reading the noisy latents, a
    conditioning clip and its mask (2C + 1 channels), a one-block token refiner of the language model's states, a ByT5
    projection and an image-state projection; the rotary axes split the head (time, row, column) as its 16:56:56."""
    return HunyuanVideo15Transformer3DModel(
        in_channels=2 * latent_channels + 1,
        out_channels=latent_channels,
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        num_layers=layers,
        num_refiner_layers=1,
        text_embed_dim=text_hidden_size,
        text_embed_2_dim=glyph_hidden_size,
        image_embed_dim=16,
        rope_axes_dim=(head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8),
    )


def build_hunyuan_video15_vae(latent_channels: int = FLUX_LATENT_CHANNELS) -> AutoencoderKLHunyuanVideo15:
    """HunyuanVideo 1.5's causal video autoencoder kind with three blocks: 4x in space (its real one: 16x, 32
    channels) and 4x in time (clips of 4k + 1 frames); scaling set by its caller."""
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=latent_channels,
        block_out_channels=(16, 32, 2 * latent_channels),
        layers_per_block=1,
        spatial_compression_ratio=4,
        temporal_compression_ratio=4,
        scaling_factor=1.0,
    )
    vae.enable_slicing()  # one clip at a time (see families/hunyuan_video15.py)
    return vae


def build_hunyuan_video15_tokenizer() -> Qwen2Tokenizer:
    """`build_qwen_tokenizer`'s, with merges that spell the words of HunyuanVideo 1.5's system message, and the chat
    template its pipeline applies (Qwen2.5-VL's renders text turns as Qwen3-VL's does)."""
    from difftune.families.hunyuan_video15 import SYSTEM_MESSAGE

    tokenizer = _extended(build_qwen_tokenizer(), SYSTEM_MESSAGE, QWEN_SPECIAL_TOKENS)
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    return tokenizer


def build_hunyuan_image_vae(latent_channels: int = FLUX_LATENT_CHANNELS) -> AutoencoderKLHunyuanImage:
    """HunyuanImage 2.1's autoencoder kind at 4x (its real one: 64 channels at 32x), scaling set by its caller."""
    return AutoencoderKLHunyuanImage(
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        block_out_channels=(32, 64, 64),
        layers_per_block=1,
        spatial_compression_ratio=4,
        sample_size=IMAGE_SIZE,
        scaling_factor=1.0,
    )


def build_hunyuan_image_transformer(
    layers: tuple[int, int] = (1, 1),
    heads: int = 2,
    head_dim: int = 16,
    text_hidden_size: int = QWEN_HIDDEN_SIZE,
    glyph_hidden_size: int = T5_HIDDEN_SIZE,
) -> HunyuanImageTransformer2DModel:
    """`layers` (double-stream, single-stream) HunyuanImage blocks over 16-channel latents, one token a latent pixel,
    a one-block token refiner of the language model's states and a ByT5 projection; the rotary axes split the head
    in two (row, column) as HunyuanImage 2.1's 64:64."""
    return HunyuanImageTransformer2DModel(
        in_channels=FLUX_LATENT_CHANNELS,
        out_channels=FLUX_LATENT_CHANNELS,
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        num_layers=layers[0],
        num_single_layers=layers[1],
        num_refiner_layers=1,
        patch_size=(1, 1),
        text_embed_dim=text_hidden_size,
        text_embed_2_dim=glyph_hidden_size,
        rope_axes_dim=(head_dim // 2, head_dim // 2),
    )


def build_wan_scheduler() -> UniPCMultistepScheduler:
    """Wan 2.1 (480p)'s sampler config: UniPC on flow sigmas shifted by 3, the prediction the flow velocity."""
    return UniPCMultistepScheduler(
        num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )


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
        **_vision_token_ids(tokenizer),
    )
    return Qwen3VLForConditionalGeneration(config) if with_head else Qwen3VLModel(config)


def build_qwen_image21_processor() -> Qwen3VLProcessor:
    """Qwen-Image 2.1's processor, with merges that spell the words of its pipeline's prompt template."""
    from difftune.families.qwen_image21 import PROMPT_TEMPLATE

    return build_qwen3_vl_processor(PROMPT_TEMPLATE)


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


def build_qwen_image21_transformer(
    layers: int = 1,
    heads: int = 2,
    head_dim: int = 16,
    text_hidden_size: int = QWEN_HIDDEN_SIZE,
    latent_channels: int = FLUX_LATENT_CHANNELS,
) -> QwenImage21Transformer2DModel:
    """Qwen-Image 2.1's block-causal single-stream transformer over unpatched latents (a token a latent pixel), its
    rotary axes (frame, row, column) in its proportions (16, 56, 56 of 128)."""
    return QwenImage21Transformer2DModel(
        in_channels=latent_channels,
        out_channels=latent_channels,
        num_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        context_in_dim=text_hidden_size,
        axes_dims_rope=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8),
    )


def build_krea2_transformer(
    layers: int = 1,
    heads: int = 2,
    head_dim: int = 16,
    text_hidden_size: int = QWEN_HIDDEN_SIZE,
    text_layers: int = KREA2_TEXT_LAYERS,
) -> Krea2Transformer2DModel:
    """`layers` single-stream blocks over 2x2 patches of 16-channel latents, after a text fusion of one layer-wise and
    one refiner block over the stacked states of `text_layers` language-model layers; rotary axes split the head
    1:1.5:1.5 (time, row, column) as Krea 2's 32:48:48."""
    return Krea2Transformer2DModel(
        in_channels=4 * FLUX_LATENT_CHANNELS,
        num_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        num_key_value_heads=1,
        intermediate_size=2 * heads * head_dim,
        timestep_embed_dim=32,
        text_hidden_dim=text_hidden_size,
        num_text_layers=text_layers,
        text_num_attention_heads=2,
        text_num_key_value_heads=2,
        text_intermediate_size=2 * text_hidden_size,
        num_layerwise_text_blocks=1,
        num_refiner_text_blocks=1,
        axes_dims_rope=(head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8),
    )


def build_ideogram4_transformer(
    layers: int = 1, heads: int = 2, head_dim: int = 16, text_hidden_size: int = QWEN_HIDDEN_SIZE
) -> Ideogram4Transformer2DModel:
    """`layers` blocks over FLUX.2's patched latents, reading 13 language-model layers' states side by side; the
    rotary frequencies split (time, row, column) 4:2:2, interleaved as Ideogram 4's 24:20:20."""
    return Ideogram4Transformer2DModel(
        in_channels=4 * FLUX2_LATENT_CHANNELS,
        num_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        intermediate_size=2 * heads * head_dim,
        adaln_dim=16,
        llm_features_dim=13 * text_hidden_size,
        rope_theta=10000,
        mrope_section=(head_dim // 4, head_dim // 8, head_dim // 8),
    )


def ideogram4_token_channels(patched_latents: torch.Tensor) -> torch.Tensor:
    """FLUX.2-patched latents (B, 4C, h, w), channel c * 4 + p, with their channels in Ideogram 4's token order
    (p * C + c): the order its batch-norm statistics are kept in."""
    b, channels, h, w = patched_latents.shape
    return patched_latents.view(b, channels // 4, 4, h, w).transpose(1, 2).reshape(b, channels, h, w)


def build_krea2_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Krea 2's scheduler config: the shift follows the image's token count (the pipeline computes mu)."""
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        use_dynamic_shifting=True,
        base_image_seq_len=256,
        max_image_seq_len=6400,
        base_shift=0.5,
        max_shift=1.15,
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


def build_flux2_transformer(
    layers: tuple[int, int] = (1, 1),
    heads: int = 2,
    head_dim: int = 16,
    text_hidden_size: int = 3 * FLUX2_TEXT_HIDDEN_SIZE,
    guidance: bool = False,
) -> Flux2Transformer2DModel:
    """`layers` (double-stream, single-stream) FLUX.2 blocks over patched latents, reading the stacked states of
    three language-model layers; 4-D rotary axes (time, row, column, text position) of equal width. `guidance`: with
    a guidance embedding, as FLUX.2 [dev]."""
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=4 * FLUX2_LATENT_CHANNELS,
        num_layers=layers[0],
        num_single_layers=layers[1],
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=text_hidden_size,
        timestep_guidance_channels=32,
        axes_dims_rope=(head_dim // 4,) * 4,
        guidance_embeds=guidance,
    )


def build_flux3_transformer(
    layers: tuple[int, int] = (1, 1), heads: int = 2, head_dim: int = 16, text_hidden_size: int = 8 * 16
) -> Flux3Transformer2DModel:
    """`layers` (per-mode, joint single) FLUX.3 blocks over patched latents, reading the stacked states of eight
    language-model layers; 4-D rotary axes (time, row, column, text position) of equal width."""
    return Flux3Transformer2DModel(
        in_channels=4 * FLUX2_LATENT_CHANNELS,
        cond_in_channels=4 * FLUX2_LATENT_CHANNELS,
        num_layers=layers[0],
        num_single_layers=layers[1],
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=text_hidden_size,
        timestep_channels=32,
        axes_dims_rope=(head_dim // 4,) * 4,
    )


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


def build_kandinsky5_transformer(
    layers: tuple[int, int] = (1, 1),
    heads: int = 2,
    head_dim: int = 16,
    text_hidden_size: int = 32,
    pooled_size: int = 64,
    visual_cond: bool = False,
) -> Kandinsky5Transformer3DModel:
    """`layers` (text, visual) Kandinsky 5 blocks over 2x2 patches of 16-channel latents, reading a language model's
    states and a CLIP's pooled output; 3-D rotary axes (time, rows, columns) over each head; `visual_cond`: reading a
    conditioning clip and its mask beside the noisy one (the video models'). Its class starts every
    modulation at zero (a trained model's are not): drawn at random here, so the micro model's prediction depends on
    its time and its text."""
    model = Kandinsky5Transformer3DModel(
        in_visual_dim=FLUX_LATENT_CHANNELS,
        out_visual_dim=FLUX_LATENT_CHANNELS,
        in_text_dim=text_hidden_size,
        in_text_dim2=pooled_size,
        time_dim=16,
        model_dim=heads * head_dim,
        ff_dim=2 * heads * head_dim,
        num_text_blocks=layers[0],
        num_visual_blocks=layers[1],
        axes_dims=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8),
        visual_cond=visual_cond,
    )
    for name, parameter in model.named_parameters():
        if "modulation.out_layer" in name:
            torch.nn.init.normal_(parameter, std=0.02)
    return model


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


def build_ernie_image_transformer(
    layers: int = 1, heads: int = 2, head_dim: int = 16, text_hidden_size: int = FLUX2_TEXT_HIDDEN_SIZE
) -> ErnieImageTransformer2DModel:
    """ERNIE-Image's single-stream transformer over FLUX.2's patched latents (one token a latent pixel), its rotary
    axes (text position, row, column) in ERNIE-Image's proportions (32, 48, 48 of 128). Its class starts the shared
    modulation and the output layer at zero (a trained model's are not): drawn at random here, so the micro model's
    prediction depends on its input and its text."""
    model = ErnieImageTransformer2DModel(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_layers=layers,
        ffn_hidden_size=3 * heads * head_dim,
        in_channels=4 * FLUX2_LATENT_CHANNELS,
        out_channels=4 * FLUX2_LATENT_CHANNELS,
        text_in_dim=text_hidden_size,
        rope_axes_dim=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8),
    )
    for layer in (model.adaLN_modulation[-1], model.final_linear):
        torch.nn.init.normal_(layer.weight, std=0.02)
        torch.nn.init.normal_(layer.bias, std=0.02)
    return model


def build_siglip2(width: int) -> tuple[Siglip2VisionModel, Siglip2ImageProcessorPil]:
    """A one-layer SigLIP2 vision model (its naflex kind: images at their own aspect, as Z-Image Omni's so400m reads
    references) of `width`, with its processor: 8 px patches, at most 16 of them (a 32 px control is 4 x 4 patches)."""
    torch.manual_seed(0)
    config = Siglip2VisionConfig(
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=1,
        num_attention_heads=2,
        patch_size=8,
        num_patches=16,
        vision_use_head=False,
    )
    # The processor's PIL backend: its default one needs torchvision, which difftune does not install.
    return Siglip2VisionModel(config), Siglip2ImageProcessorPil(patch_size=8, max_num_patches=16)


def build_z_image_transformer(
    layers: int = 1,
    refiner_layers: int = 1,
    heads: int = 2,
    head_dim: int = 16,
    text_hidden_size: int = QWEN_HIDDEN_SIZE,
    siglip_width: int | None = None,
) -> ZImageTransformer2DModel:
    """`layers` single-stream blocks after `refiner_layers` image and caption refiner blocks each, over 2x2 patches of
    16-channel latents; rotary axes split the head 1:1.5:1.5 (caption position, row, column) as Z-Image's 32:48:48.
    `siglip_width`: Z-Image Omni's, reading SigLIP features of that width too."""
    return ZImageTransformer2DModel(
        siglip_feat_dim=siglip_width,
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=FLUX_LATENT_CHANNELS,
        dim=heads * head_dim,
        n_layers=layers,
        n_refiner_layers=refiner_layers,
        n_heads=heads,
        n_kv_heads=heads,
        cap_feat_dim=text_hidden_size,
        axes_dims=[head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8],
        axes_lens=[1024, 64, 64],
    )


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


def build_gemma2_text_encoder(tokenizer, hidden_size: int = QWEN_HIDDEN_SIZE, layers: int = 3) -> Gemma2Model:
    """A Gemma 2 language model (Lumina 2's text encoder, which reads the second-to-last layer's states)."""
    config = Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=hidden_size // 2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=None,
    )
    return Gemma2Model(config)


def build_gemma3_text_encoder(tokenizer, hidden_size: int = QWEN_HIDDEN_SIZE, layers: int = 2):
    """A Gemma 3 model with its (tiny) SigLIP vision tower, as LTX-2's text encoder is one
    (`Gemma3ForConditionalGeneration`); its pipeline reads every layer's states of the text alone."""
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=hidden_size // 2,
        max_position_embeddings=2048,
        sliding_window=16,
        pad_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    return Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=1))


def build_ltx2_parts(text_width: int, text_layers: int, layers: int = 1, heads: int = 2, latent_channels: int = 8):
    """LTX-2's text connectors (with learnable registers in the padding, as the real ones), its audio-video
    transformer (a video stream of `heads` x 8 and an audio stream of 2 x 2 `heads`), its audio autoencoder
    (2-channel mel spectrograms of 8 bins) and its vocoder, as diffusers' own LTX-2 tests build them small."""
    connectors = LTX2TextConnectors(
        caption_channels=text_width,
        text_proj_in_factor=text_layers + 1,  # every hidden state, the embeddings' too
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=text_width // 2,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=8,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=text_width // 2,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=8,
        connector_rope_base_seq_len=32,
        rope_double_precision=False,
        causal_temporal_positioning=False,
        rope_type="split",
    )
    transformer = LTX2VideoTransformer3DModel(
        in_channels=latent_channels,
        out_channels=latent_channels,
        num_attention_heads=heads,
        attention_head_dim=8,
        cross_attention_dim=heads * 8,
        audio_in_channels=4,
        audio_out_channels=4,
        # The rope of the attention between the streams spans the audio width and splits over the video heads (2 per
        # head at least): the audio stream widens with them (2 x 4 beside 2 video heads).
        audio_num_attention_heads=2,
        audio_attention_head_dim=2 * heads,
        audio_cross_attention_dim=4 * heads,
        num_layers=layers,
        caption_channels=text_width,
        vae_scale_factors=(4, 4, 4),
        rope_double_precision=False,
        rope_type="split",
    )
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1, 2, 4),  # 4x in time and mel bins, as the pipeline takes it: 8 bins -> 2 x 2 latent channels
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=8,
    )
    vocoder = LTX2Vocoder(
        in_channels=2 * 8,
        hidden_channels=32,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000,
    )
    return {"connectors": connectors, "transformer": transformer, "audio_vae": audio_vae, "vocoder": vocoder}


def build_ltx2_vae(latent_channels: int = 8, channels: tuple[int, int] = (8, 16)) -> AutoencoderKLLTX2Video:
    """LTX-2's causal video autoencoder at 4x in space and time (the real one: 32x and 8x, 128 channels), its two
    blocks `channels` wide."""
    return AutoencoderKLLTX2Video(
        latent_channels=latent_channels,
        block_out_channels=channels,
        decoder_block_out_channels=channels,
        layers_per_block=(1, 1, 1),
        decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, True),
        decoder_spatio_temporal_scaling=(True, True),
        decoder_inject_noise=(False, False, False),
        downsample_type=("spatiotemporal", "spatiotemporal"),
        upsample_type=("spatiotemporal", "spatiotemporal"),
        upsample_residual=(False, False),
        upsample_factor=(1, 1),
        patch_size=1,
        decoder_causal=False,
    )


def build_lumina2_transformer(
    layers: int = 1,
    refiner_layers: int = 1,
    heads: int = 2,
    head_dim: int = 16,
    text_hidden_size: int = QWEN_HIDDEN_SIZE,
) -> Lumina2Transformer2DModel:
    """`layers` joint blocks after `refiner_layers` image and caption refiner blocks each, over 2x2 patches of
    16-channel latents; rotary axes split the head 1:1.5:1.5 (caption position, row, column)."""
    return Lumina2Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=FLUX_LATENT_CHANNELS,
        hidden_size=heads * head_dim,
        num_layers=layers,
        num_refiner_layers=refiner_layers,
        num_attention_heads=heads,
        num_kv_heads=heads,
        multiple_of=16,
        axes_dim_rope=(head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8),
        axes_lens=(300, 64, 64),
        cap_feat_dim=text_hidden_size,
    )


def build_z_image_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Z-Image's scheduler config: one shift (3) at every size."""
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


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


def build_unet(block_out_channels: tuple[int, ...] = (32, 64), sdxl: bool = False) -> UNet2DConditionModel:
    """Cross-attention in every block but the lowest, as in SD's UNet. (32, 64): the test model;
    (32, 64, 64): the bundled base (1.5M parameters, the size that learned best in the prototype). With `sdxl`,
    SDXL's conditioning: cross-attention on both encoders' states, and the `text_time` embedding of the pooled
    text and the six size/crop numbers; linear projections in the transformers, as SDXL has. (The attention
    stays where tiny-sd has it: SDXL's own layout puts none at the top level, which at 8x8 latents leaves
    attention only at 4x4 and below.)"""
    depth = len(block_out_channels)
    sdxl_conditioning = {
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": TIME_EMBED_SIZE,
        "projection_class_embeddings_input_dim": 6 * TIME_EMBED_SIZE + TEXT_2_PROJECTION_SIZE,
        "use_linear_projection": True,
    }
    return UNet2DConditionModel(
        sample_size=IMAGE_SIZE // 4,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=block_out_channels,
        down_block_types=("CrossAttnDownBlock2D",) * (depth - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (depth - 1),
        cross_attention_dim=TEXT_HIDDEN_SIZE + TEXT_2_HIDDEN_SIZE if sdxl else TEXT_HIDDEN_SIZE,
        attention_head_dim=4,
        norm_num_groups=32,
        **(sdxl_conditioning if sdxl else {}),
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
