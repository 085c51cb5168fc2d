"""FLUX.2 [klein] (`Flux2KleinPipeline`): FLUX.2's transformer (`Flux2Transformer2DModel`: double-stream blocks, then
single-stream blocks whose q, k, v and MLP input are one layer) over FLUX.2's autoencoder, conditioned on a Qwen3
language model. Trained by flow matching (flow.py).

- Latents: FLUX.2's autoencoder makes 32 channels at 8x; the transformer reads them patched 2x2 into 128 channels
  and batch-normalised, each latent pixel one token (autoencoders.py does the patching and normalisation, so the
  caches and the noise see (B, 128, h, w) as the pipeline's noise is drawn).
- Text, exactly as `Flux2KleinPipeline.encode_prompt`: each caption goes through the tokenizer's chat template
  (thinking disabled), padded to the pipeline's 512 tokens (or the tokenizer's `model_max_length` where shorter,
  which difftune's samples then pass as `max_sequence_length`: the tiny base reads 32); the hidden states of layers
  `TEXT_LAYERS` are stacked along the width. The transformer reads every position, padding included (no mask), so
  the states are kept whole.
- Position ids are 4-D (time, row, column, text position), from the pipeline's own helpers.
- Guidance: klein's pipeline uses classifier-free guidance with an empty negative prompt (it takes no other) above
  a scale of 1, none for the step-distilled bases (`is_distilled`); a base with a guidance embedding is conditioned
  on `model.family_options.guidance` in training, as diffusers' FLUX.2 scripts do.
- Noise levels: `loss.flow_shift_by_resolution` draws them with the shift the pipeline samples this size with at
  its default 50 steps (FLUX.2's empirical mu depends on the step count as well as the size).
- Files: diffusers' layout (`transformer.`, which `Flux2KleinPipeline.load_lora_weights` reads: transformer
  adapters alone); the kohya / ComfyUI layout names the original (BFL) modules, q, k and v fused
  (`lora_unet_double_blocks_0_img_attn_qkv`, `lora_unet_single_blocks_0_linear1`), as ComfyUI and diffusers'
  FLUX.2 reader map them.
"""

from __future__ import annotations

import math

import torch
from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

from difftune.config import Config
from difftune.errors import DifftuneError
from difftune.families.flow import FlowMatchingFamily
from difftune.families.fused import FusedKohyaLayout
from difftune.models import Components

TEXT_TOKENS = 512  # the pipeline's default `max_sequence_length`: the most `text_tokens` reads
TEXT_LAYERS = (9, 18, 27)  # the pipeline's default `text_encoder_out_layers`
DEFAULT_STEPS = 50  # the pipeline's default `num_inference_steps`: the step count `resolution_shift` assumes
DOUBLE_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                  "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
                  "ff_context.linear_out"]
# A single block's output layer is `attn.to_out`, which a double block's `attn.to_out` list would match too: it is
# named per block (`targets_of`), as diffusers' FLUX.2 scripts name it.
SINGLE_TARGETS = ["attn.to_qkv_mlp_proj"]
KOHYA_DOUBLE_BLOCK = {
    "double_blocks_{i}_img_attn_qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
    "double_blocks_{i}_img_attn_proj": ["attn.to_out.0"],
    "double_blocks_{i}_img_mlp_0": ["ff.linear_in"],
    "double_blocks_{i}_img_mlp_2": ["ff.linear_out"],
    "double_blocks_{i}_txt_attn_qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    "double_blocks_{i}_txt_attn_proj": ["attn.to_add_out"],
    "double_blocks_{i}_txt_mlp_0": ["ff_context.linear_in"],
    "double_blocks_{i}_txt_mlp_2": ["ff_context.linear_out"],
}
KOHYA_SINGLE_BLOCK = {"single_blocks_{i}_linear1": ["attn.to_qkv_mlp_proj"], "single_blocks_{i}_linear2": ["attn.to_out"]}


def text_tokens(tokenizer) -> int:
    """The caption length read: the pipeline's default, unless the tokenizer says less."""
    return min(TEXT_TOKENS, tokenizer.model_max_length)


class Flux2Klein(FusedKohyaLayout, FlowMatchingFamily):
    name = "flux2_klein"
    description = "FLUX.2 [klein]"
    pipeline_class = Flux2KleinPipeline
    pipeline_classes = ("Flux2KleinPipeline",)
    denoiser_class = Flux2Transformer2DModel
    denoiser_name = "transformer"
    pipeline_options = ("is_distilled",)
    patch_size = 1  # a token is one (patched) latent pixel
    kohya_prefixes = {"transformer": "lora_unet_"}
    kohya_text_model_parts = ()
    kohya_model_version = "flux2_klein"
    kohya_layout_name = "FLUX.2"
    kohya_blocks = {"transformer_blocks": KOHYA_DOUBLE_BLOCK, "single_transformer_blocks": KOHYA_SINGLE_BLOCK}
    default_targets = {"transformer": DOUBLE_TARGETS + SINGLE_TARGETS}

    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        single_outputs = [f"single_transformer_blocks.{i}.attn.to_out" for i in range(model.config.num_single_layers)]
        return self.default_targets[part] + single_outputs

    def adapted_text_encoders(self) -> tuple[str, ...]:
        return ()  # Flux2KleinPipeline's LoRA loader reads the transformer's adapters alone

    def fine_tuned_text_encoders(self) -> tuple[str, ...]:
        return self.text_encoder_names

    def unsupported_settings(self, config: Config) -> list[str]:
        problems = super().unsupported_settings(config)
        if config.sample.negative_prompt:
            problems.append("sample.negative_prompt: Flux2KleinPipeline guides with an empty negative prompt and takes no "
                            "other; leave it empty")
        return problems

    # Prompts and the transformer.

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        tokenizer = tokenizers["tokenizer"]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                               add_generation_prompt=True, enable_thinking=False) for caption in captions]
        ids = tokenizer(texts, padding="max_length", max_length=text_tokens(tokenizer), truncation=True,
                        return_tensors="pt").input_ids
        return {"text_encoder": ids}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = token_ids["text_encoder"]
        mask = (ids != components.tokenizers["tokenizer"].pad_token_id).long()
        hidden = components.text_encoders["text_encoder"](input_ids=ids, attention_mask=mask, output_hidden_states=True,
                                                          use_cache=False).hidden_states
        states = torch.stack([hidden[layer] for layer in TEXT_LAYERS], dim=2)  # (B, L, layers, D)
        return {"encoder_hidden_states": states.flatten(2)}

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_channels  # the autoencoder's latents are patched already: one token a latent pixel

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        states = conditioning["encoder_hidden_states"]
        b, c, h, w = noisy.shape
        image_ids = Flux2KleinPipeline._prepare_latent_ids(noisy).to(noisy.device)
        prediction = components.denoiser(
            hidden_states=noisy.reshape(b, c, h * w).permute(0, 2, 1).to(states.dtype),
            timestep=(timesteps / 1000).to(states.dtype), guidance=self.guidance(components, b, noisy.device),
            encoder_hidden_states=states, txt_ids=Flux2KleinPipeline._prepare_text_ids(states).to(noisy.device),
            img_ids=image_ids, return_dict=False,
        )[0]
        return prediction[:, : h * w].permute(0, 2, 1).reshape(b, -1, h, w)

    def resolution_shift(self, components: Components, image_tokens: int) -> float:
        return math.exp(compute_empirical_mu(image_tokens, DEFAULT_STEPS))

    # Sampling.

    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        return {"max_sequence_length": self.max_sequence_length(components), "guidance_scale": guidance_scale}

    def max_sequence_length(self, components: Components) -> int:
        return text_tokens(components.tokenizers["tokenizer"])

    # Files.

    def to_single_file(self, components: Components) -> dict[str, torch.Tensor]:
        raise DifftuneError("merge --single-file: not written for FLUX.2 yet; the merged diffusers folder loads in "
                            "diffusers, and ComfyUI reads the adapter's kohya layout")
