"""Z-Image (Tongyi-MAI's Z-Image and Z-Image-Turbo, `ZImagePipeline`): a single-stream DiT
(`ZImageTransformer2DModel`) over 2x2 patches of Flux.1's 16-channel autoencoder latents, conditioned on a Qwen3
language model's second-to-last hidden states. Trained by flow matching (flow.py).

- Text, exactly as `ZImagePipeline.encode_prompt`: each caption goes through the tokenizer's own chat template
  (a user turn, the generation prompt, thinking enabled), padded to `TEXT_TOKENS`; the language model's
  second-to-last hidden state is kept at the valid tokens, template included. The transformer takes each
  caption's states at their own length (it pads them itself), so they are stored zero-padded with a mask.
- The transformer reads a list of one-frame latents (C, 1, h, w) and the time as 1 - sigma, and predicts the
  negative of the velocity: `denoise` turns both round, as the pipeline and diffusers' Z-Image LoRA script do.
- Guidance: the pipeline's `guidance_scale` s means pos + s (pos - neg); difftune's `sample.guidance_scale` w
  means what it means for every family (neg + w (pos - neg)), so the pipeline is asked for s = w - 1. Turbo
  bases are sampled without guidance: w = 1 or less.
- Samples that paint into an image (a sample prompt's `mask`) are drawn by `ZImageInpaintPipeline` over the same
  parts: it blends the base's own drawing into the image, so a run's adapter paints there as it is.
- Z-Image-Turbo is a few-step distilled model; a LoRA trained on it as on the base model drifts from the
  distillation with long runs. `model.training_adapter` merges a de-distilling LoRA into the base for training
  only (ai-toolkit's `assistant_lora_path`, musubi-tuner's `--base_weights`; train.py), so that what is saved
  applies to Turbo and keeps its few-step sampling; without one, keep Turbo runs short, or train the base model.
- Files: diffusers' LoRA layout is the transformer's module names; the kohya layout is the one ComfyUI maps onto
  its model, the original names with q, k and v fused (`lora_unet_layers_0_attention_qkv`, `..._attention_out`), as
  musubi-tuner's converter to ComfyUI writes it. sd-scripts' / musubi-tuner's own files (`lora_unet_` + a diffusers
  module name with `_`) are read too. A single file is the transformer alone in the original layout (fused
  `attention.qkv`, `attention.out`...), as ComfyUI ships it; the other parts come from `model.single_file_config`.
"""

from __future__ import annotations

import re

import torch
from diffusers import ZImageInpaintPipeline, ZImagePipeline, ZImageTransformer2DModel
from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

from difftune.families.common.conditioning import Conditioning, valid_token_states
from difftune.families.common.flow import FlowDrawing, FlowMatchingFamily, anchored_guidance
from difftune.families.common.layouts import FusedLayout
from difftune.families.common.loading import Loading
from difftune.families.common.targets import AdapterTargets
from difftune.models.components import Components

TEXT_TOKENS = 512  # ZImagePipeline's default `max_sequence_length`
# Attention and the SwiGLU MLP of every block (refiners included): musubi-tuner's and ai-toolkit's Z-Image targets.
TRANSFORMER_TARGETS = [
    "attention.to_q",
    "attention.to_k",
    "attention.to_v",
    "attention.to_out.0",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
]
# diffusers name -> original name, for the weights whose names differ (besides the fused q, k, v).
ORIGINAL_NAMES = {
    "all_final_layer.2-1.": "final_layer.",
    "all_x_embedder.2-1.": "x_embedder.",
    ".attention.to_out.0.": ".attention.out.",
    ".attention.norm_q.": ".attention.q_norm.",
    ".attention.norm_k.": ".attention.k_norm.",
}


def fused_qkv(weights: dict[str, torch.Tensor], attention: str) -> dict[str, torch.Tensor]:
    """`weights` with each `{attention}.to_q` / `to_k` / `to_v` weight stacked by rows into one `{attention}.qkv`, as
    the Lumina-lineage originals (Z-Image, Lumina 2) hold them; the rest as they are."""
    out = {}
    for key, value in weights.items():
        if re.search(rf"\.{attention}\.to_[kv]\.weight$", key):
            continue
        if key.endswith(f".{attention}.to_q.weight"):
            stem = key.removesuffix("to_q.weight")
            key, value = stem + "qkv.weight", torch.cat([weights[stem + f"to_{p}.weight"] for p in "qkv"])
        out[key] = value
    return out


SIGLIP_KEY = "siglip_embedder."  # what Z-Image Omni's transformer files have and Z-Image's lack
# The refiners' blocks, then the main ones: what Z-Image and Lumina 2 both run.
BLOCK_LISTS = ("noise_refiner", "context_refiner", "layers")


def lumina_kohya_blocks(block_lists: tuple[str, ...], attention: str, feed_forward: dict[str, str]) -> dict:
    """The kohya layout ComfyUI maps for a Lumina-lineage DiT (Z-Image, Lumina 2): its original names, q, k and v
    one `attention_qkv` layer per block (what musubi-tuner's Z-Image converter to ComfyUI writes); `feed_forward`:
    the original MLP layer -> the diffusers module."""
    return {
        blocks: {
            f"{blocks}_{{i}}_attention_qkv": [f"{attention}.to_q", f"{attention}.to_k", f"{attention}.to_v"],
            f"{blocks}_{{i}}_attention_out": [f"{attention}.to_out.0"],
            **{f"{blocks}_{{i}}_feed_forward_{original}": [module] for original, module in feed_forward.items()},
        }
        for blocks in block_lists
    }


class ZImageLayout(FusedLayout):
    """ZImage's files in other tools' layouts."""

    single_file_layout = "transformer alone (original layout)"

    denoiser_file_key = "noise_refiner.0.attention_norm1.weight"  # in the original layout and diffusers' alike

    omni = False  # Z-Image Omni's transformer reads SigLIP features too (`siglip_embedder`): its files are its own

    kohya_prefixes = {"transformer": "lora_unet_"}

    kohya_text_model_parts = ()

    kohya_model_version = "z_image"

    kohya_layout_name = "Z-Image"

    kohya_blocks = lumina_kohya_blocks(BLOCK_LISTS, "attention", {f"w{n}": f"feed_forward.w{n}" for n in (1, 2, 3)})

    def reads_single_file(self, keys: set[str]) -> bool:
        return super().reads_single_file(keys) and any(SIGLIP_KEY in key for key in keys) == self.omni

    def diffusers_names(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The original layout (Tongyi's and ComfyUI's files) through diffusers' converter; diffusers' names as
        they are."""
        if any(key.endswith(".attention.qkv.weight") for key in weights):
            weights = convert_z_image_transformer_checkpoint_to_diffusers(weights)
        return weights

    def to_single_file(self, components: Components) -> dict[str, torch.Tensor]:
        """The transformer in the original layout: q, k and v fused into `attention.qkv`, and the original names;
        `norm_final`, which the original model holds but never applies (diffusers' converter drops it), is written
        at its initial value so that readers expecting every original key find it."""
        out = {}
        for key, value in fused_qkv(components.denoiser.state_dict(), "attention").items():
            for diffusers_name, original in ORIGINAL_NAMES.items():
                key = key.replace(diffusers_name, original)
            out[key] = value.contiguous()
        out["norm_final.weight"] = torch.ones(components.denoiser.config.dim)
        return out


class ZImageTargets(AdapterTargets):
    default_targets = {"transformer": TRANSFORMER_TARGETS}
    lora_text_encoders = ()  # ZImagePipeline's LoRA loader reads the transformer's adapters alone


class ZImageLoading(Loading):
    single_file_pipeline = Loading.pipeline_around_denoiser_file


class ZImageDrawing(FlowDrawing):
    inpaint_pipeline_class = ZImageInpaintPipeline  # a sample prompt's `mask`, painted with the base as it is

    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        return {"max_sequence_length": TEXT_TOKENS} | anchored_guidance(guidance_scale, negative_prompt)


class ZImageConditioning(Conditioning):
    padded_text_tokens = TEXT_TOKENS

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        tokenizer = tokenizers["tokenizer"]
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": caption}], tokenize=False, add_generation_prompt=True, enable_thinking=True
            )
            for caption in captions
        ]
        ids = tokenizer(
            texts, padding="max_length", max_length=TEXT_TOKENS, truncation=True, return_tensors="pt"
        ).input_ids
        return {"text_encoder": ids}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = token_ids["text_encoder"]
        mask = ids != components.tokenizers["tokenizer"].pad_token_id
        # Read up to the batch's longest caption: the causal model's states there do not depend on the padding after
        # them, and 512 tokens a caption is ~10x the work of a 50-token one.
        longest = int(mask.sum(dim=1).max())
        states = components.text_encoders["text_encoder"](
            input_ids=ids[:, :longest], attention_mask=mask[:, :longest], output_hidden_states=True
        ).hidden_states[-2]
        return valid_token_states(states, mask[:, :longest], 0, TEXT_TOKENS)


class ZImage(FlowMatchingFamily):
    name = "z_image"
    layout = ZImageLayout()
    loading = ZImageLoading()
    conditioning = ZImageConditioning()
    drawing = ZImageDrawing()
    targets = ZImageTargets()
    description = "Z-Image"
    pipeline_class = ZImagePipeline
    pipeline_classes = ("ZImagePipeline",)
    denoiser_class = ZImageTransformer2DModel
    denoiser_name = "transformer"
    block_lists = BLOCK_LISTS

    # Prompts and the transformer.

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_channels  # the transformer patches the latents itself

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        lengths = conditioning["text_mask"].bool().sum(dim=1).tolist()
        states = conditioning["encoder_hidden_states"]
        prediction = components.denoiser(
            list(noisy.to(states.dtype).unsqueeze(2).unbind(0)),
            ((1000 - timesteps) / 1000).to(states.dtype),
            [state[:length] for state, length in zip(states, lengths, strict=True)],
            return_dict=False,
        )[0]
        return -torch.stack(prediction).squeeze(2)

    # Sampling.

    def max_sequence_length(self, components: Components) -> int:
        return TEXT_TOKENS


FAMILY = ZImage()
