"""Ideogram 4 (`Ideogram4Pipeline`): a single-stream transformer (`Ideogram4Transformer2DModel`) over one packed
sequence of text and image tokens, FLUX.2's autoencoder, and a Qwen3-VL language model whose hidden states at 13
layers are its text. Trained by flow matching (flow.py).

- Asymmetric guidance: the pipeline holds two transformers. `transformer` reads the text; `unconditional_transformer`
  (a model of its own, reading no text) gives the guidance's other prediction, v = w pos + (1 - w) neg. Training
  adapts `transformer` alone, which is what `Ideogram4Pipeline.load_lora_weights` reads; the unconditional one is a
  drawing part (`Components.drawing_parts`): kept in host memory for previews, released otherwise. There is no
  negative prompt (refused), and caption dropout teaches nothing the pipeline asks for.
- Text, exactly as `Ideogram4Pipeline.encode_prompt`: each caption a user turn of the tokenizer's chat template with
  the generation prompt; the language model's layers `QWEN3_VL_ACTIVATION_LAYERS` (run through the pipeline's own
  `_get_text_encoder_hidden_states`), concatenated per token (layer fastest), at the caption's tokens alone. The
  cache keeps those; captions are read up to `TEXT_TOKENS` (the pipeline allows 2048: a long caption is 13 x the
  model's width per token, 213 KB at Ideogram 4's, so the padded batch is capped here).
- The packed sequence, as the pipeline builds it (`_prepare_ids`): [padding][text][image], text positions counted
  from 0 and the image's at its grid; padding is a segment of its own, so padding to the batch's longest caption
  instead of the pipeline's 2048 changes nothing the image tokens see.
- Latents: FLUX.2's autoencoder (autoencoders.py patches 2x2 as FLUX.2 does: channel c * 4 + p). Ideogram 4's tokens
  order a patch's values the other way (p * C + c) and its batch-norm statistics with them, so `latent_normalization`
  gives each patched channel its token channel's statistics and `denoise` reorders the channels into tokens: the
  latents are the pipeline's, channels permuted (the noise and the loss do not see the order).
- Time runs the other way (the transformer's t is the clean fraction) and it predicts image minus noise: `denoise`
  turns both round, as the pipeline does (`1 - t / 1000`, `scheduler.step(-v)`).
- Noise levels: the pipeline samples a logit-normal schedule (std 1.5) whose mean grows by half the log of the
  image's area over 512^2; with `loss.timestep_sampling = "logit_normal"`, `loss.logit_std = 1.5` and
  `loss.flow_shift_by_resolution`, training draws the same law (a logit-normal shifted by exp(mu) is one of mean mu),
  as diffusers' Ideogram 4 script draws it; the loss equals that script's (tested).
- Files: diffusers' layout (`transformer.`); the kohya layout names the original modules, q, k and v fused, as
  ai-toolkit's Ideogram 4 files and diffusers' reader of them do (`layers.0.attention.qkv`, `attention.o`,
  `feed_forward.w1`, `adaln_modulation`): `lora_unet_layers_0_attention_qkv`. ai-toolkit's own files (those names
  after `diffusion_model.`) are read through diffusers' reader of them. No single file is read or written: no
  reader of Ideogram 4's original checkpoint exists to check one against.
"""

from __future__ import annotations

import math

import torch
from diffusers import Ideogram4Pipeline, Ideogram4Transformer2DModel
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ideogram4_lora_to_diffusers

from difftune.config import Config
from difftune.families.common.conditioning import Conditioning, valid_token_states
from difftune.families.common.flow import FlowDrawing, FlowMatching, FlowMatchingFamily
from difftune.families.common.layouts import FusedLayout, kohya_blocks_of
from difftune.families.common.targets import AdapterTargets
from difftune.models.autoencoders import LatentNormalization, latent_normalization
from difftune.models.components import Components

TEXT_TOKENS = 512  # tokens of a templated caption read at most
PIXELS_PER_TOKEN = 16  # the pipeline's `vae_scale_factor * patch_size`: what its resolution rule counts pixels by
BASE_PIXELS = 512 * 512  # the area the pipeline's schedule mean is measured from
# A block's attention (q, k, v, out) and its SwiGLU MLP: what diffusers' reader of ai-toolkit's files places.
TRANSFORMER_TARGETS = [
    "attention.to_q",
    "attention.to_k",
    "attention.to_v",
    "attention.to_out.0",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
]
# The original model's layers in a block -> the diffusers modules each holds (`_convert_non_diffusers_ideogram4_lora_
# to_diffusers` splits `attention.qkv` in thirds and renames `attention.o`; the rest keep their names).
ORIGINAL_BLOCKS = {
    "layers": (
        "layers",
        {
            "attention.qkv": ["attention.to_q", "attention.to_k", "attention.to_v"],
            "attention.o": ["attention.to_out.0"],
            "feed_forward.w1": ["feed_forward.w1"],
            "feed_forward.w2": ["feed_forward.w2"],
            "feed_forward.w3": ["feed_forward.w3"],
            "adaln_modulation": ["adaln_modulation"],
        },
    )
}


def token_order(latents: torch.Tensor) -> torch.Tensor:
    """Patched latents (B, 4C, h, w), channel c * 4 + p (FLUX.2's) -> Ideogram 4's tokens (B, h * w, 4C), channel
    p * C + c, as `Ideogram4Pipeline` unpacks them before decoding."""
    b, channels, h, w = latents.shape
    return latents.view(b, channels // 4, 4, h, w).permute(0, 3, 4, 2, 1).reshape(b, h * w, channels)


def patched_order(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of `token_order`."""
    b, _, channels = tokens.shape
    return tokens.view(b, h, w, 4, channels // 4).permute(0, 4, 3, 1, 2).reshape(b, channels, h, w)


def chat_turn(tokenizer, caption: str) -> str:
    """A caption as `Ideogram4Pipeline.encode_prompt` puts it to the language model."""
    messages = [{"role": "user", "content": [{"type": "text", "text": caption}]}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def area_shift(components: Components, image_tokens: int) -> float:
    """exp(mu) of the pipeline's schedule at this size: mu = log(area / 512^2) / 2."""
    return math.exp(0.5 * math.log(image_tokens * PIXELS_PER_TOKEN**2 / BASE_PIXELS))


class Ideogram4Layout(FusedLayout):
    """Ideogram4's files in other tools' layouts."""

    kohya_prefixes = {"transformer": "lora_unet_"}

    kohya_text_model_parts = ()

    kohya_model_version = "ideogram4"

    kohya_layout_name = "Ideogram 4"

    kohya_blocks = kohya_blocks_of(ORIGINAL_BLOCKS)

    def read_original_layout(self, tensors):
        """ai-toolkit's Ideogram 4 files (`diffusion_model.layers.0.attention.qkv.lora_A.weight`, `attention.o`) and the
        reference trainer's (`conditional_transformer.`), through diffusers' own reader of them (`qkv` split in thirds
        over a shared down, `.alpha` folded into the weights)."""
        if not any(".attention.o." in key or key.startswith("conditional_transformer.") for key in tensors):
            return None
        return _convert_non_diffusers_ideogram4_lora_to_diffusers(dict(tensors))


class Ideogram4Targets(AdapterTargets):
    default_targets = {"transformer": TRANSFORMER_TARGETS}
    lora_text_encoders = ()  # Ideogram4Pipeline's LoRA loader reads the (conditional) transformer's adapters alone


class Ideogram4Drawing(FlowDrawing):
    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """The pipeline's constant `guidance_scale` is difftune's w already (w pos + (1 - w) neg); its default
        per-step schedule is set aside for it."""
        return {"max_sequence_length": TEXT_TOKENS, "guidance_scale": guidance_scale, "guidance_schedule": None}


class Ideogram4Conditioning(Conditioning):
    padded_text_tokens = TEXT_TOKENS

    def latent_normalization(self, vae) -> LatentNormalization:
        """The autoencoder's batch-norm statistics, which the pipeline indexes by token channel (p * C + c), given to
        the patched channel (c * 4 + p) that holds the same value."""
        token_stats = latent_normalization(vae)
        return LatentNormalization(
            *(
                tuple(torch.tensor(stats).view(4, -1).t().reshape(-1).tolist())
                for stats in (token_stats.scale, token_stats.shift)
            )
        )

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        tokenizer = tokenizers["tokenizer"]
        ids = tokenizer(
            [chat_turn(tokenizer, caption) for caption in captions],
            add_special_tokens=False,
            padding="max_length",
            max_length=TEXT_TOKENS,
            truncation=True,
            padding_side="right",
            return_tensors="pt",
        ).input_ids
        return {"text_encoder": ids}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = token_ids["text_encoder"]
        mask = ids != components.tokenizers["tokenizer"].pad_token_id
        longest = int(mask.sum(dim=1).max())
        ids, mask = ids[:, :longest], mask[:, :longest]
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0) * mask  # 0.. at each caption's tokens, as the pipeline's
        layers = Ideogram4Pipeline._get_text_encoder_hidden_states(
            components.text_encoders["text_encoder"], ids, mask.long(), positions
        )
        states = torch.stack(layers, dim=-1).flatten(2) * mask[..., None]  # (B, L, D * layers), layer fastest
        return valid_token_states(states, mask, 0, TEXT_TOKENS)


class Ideogram4(FlowMatchingFamily):
    name = "ideogram4"
    layout = Ideogram4Layout()
    conditioning = Ideogram4Conditioning()
    drawing = Ideogram4Drawing()
    targets = Ideogram4Targets()
    objective = FlowMatching(resolution_shift=area_shift)
    description = "Ideogram 4"
    pipeline_class = Ideogram4Pipeline
    pipeline_classes = ("Ideogram4Pipeline",)
    denoiser_class = Ideogram4Transformer2DModel
    denoiser_name = "transformer"
    drawing_part_names = ("unconditional_transformer",)
    block_lists = ("layers",)
    patch_size = 1  # a token is one (patched) latent pixel

    def unsupported_settings(self, config: Config) -> list[str]:
        problems = super().unsupported_settings(config)
        if config.sample.negative_prompt:
            problems.append(
                "sample.negative_prompt: Ideogram 4's guidance comes from its unconditional transformer, "
                "which reads no text; leave it empty"
            )
        return problems

    # Prompts and the transformer.

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_channels  # the autoencoder's latents are patched already: one token a latent pixel

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        lengths = [int(length) for length in conditioning["text_mask"].sum(dim=1)]
        longest, states = max(lengths), conditioning["encoder_hidden_states"]
        b, channels, h, w = noisy.shape
        position_ids, segment_ids, indicator = Ideogram4Pipeline._prepare_ids(lengths, h, w, longest, noisy.device)
        features = states.new_zeros(b, longest + h * w, states.shape[-1])  # text right-aligned before the image
        for i, length in enumerate(lengths):
            features[i, longest - length : longest] = states[i, :length]
        image = token_order(noisy).to(states.dtype)
        prediction = components.denoiser(
            hidden_states=torch.cat([image.new_zeros(b, longest, channels), image], dim=1),
            timestep=((1000 - timesteps) / 1000).to(states.dtype),
            encoder_hidden_states=features,
            position_ids=position_ids,
            segment_ids=segment_ids,
            indicator=indicator,
            return_dict=False,
        )[0]
        return -patched_order(prediction[:, longest:], h, w)

    # Sampling.

    def max_sequence_length(self, components: Components) -> int:
        return TEXT_TOKENS


FAMILY = Ideogram4()
