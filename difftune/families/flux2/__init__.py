"""FLUX.2 [dev] (`Flux2Pipeline`): FLUX.2's transformer (`Flux2Transformer2DModel`: double-stream blocks, then
single-stream blocks whose q, k, v and MLP input are one layer) over FLUX.2's autoencoder, conditioned on a Mistral
Small 3.1 language model (`Mistral3ForConditionalGeneration`). Trained by flow matching (flow.py). FLUX.2 [klein]
(flux2_klein.py) is this family with a Qwen3 language model and classifier-free guidance.

- Latents: FLUX.2's autoencoder makes 32 channels at 8x; the transformer reads them patched 2x2 into 128 channels
  and batch-normalised, each latent pixel one token (autoencoders.py does the patching and normalisation, so the
  caches and the noise see (B, 128, h, w) as the pipeline's noise is drawn).
- Text, exactly as `Flux2Pipeline.encode_prompt`: each caption is a chat turn after the pipeline's system message
  (`format_input`), put through the processor's (or tokenizer's) chat template, padded to the pipeline's 512 tokens
  (or the tokenizer's `model_max_length` where shorter); the hidden states of layers `text_layers` are stacked along
  the width. The transformer reads every position, padding included (no mask), so the states are kept whole.
- Position ids are 4-D (time, row, column, text position), from the pipeline's own helpers.
- References (multi-reference edits, the pipelines' `image`): an edit pair's control images, in order, each encoded
  as the pipeline encodes a reference (the posterior's mode, patched and batch-normalised as the image's latents),
  read as clean tokens after the image's, whose position ids put the k-th reference at time 10k
  (`_prepare_image_ids`); the transformer's prediction is cut to the image's tokens. The pipelines keep a reference
  at its own size up to `LARGEST_REFERENCE` pixels (cropped to the 16 px grid; larger ones are scaled down to it): a
  control trains at its target's area, its aspect kept, on that grid and at most that area
  (`ReferenceSizedConditioning`), and samples give the pipeline their controls so sized. The captions are encoded
  without the images (the pipelines show them to the language model only to rewrite a prompt, which difftune
  leaves off). Pairs and captioned images may share a run, each batch of one kind.
- Guidance: [dev] is guidance-distilled: its pipeline passes the scale to the guidance embedding, one pass, and takes
  no negative prompt; training conditions on `model.family_options.guidance` (diffusers' FLUX.2 script: 3.5).
- Noise levels: `loss.flow_shift_by_resolution` draws them with the shift the pipeline samples this size with at
  its default 50 steps (FLUX.2's empirical mu depends on the step count as well as the size).
- Files: diffusers' layout (`transformer.`, which `Flux2Pipeline.load_lora_weights` reads: transformer adapters
  alone); the kohya / ComfyUI layout names the original (BFL) modules, q, k and v fused
  (`lora_unet_double_blocks_0_img_attn_qkv`, `lora_unet_single_blocks_0_linear1`), as ComfyUI and diffusers'
  FLUX.2 reader map them.
"""

from __future__ import annotations

import math

import torch
from diffusers import Flux2Pipeline, Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2 import SYSTEM_MESSAGE, compute_empirical_mu, format_input

from difftune.config import Config
from difftune.families.common.conditioning import ReferenceSizedConditioning
from difftune.families.common.drawing import ReferenceSizedDrawing
from difftune.families.common.flow import FlowDrawing, FlowMatching, FlowMatchingFamily
from difftune.families.common.layouts import FusedLayout, kohya_blocks_of, kohya_globals_of
from difftune.families.common.loading import Loading
from difftune.families.common.targets import AdapterTargets
from difftune.models.components import Components

TEXT_TOKENS = 512  # the pipelines' default `max_sequence_length`: the most `text_tokens` reads
DEFAULT_STEPS = 50  # the pipelines' default `num_inference_steps`: the step count `resolution_shift` assumes
LARGEST_REFERENCE = 1024 * 1024  # pixels of a reference the pipelines keep as it is; they scale a larger one down
DOUBLE_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.linear_in",
    "ff.linear_out",
    "ff_context.linear_in",
    "ff_context.linear_out",
]
# A single block's output layer is `attn.to_out`, which a double block's `attn.to_out` list would match too: it is
# named per block (`targets_of`), as diffusers' FLUX.2 scripts name it.
SINGLE_TARGETS = ["attn.to_qkv_mlp_proj"]
# The original (BFL) model's layers in a block -> the diffusers modules each holds, in the order of its output rows
# (q, k and v fused); its norms keep their weight as `scale`. Single files and the kohya layout both name them.
ORIGINAL_DOUBLE_BLOCK = {
    "img_attn.qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
    "img_attn.proj": ["attn.to_out.0"],
    "img_mlp.0": ["ff.linear_in"],
    "img_mlp.2": ["ff.linear_out"],
    "txt_attn.qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    "txt_attn.proj": ["attn.to_add_out"],
    "txt_mlp.0": ["ff_context.linear_in"],
    "txt_mlp.2": ["ff_context.linear_out"],
    "img_attn.norm.query_norm": ["attn.norm_q"],
    "img_attn.norm.key_norm": ["attn.norm_k"],
    "txt_attn.norm.query_norm": ["attn.norm_added_q"],
    "txt_attn.norm.key_norm": ["attn.norm_added_k"],
}
ORIGINAL_SINGLE_BLOCK = {
    "linear1": ["attn.to_qkv_mlp_proj"],
    "linear2": ["attn.to_out"],
    "norm.query_norm": ["attn.norm_q"],
    "norm.key_norm": ["attn.norm_k"],
}
ORIGINAL_BLOCKS = {
    "transformer_blocks": ("double_blocks", ORIGINAL_DOUBLE_BLOCK),
    "single_transformer_blocks": ("single_blocks", ORIGINAL_SINGLE_BLOCK),
}
# Outside the blocks: diffusers module -> original layer. The final layer's modulation is (shift, scale) in the
# original model, (scale, shift) in diffusers'.
ORIGINAL_GLOBALS = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
}
SWAPPED_HALVES = ("norm_out.linear.weight",)


def text_tokenizer(tokenizer):
    """The tokenizer itself of a pipeline's `tokenizer`, which for FLUX.2 [dev] is a processor holding one."""
    return getattr(tokenizer, "tokenizer", tokenizer)


def text_tokens(tokenizer) -> int:
    """The caption length read: the pipeline's default, unless the tokenizer says less."""
    return min(TEXT_TOKENS, text_tokenizer(tokenizer).model_max_length)


def empirical_shift(components: Components, image_tokens: int) -> float:
    """The shift both FLUX.2 pipelines sample `image_tokens` with: their empirical mu at `DEFAULT_STEPS`."""
    return math.exp(compute_empirical_mu(image_tokens, DEFAULT_STEPS))


class Flux2Layout(FusedLayout):
    """Flux2's files in other tools' layouts."""

    single_file_layout = "transformer alone (BFL layout)"

    denoiser_file_key = "single_stream_modulation.lin.weight"  # what diffusers' reader detects FLUX.2 files by

    kohya_prefixes = {"transformer": "lora_unet_"}

    kohya_text_model_parts = ()

    kohya_model_version = "flux2_dev"

    kohya_layout_name = "FLUX.2"

    original_blocks, original_globals, swapped_halves = ORIGINAL_BLOCKS, ORIGINAL_GLOBALS, SWAPPED_HALVES

    kohya_blocks = kohya_blocks_of(ORIGINAL_BLOCKS)

    kohya_globals = kohya_globals_of(ORIGINAL_GLOBALS, SWAPPED_HALVES)


class Flux2Targets(AdapterTargets):
    default_targets = {"transformer": DOUBLE_TARGETS + SINGLE_TARGETS}
    lora_text_encoders = ()  # the FLUX.2 pipelines' LoRA loader reads the transformer's adapters alone

    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        single_outputs = [f"single_transformer_blocks.{i}.attn.to_out" for i in range(model.config.num_single_layers)]
        return self.default_targets[part] + single_outputs


class Flux2Loading(Loading):
    # Single files: the transformer alone, in BFL's layout (BFL's `flux2-dev.safetensors`, ComfyUI's
    # `diffusion_models/flux-2-*.safetensors`); the other parts come from `model.single_file_config`.
    single_file_pipeline = Loading.pipeline_around_denoiser_file


class Flux2Drawing(ReferenceSizedDrawing, FlowDrawing):
    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """Both FLUX.2 pipelines take the scale as `guidance_scale` and no negative prompt: [dev]'s guidance
        embedding reads it, [klein]'s classifier-free guidance uses it with an empty negative prompt."""
        return {"max_sequence_length": self.family.max_sequence_length(components), "guidance_scale": guidance_scale}


class Flux2Conditioning(ReferenceSizedConditioning):
    largest_reference = LARGEST_REFERENCE

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        tokenizer = tokenizers["tokenizer"]
        ids = tokenizer.apply_chat_template(
            format_input(captions, system_message=SYSTEM_MESSAGE),
            add_generation_prompt=False,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            padding="max_length",
            truncation=True,
            max_length=text_tokens(tokenizer),
        )["input_ids"]
        return {"text_encoder": ids}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = token_ids["text_encoder"]
        mask = (ids != text_tokenizer(components.tokenizers["tokenizer"]).pad_token_id).long()
        hidden = components.text_encoders["text_encoder"](
            input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False
        ).hidden_states
        states = torch.stack([hidden[layer] for layer in self.family.text_layers], dim=2)  # (B, L, layers, D)
        return {"encoder_hidden_states": states.flatten(2)}


class Flux2(FlowMatchingFamily):
    name = "flux2"
    layout = Flux2Layout()
    loading = Flux2Loading()
    conditioning = Flux2Conditioning()
    drawing = Flux2Drawing()
    targets = Flux2Targets()
    objective = FlowMatching(resolution_shift=empirical_shift)
    description = "FLUX.2 [dev]"
    pipeline_class = Flux2Pipeline
    pipeline_classes = ("Flux2Pipeline",)
    denoiser_class = Flux2Transformer2DModel
    denoiser_name = "transformer"
    patch_size = 1  # a token is one (patched) latent pixel
    text_layers = (10, 20, 30)  # the pipeline's default `text_encoder_out_layers`
    negative_prompt_refusal = "Flux2Pipeline is guidance-distilled and takes no negative prompt"
    max_controls = 6  # BFL's recommended most for [dev] (each reference adds its tokens to every block)

    def unsupported_settings(self, config: Config) -> list[str]:
        problems = super().unsupported_settings(config)
        if config.sample.negative_prompt:
            problems.append(f"sample.negative_prompt: {self.negative_prompt_refusal}; leave it empty")
        return problems

    # Prompts and the transformer.

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_channels  # the autoencoder's latents are patched already: one token a latent pixel

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """The image's tokens, then an edit pair's references (`control_latents`, read clean), as the pipelines'
        denoising loop joins them."""
        states = conditioning["encoder_hidden_states"]
        b, c, h, w = noisy.shape
        tokens = noisy.reshape(b, c, h * w).permute(0, 2, 1)
        image_ids = Flux2Pipeline._prepare_latent_ids(noisy).to(noisy.device)
        if references := conditioning.get("control_latents"):
            tokens = torch.cat([tokens, *(Flux2Pipeline._pack_latents(latents) for latents in references)], dim=1)
            reference_ids = Flux2Pipeline._prepare_image_ids([latents[:1] for latents in references])
            image_ids = torch.cat([image_ids, reference_ids.to(noisy.device).expand(b, -1, -1)], dim=1)
        prediction = components.denoiser(
            hidden_states=tokens.to(states.dtype),
            timestep=(timesteps / 1000).to(states.dtype),
            guidance=self.guidance(components, b, noisy.device),
            encoder_hidden_states=states,
            txt_ids=Flux2Pipeline._prepare_text_ids(states).to(noisy.device),
            img_ids=image_ids,
            return_dict=False,
        )[0]
        return prediction[:, : h * w].permute(0, 2, 1).reshape(b, -1, h, w)

    # Sampling.

    def max_sequence_length(self, components: Components) -> int:
        return text_tokens(components.tokenizers["tokenizer"])


FAMILY = Flux2()
