"""Qwen-Image 2.1 (`QwenImage21Pipeline`): a block-causal single-stream transformer (`QwenImage21Transformer2DModel`:
text, then the image, in one sequence; one modulation shared by every block) over the unpatched latents of its own
16x, 64-channel autoencoder of RGBA images (`AutoencoderKLQwenImage21`), conditioned on a Qwen3-VL language model
(`Qwen3VLForConditionalGeneration`). Trained by flow matching (flow.py).

- Text, exactly as `QwenImage21Pipeline.encode_prompt` reads a text-to-image prompt: each caption in the pipeline's
  chat template (an empty caption read as " ", as the pipeline reads it), the batch left-padded as its processor
  pads it, the language model's last layer's states *before* its final norm (the pipeline neutralises the norm with
  a hook, since transformers 5 returns the normalised states there; `last_layer_unnormalised` does the same), each
  caption's valid tokens kept after the system turn (the pipeline's `_drop_idx`, counted with the tokenizer). Token
  ids are padded with -1 to a fixed width so that a caption's ids (and cache key) do not depend on its batch; the
  model reads the batch cut to its longest caption, as the pipeline pads it. A caption longer than `TEXT_TOKENS`
  keeps the template's end (the pipeline reads a caption whole; the other families cut at 512 too).
- Latents (B, 64, h, w) of one-frame clips, normalised per channel (autoencoders.py; an RGB image encoded opaque,
  as the training script converts images to RGBA). The transformer reads them unpatched, a token a latent pixel in
  raster order (`_pack_latents`), after the text: `img_mask` marks the image's slots (each 2 x 2 latent tokens)
  after the text's, its prediction is the sequence's tail. Sizes are multiples of 32 px, so the latents' sides are
  even.
- Time: the transformer reads the scheduler's timestep / 1000 and predicts noise minus image. The pipeline samples
  with the scheduler's resolution shift (`calculate_shift` over the latent tokens); diffusers' script trains on the
  unshifted sigmas, `loss.flow_shift_by_resolution` on the shifted ones.
- Files: diffusers' layout (`transformer.`, which `QwenImage21Pipeline.load_lora_weights` reads: transformer adapters
  alone). The original model (ComfyUI's, and its single file) names every module as diffusers does but fuses each
  MLP's gate and up projections into one `img_mlp.gate_up` (gate rows first, diffusers'
  `convert_qwen_image21_transformer_checkpoint_to_diffusers` splits it): a `FusedLayout`, so a kohya file adapts
  `gate_up` as one layer (both projections adapted together) and a single file is the transformer alone in that
  layout.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from diffusers import QwenImage21Pipeline, QwenImage21Transformer2DModel
from transformers import Qwen3VLProcessor

from difftune.config import Config
from difftune.families.common.conditioning import Conditioning, padded_token_ids, valid_token_states
from difftune.families.common.flow import FlowDrawing, FlowMatchingFamily
from difftune.families.common.layouts import FusedLayout, kohya_blocks_of, kohya_globals_of
from difftune.families.common.loading import FamilyOptions, Loading
from difftune.families.common.targets import AdapterTargets
from difftune.models.components import Components
from difftune.models.processors import load_without_video_processor

# QwenImage21Pipeline's text-to-image prompt template (`prompt_template_t2i`; tests/test_qwen_image21.py checks it).
SYSTEM_TURN = "<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n"
PROMPT_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
PROMPT_TEMPLATE = SYSTEM_TURN + "<|im_start|>user\n{}" + PROMPT_SUFFIX
TEXT_TOKENS = 512  # states of a prompt's user turn the transformer reads at most
SIDE_MULTIPLE = 32  # the autoencoder's 16x, and an image slot holds 2 x 2 latent tokens (the pipeline's multiple)
# Every block's attention and its gated MLP (gate and up both: the original layout fuses them).
TRANSFORMER_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "img_mlp.gate_layer",
    "img_mlp.proj",
    "img_mlp.out",
]
# The original layout (ComfyUI's): diffusers' names, but each MLP's gate and up projections one layer.
ORIGINAL_BLOCK = {
    "attn.to_q": ["attn.to_q"],
    "attn.to_k": ["attn.to_k"],
    "attn.to_v": ["attn.to_v"],
    "attn.to_out.0": ["attn.to_out.0"],
    "attn.norm_q": ["attn.norm_q"],
    "attn.norm_k": ["attn.norm_k"],
    "img_mlp.gate_up": ["img_mlp.gate_layer", "img_mlp.proj"],
    "img_mlp.out": ["img_mlp.out"],
}
ORIGINAL_BLOCKS = {"transformer_blocks": ("transformer_blocks", ORIGINAL_BLOCK)}
ORIGINAL_GLOBALS = {
    name: name
    for name in (
        "img_in",
        "txt_in.text_norm",
        "txt_in.in_layer",
        "txt_in.out_layer",
        "time_text_embed.timestep_embedder.linear_1",
        "time_text_embed.timestep_embedder.linear_2",
        "modulation.1",
        "norm_out.linear",
        "proj_out",
    )
}

load_without_video_processor(Qwen3VLProcessor)


def system_tokens(tokenizer) -> int:
    """The tokens of the template's system turn, which the pipeline drops from the states (its `_drop_idx`)."""
    return len(tokenizer(SYSTEM_TURN)["input_ids"])


@contextmanager
def last_layer_unnormalised(text_encoder):
    """The language model's last hidden state read before its final norm, as the pipeline reads it: a forward hook
    that returns the norm's input (the pipeline's own remedy, which holds on any transformers version)."""
    model = text_encoder.model
    handle = getattr(model, "language_model", model).norm.register_forward_hook(lambda module, args, output: args[0])
    try:
        yield
    finally:
        handle.remove()


class QwenImage21Layout(FusedLayout):
    """Qwen-Image 2.1's files in other tools' layouts."""

    single_file_layout = "transformer alone (ComfyUI layout)"

    denoiser_file_key = "transformer_blocks.0.img_mlp.gate_up.weight"  # a key every original-layout file has

    kohya_prefixes = {"transformer": "lora_unet_"}

    kohya_text_model_parts = ()

    kohya_model_version = "qwen_image21"

    kohya_layout_name = "Qwen-Image 2.1"

    original_blocks, original_globals = ORIGINAL_BLOCKS, ORIGINAL_GLOBALS

    kohya_blocks = kohya_blocks_of(ORIGINAL_BLOCKS)

    kohya_globals = kohya_globals_of(ORIGINAL_GLOBALS, ())

    def no_fused_lycoris(self) -> str:
        return (
            f"the {self.kohya_layout_name} layout fuses each MLP's gate and up projections into one layer, and "
            "separate LoHa/LoKr factors have no fused form"
        )


class QwenImage21Targets(AdapterTargets):
    default_targets = {"transformer": TRANSFORMER_TARGETS}
    lora_text_encoders = ()  # QwenImage21Pipeline's LoRA loader reads the transformer's adapters alone


class QwenImage21Loading(Loading):
    single_file_pipeline = Loading.pipeline_around_denoiser_file


class QwenImage21Drawing(FlowDrawing):
    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """True classifier-free guidance above 1, with its negative prompt (the pipeline's `true_cfg_scale`)."""
        if guidance_scale > 1:
            return {"true_cfg_scale": guidance_scale, "negative_prompt": negative_prompt or ""}
        return {}

    def draw(self, pipeline, options, prompt, controls, height, width, **arguments) -> list:
        """As every family draws, with one negative prompt given to each prompt of a batch: the pipeline encodes
        `negative_prompt` as it is given, a batch of one beside a batch of prompts (its transformer then fails)."""
        negative = arguments.get("negative_prompt")
        if isinstance(prompt, list) and isinstance(negative, str):
            arguments["negative_prompt"] = [negative] * len(prompt)
        return super().draw(pipeline, options, prompt, controls, height, width, **arguments)


class QwenImage21Conditioning(Conditioning):
    padded_text_tokens = TEXT_TOKENS

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        """Each caption's ids in the template, left-padded with -1 (no token's id) to the system turn plus
        `TEXT_TOKENS`."""
        tokenizer = tokenizers["processor"].tokenizer
        width, suffix = system_tokens(tokenizer) + TEXT_TOKENS, len(tokenizer(PROMPT_SUFFIX)["input_ids"])
        token_lists = []
        for caption in captions:
            tokens = tokenizer(PROMPT_TEMPLATE.format(caption or " "))["input_ids"]
            if len(tokens) > width:
                tokens = tokens[: width - suffix] + tokens[-suffix:]
            token_lists.append(tokens)
        return {"text_encoder": padded_token_ids(token_lists, width, left=True)}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tokenizer = components.tokenizers["processor"].tokenizer
        ids = token_ids["text_encoder"]
        mask = ids >= 0
        longest = int(mask.sum(dim=1).max())
        ids, mask = ids[:, -longest:], mask[:, -longest:]
        ids = ids.masked_fill(~mask, tokenizer.pad_token_id)
        encoder = components.text_encoders["text_encoder"]
        with last_layer_unnormalised(encoder):
            states = encoder(
                input_ids=ids,
                attention_mask=mask.long(),
                mm_token_type_ids=torch.zeros_like(ids),  # what the processor marks text with
                output_hidden_states=True,
            ).hidden_states[-1]
        return valid_token_states(states, mask, system_tokens(tokenizer), TEXT_TOKENS)


class QwenImage21(FlowMatchingFamily):
    name = "qwen_image21"
    layout = QwenImage21Layout()
    loading = QwenImage21Loading()
    conditioning = QwenImage21Conditioning()
    drawing = QwenImage21Drawing()
    targets = QwenImage21Targets()
    description = "Qwen-Image 2.1"
    pipeline_class = QwenImage21Pipeline
    pipeline_classes = ("QwenImage21Pipeline",)
    denoiser_class = QwenImage21Transformer2DModel
    denoiser_name = "transformer"
    tokenizer_names = ("processor",)  # its tokenizer is the processor's
    block_lists = ("transformer_blocks",)
    patch_size = 1  # a token is one latent pixel
    options_model = FamilyOptions  # no guidance embedding
    pipeline_options = ("sample_sigmas",)  # the authors' sampling sigmas, kept by a reassembled pipeline

    def unsupported_settings(self, config: Config) -> list[str]:
        """Image sides the transformer cannot read: it places the image in slots of 2 x 2 latent tokens at 16x."""
        sides = {}
        for data, key in zip(config.data.each_dataset(), config.data.dataset_keys(), strict=True):
            setting = key.removesuffix(".path")
            sides[f"{setting}.resolution"] = data.resolution
            if data.buckets:  # bucket sides are the shortest side plus steps, or the longest
                sides |= {
                    f"{setting}.{name}": getattr(data, name)
                    for name in ("bucket_step", "bucket_min_side", "bucket_max_side")
                }
        if config.sample.resolution:
            sides["sample.resolution"] = config.sample.resolution
        return super().unsupported_settings(config) + [
            f"{name} = {side}: {self.description} draws and trains sides in multiples of {SIDE_MULTIPLE} px; use "
            f"{max(SIDE_MULTIPLE, side // SIDE_MULTIPLE * SIDE_MULTIPLE)}"
            for name, side in sides.items()
            if side % SIDE_MULTIPLE
        ]

    # Prompts and the transformer.

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_channels  # unpatched: one token a latent pixel

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """The text's states, then the image's slots (`img_mask`), the prediction at the image's tokens: the
        sequence's tail."""
        mask = conditioning["text_mask"].bool()
        longest = int(mask.sum(dim=1).max())
        states, mask = conditioning["encoder_hidden_states"][:, :longest], mask[:, :longest]
        b, c, h, w = noisy.shape
        slots = torch.cat([mask.new_zeros(mask.shape), mask.new_ones(b, h * w // 4)], dim=1)
        prediction = components.denoiser(
            hidden_states=noisy.flatten(2).transpose(1, 2).to(states.dtype),
            encoder_hidden_states=states,
            encoder_hidden_states_mask=None if mask.all() else mask,
            timestep=(timesteps / 1000).to(states.dtype),
            img_shapes=[[(1, h, w)]] * b,
            img_mask=slots,
            return_dict=False,
        )[0]
        return prediction[:, -h * w :].transpose(1, 2).reshape(b, c, h, w)

    # Sampling.

    def max_sequence_length(self, components: Components) -> int:
        return TEXT_TOKENS


FAMILY = QwenImage21()
