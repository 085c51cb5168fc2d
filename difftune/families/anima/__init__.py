"""Anima (`AnimaModularPipeline`, a diffusers modular pipeline: modular.py): Cosmos-Predict2's text-to-image DiT
(`CosmosTransformer3DModel`) over Qwen-Image's autoencoder, conditioned on a Qwen3 language model through Anima's
text conditioner (`AnimaTextConditioner`, the "LLM adapter": T5 token embeddings cross-attending to the language
model's states). Trained by flow matching (flow.py).

- Text, exactly as `AnimaTextEncoderStep` and `AnimaTextConditioningStep` encode a prompt: the caption as it is (no
  template), read by the Qwen3 model at the batch's longest caption (its last hidden state, zero at padding), and the
  caption's T5 token ids, which the conditioner embeds and runs against those states; its output is zero past the T5
  tokens and padded to its `min_sequence_length` (512), and the transformer reads all 512 positions, without a mask.
- The conditioner is the adapted "text encoder" (`text_conditioner`): `adapter.text_encoder` puts an adapter on it, as
  `AnimaLoraLoaderMixin` loads one (transformer and text conditioner adapters); the Qwen3 model stays frozen. With
  it frozen the text cache stores the conditioner's output, else the Qwen3 states are recomputed each step.
- Latents (B, 16, h, w) from the autoencoder's one-frame clips, normalised per channel (autoencoders.py); the
  transformer takes them as one-frame clips, with Cosmos' padding mask (zero: no padding) as a 17th channel, and the
  time as sigma.
- Files: diffusers' layout (`transformer.`, `text_conditioner.`). The kohya / ComfyUI layout names the original
  model's modules as ComfyUI maps them (`lora_unet_blocks_0_self_attn_q_proj`, the conditioner's under
  `lora_unet_llm_adapter_`); ai-toolkit's and diffusion-pipe's `diffusion_model.` files are read through diffusers'
  own reader of them. A single file is the original model's (`net.` keys, as Anima ships it and ComfyUI loads it from
  `diffusion_models/`): the transformer under Cosmos' names, which diffusers' Cosmos reader converts, and the text
  conditioner inside it (`llm_adapter.`); the Qwen3 model and the autoencoder come from `model.single_file_config`.
"""

from __future__ import annotations

import importlib.util
import re
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from diffusers import AnimaModularPipeline, CosmosTransformer3DModel
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_anima_lora_to_diffusers
from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers

from difftune.config import ModelConfig
from difftune.families.common.conditioning import Conditioning, padded_token_ids
from difftune.families.common.flow import FlowDrawing, FlowMatchingFamily
from difftune.families.common.layouts import RenamedLayout, has_file_key
from difftune.families.common.loading import FamilyOptions
from difftune.families.common.modular import ModularDrawing, ModularLoading
from difftune.families.common.targets import AdapterTargets, targets_in_blocks
from difftune.models.components import Components
from difftune.models.denoiser_files import is_gguf, read_denoiser_file, read_gguf_file
from difftune.models.dtypes import FP32_PARTS, PartDtypes

TEXT_TOKENS = 512  # the text step's default `max_sequence_length`, for both tokenizers
CONDITIONED_TOKENS = 512  # the conditioner's `min_sequence_length`: what its output is padded to
TRANSFORMER_TARGETS = [
    f"{attention}.{layer}" for attention in ("attn1", "attn2") for layer in ("to_q", "to_k", "to_v", "to_out.0")
] + ["ff.net.0.proj", "ff.net.2"]
CONDITIONER_TARGETS = [
    f"{attention}.{layer}"
    for attention in ("self_attn", "cross_attn")
    for layer in ("q_proj", "k_proj", "v_proj", "o_proj")
] + ["mlp.0", "mlp.2"]
# The original (Cosmos-Predict2) model's names of a block's layers, and of the layers outside the blocks (diffusers'
# `_convert_non_diffusers_anima_lora_to_diffusers` maps them the other way).
ORIGINAL_IN_BLOCK = {
    **{
        f"{attention}.{layer}": f"{original}.{original_layer}"
        for attention, original in (("attn1", "self_attn"), ("attn2", "cross_attn"))
        for layer, original_layer in (
            ("to_q", "q_proj"),
            ("to_k", "k_proj"),
            ("to_v", "v_proj"),
            ("to_out.0", "output_proj"),
        )
    },
    "ff.net.0.proj": "mlp.layer1",
    "ff.net.2": "mlp.layer2",
    **{
        f"{norm}.linear_{i}": f"adaln_modulation_{stage}.{i}"
        for norm, stage in (("norm1", "self_attn"), ("norm2", "cross_attn"), ("norm3", "mlp"))
        for i in (1, 2)
    },
}
ORIGINAL_GLOBALS = {
    "patch_embed.proj": "x_embedder.proj.1",
    "time_embed.t_embedder.linear_1": "t_embedder.1.linear_1",
    "time_embed.t_embedder.linear_2": "t_embedder.1.linear_2",
    "norm_out.linear_1": "final_layer.adaln_modulation.1",
    "norm_out.linear_2": "final_layer.adaln_modulation.2",
    "proj_out": "final_layer.linear",
}
# The norms' weights, which adapters never reach but single files hold.
ORIGINAL_NORMS = {
    f"{attention}.norm_{x}": f"{original}.{x}_norm"
    for attention, original in (("attn1", "self_attn"), ("attn2", "cross_attn"))
    for x in ("q", "k")
}
ORIGINAL_GLOBAL_NORMS = {"time_embed.norm": "t_embedding_norm"}
BLOCK = re.compile(r"^transformer_blocks\.(\d+)\.(.+)$")
ORIGINAL_PREFIX = "net."  # the original checkpoints' (diffusers' Cosmos reader detects them by it)
CONDITIONER_PREFIX = "llm_adapter."  # the text conditioner's weights, inside the original model's file
# ai-toolkit's and diffusion-pipe's files: the original model's names after `diffusion_model.` (Wan's, also under
# `diffusion_model.blocks.`, name their layers `self_attn.q`, `ffn.0`).
ORIGINAL_ADAPTER_KEY = re.compile(
    r"^diffusion_model\.(llm_adapter\.|blocks\.\d+\.((self|cross)_attn\.(q|k|v|output)_proj|mlp\.layer[12]|adaln_))"
)


def without_torchvision() -> None:
    """diffusers' Cosmos transformer resizes its padding mask with torchvision's nearest resize, its one use of
    torchvision, and fails without it; where torchvision is not installed (CPU machines: PyPI's build does not load
    beside the CPU torch) torch's own nearest interpolation, which torchvision's resize of a tensor runs, stands in."""
    from diffusers.models.transformers import transformer_cosmos

    if importlib.util.find_spec("torchvision") is None and not hasattr(transformer_cosmos, "transforms"):
        transformer_cosmos.transforms = SimpleNamespace(
            InterpolationMode=SimpleNamespace(NEAREST="nearest"),
            functional=SimpleNamespace(
                resize=lambda image, size, interpolation: F.interpolate(image, size=size, mode=interpolation)
            ),
        )


without_torchvision()


def original_name(module: str) -> str | None:
    """A transformer module's name in the original model (None: no adaptable counterpart there)."""
    if match := BLOCK.match(module):
        index, member = match.groups()
        return f"blocks.{index}.{ORIGINAL_IN_BLOCK[member]}" if member in ORIGINAL_IN_BLOCK else None
    return ORIGINAL_GLOBALS.get(module)


def original_weight_name(key: str) -> str:
    """A transformer weight's name in the original model's files (without `ORIGINAL_PREFIX`)."""
    module, parameter = key.rsplit(".", 1)
    if match := BLOCK.match(module):
        index, member = match.groups()
        return f"blocks.{index}.{(ORIGINAL_IN_BLOCK | ORIGINAL_NORMS)[member]}.{parameter}"
    return f"{(ORIGINAL_GLOBALS | ORIGINAL_GLOBAL_NORMS)[module]}.{parameter}"


def conditioner_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An original file's text conditioner weights under its own names (the transformer's left)."""
    unprefixed = {key.removeprefix(ORIGINAL_PREFIX): value for key, value in weights.items()}
    return {
        key.removeprefix(CONDITIONER_PREFIX): value
        for key, value in unprefixed.items()
        if key.startswith(CONDITIONER_PREFIX)
    }


def conditioner_of_file(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The text conditioner's weights in an original-layout file, in `dtype`, through the readers of denoiser files
    (a `.safetensors` file's fp8 weights times their ComfyUI scales; a GGUF file's dequantized)."""
    if is_gguf(path):
        from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

        return {
            key: (dequantize_gguf_tensor(value) if isinstance(value, GGUFParameter) else value).to(dtype)
            for key, value in read_gguf_file(path, conditioner_names).items()
        }
    file = read_denoiser_file(path, conditioner_names)
    return {key: file.weight(key, dtype) for key in file.tensors}


def padded_ids(tokenizer, captions: list[str]) -> torch.Tensor:
    """Each caption's ids, cut at `TEXT_TOKENS`, padded with -1 (no token's id) on the tokenizer's padding side."""
    token_lists = tokenizer(captions, truncation=True, max_length=TEXT_TOKENS)["input_ids"]
    return padded_token_ids(token_lists, TEXT_TOKENS, left=tokenizer.padding_side == "left")


def longest(ids: torch.Tensor, padding_side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`padded_ids` cut to the batch's longest caption (one position, masked, where all are empty: the text step's
    stand-in for an empty prompt), and their mask."""
    mask = ids >= 0
    length = max(int(mask.sum(dim=1).max()), 1)
    cut = slice(ids.shape[1] - length, None) if padding_side == "left" else slice(None, length)
    return ids[:, cut], mask[:, cut]


class AnimaLayout(RenamedLayout):
    """Anima's files in other tools' layouts."""

    kohya_prefixes = {"transformer": "lora_unet_", "text_conditioner": "lora_unet_llm_adapter_"}

    kohya_text_model_parts = ()

    kohya_model_version = "anima"

    kohya_layout_name = "Anima"

    single_file_layout = "transformer and text conditioner (original layout)"

    denoiser_file_key = f"{CONDITIONER_PREFIX}blocks.0.cross_attn.q_proj.weight"  # what ComfyUI detects Anima by

    def original_name(self, module: str) -> str | None:
        return original_name(module)

    def reads_single_file(self, keys: set[str]) -> bool:
        return has_file_key(keys, ORIGINAL_PREFIX + self.denoiser_file_key) or super().reads_single_file(keys)

    def diffusers_names(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """An original file's transformer weights (its conditioner's left: `conditioner_of_file` reads them) under
        diffusers' names, through diffusers' own Cosmos reader; diffusers' names as they are."""
        weights = {key.removeprefix(ORIGINAL_PREFIX): value for key, value in weights.items()}
        if self.denoiser_file_key not in weights:
            return weights
        transformer = {key: value for key, value in weights.items() if not key.startswith(CONDITIONER_PREFIX)}
        return convert_cosmos_transformer_checkpoint_to_diffusers(transformer)

    def to_single_file(self, components: Components) -> dict[str, torch.Tensor]:
        """The original model's file, as Anima ships it: the transformer and, inside it, the text conditioner."""
        transformer = {
            ORIGINAL_PREFIX + original_weight_name(key): value.contiguous()
            for key, value in components.denoiser.state_dict().items()
        }
        conditioner = components.text_encoders["text_conditioner"].state_dict()
        return transformer | {
            ORIGINAL_PREFIX + CONDITIONER_PREFIX + key: value.contiguous() for key, value in conditioner.items()
        }

    def read_original_layout(self, tensors):
        """ai-toolkit's and diffusion-pipe's Anima files (`diffusion_model.blocks.0.self_attn.q_proj.lora_A.weight`,
        `diffusion_model.llm_adapter.`), through diffusers' own reader of them."""
        if not any(ORIGINAL_ADAPTER_KEY.match(key) for key in tensors):
            return None
        return _convert_non_diffusers_anima_lora_to_diffusers(dict(tensors))


class AnimaTargets(AdapterTargets):
    lora_text_encoders = ("text_conditioner",)  # AnimaLoraLoaderMixin reads transformer and conditioner adapters
    default_targets = {"transformer": TRANSFORMER_TARGETS, "text_conditioner": CONDITIONER_TARGETS}

    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        """Each block's attention and feed-forward layers, by name (the Qwen3 model is never adapted)."""
        blocks = "transformer_blocks" if part == self.family.denoiser_name else "blocks"
        return targets_in_blocks(model, {blocks: self.default_targets[part]})


class AnimaLoading(ModularLoading):
    def pipeline_around_denoiser_file(self, config: ModelConfig, dtypes: PartDtypes = FP32_PARTS):
        """As any modular family's, and the text conditioner of the file too (the original model holds it; a file of
        the transformer alone keeps `model.single_file_config`'s)."""
        pipeline = super().pipeline_around_denoiser_file(config, dtypes)
        conditioner = pipeline.text_conditioner
        weights = conditioner_of_file(config.base, conditioner.dtype)
        if weights:
            conditioner.load_state_dict(weights)
        return pipeline

    single_file_pipeline = pipeline_around_denoiser_file


class AnimaDrawing(ModularDrawing, FlowDrawing):
    pass


class AnimaConditioning(Conditioning):
    padded_text_tokens = CONDITIONED_TOKENS

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        return {
            "text_encoder": padded_ids(tokenizers["tokenizer"], captions),
            "text_conditioner": padded_ids(tokenizers["t5_tokenizer"], captions),
        }

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The conditioner's output, (B, 512, D), zero past each caption's T5 tokens (`text_mask`)."""
        tokenizer, t5_tokenizer = components.tokenizers["tokenizer"], components.tokenizers["t5_tokenizer"]
        ids, mask = longest(token_ids["text_encoder"], tokenizer.padding_side)
        states = components.text_encoders["text_encoder"](
            input_ids=ids.masked_fill(~mask, tokenizer.pad_token_id or 0), attention_mask=mask.long()
        ).last_hidden_state
        states = states * mask[..., None].to(states)
        t5_ids, t5_mask = longest(token_ids["text_conditioner"], t5_tokenizer.padding_side)
        conditioner = components.text_encoders["text_conditioner"]
        conditioned = conditioner(
            source_hidden_states=states.to(conditioner.dtype),
            target_input_ids=t5_ids.masked_fill(~t5_mask, t5_tokenizer.pad_token_id or 0),
            target_attention_mask=t5_mask.long(),
            source_attention_mask=mask.long(),
        )
        text_mask = F.pad(t5_mask.long(), (0, conditioned.shape[1] - t5_mask.shape[1]))
        return {"encoder_hidden_states": conditioned, "text_mask": text_mask}


class Anima(FlowMatchingFamily):
    name = "anima"
    layout = AnimaLayout()
    loading = AnimaLoading()
    conditioning = AnimaConditioning()
    drawing = AnimaDrawing()
    targets = AnimaTargets()
    description = "Anima"
    pipeline_class = AnimaModularPipeline
    pipeline_classes = ("AnimaModularPipeline",)
    denoiser_class = CosmosTransformer3DModel
    denoiser_name = "transformer"
    text_encoder_names = ("text_encoder", "text_conditioner")
    tokenizer_names = ("tokenizer", "t5_tokenizer")
    block_lists = ("transformer_blocks",)
    options_model = FamilyOptions  # no guidance embedding: classifier-free guidance

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_channels  # the transformer patches the latents itself

    # Prompts and the transformer.

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """Each latent as a one-frame clip, with no padding (the mask channel zero, as the pipeline's)."""
        states = conditioning["encoder_hidden_states"]
        prediction = components.denoiser(
            hidden_states=noisy.unsqueeze(2).to(states.dtype),
            timestep=(timesteps / 1000).to(states.dtype),
            encoder_hidden_states=states,
            padding_mask=states.new_zeros(1, 1, *noisy.shape[-2:]),
            return_dict=False,
        )[0]
        return prediction.squeeze(2)

    def max_sequence_length(self, components: Components) -> int:
        return TEXT_TOKENS


FAMILY = Anima()
