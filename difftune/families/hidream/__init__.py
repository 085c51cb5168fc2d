"""HiDream-I1 (`HiDreamImagePipeline`): a sparse (mixture-of-experts) DiT, `HiDreamImageTransformer2DModel`: double-
stream blocks, then single-stream ones, each reading its own layer of a Llama 3.1 language model beside T5's states,
with the pooled embeddings of two long-context CLIP encoders as its global condition; over FLUX.1's 16-channel
autoencoder, patched 2x2 by the transformer itself. Trained by flow matching (flow.py).

- Text, exactly as `HiDreamImagePipeline.encode_prompt`: CLIP-L and CLIP-G pooled (`text_embeds`) side by side,
  each caption padded to 128 tokens; T5's last states and every Llama layer's states (`hidden_states[1:]`, padded with
  its end-of-text token), 128 tokens each, kept whole: the transformer reads every position, padding included. The
  Llama states are kept batch first, (B, layers, L, D); the transformer takes them layer first.
- The transformer's prediction is image minus noise: `denoise` turns it round, as the pipeline (`-noise_pred`) and
  diffusers' HiDream script (`model_pred * -1`) do, so the loss is the shared flow-matching one (tested against the
  script). Its time is the noise level x 1000, as the scheduler's.
- The mixture of experts trains on its own training path (`force_inference_output` off: every chosen expert computed
  with gradients), which returns its output as patches (B, C, tokens, 4); `denoise` unpatches that as the transformer
  does in inference. diffusers' script loads the transformer with `force_inference_output=True` instead, whose
  experts run under `no_grad`: the same loss, but no gradient through the routed experts.
- Noise levels: HiDream's scheduler shifts every size by one `shift` (3.0 for HiDream-I1-Full, what the script
  forces), which `loss.flow_shift_by_resolution` reads.
- Files: diffusers' layout (`transformer.`, which `HiDreamImagePipeline.load_lora_weights` reads: transformer adapters
  alone) with the script's default targets; HiDream was published in diffusers' names, so the kohya layout is those
  after `lora_unet_`, and ai-toolkit's and ComfyUI's `diffusion_model.` files are read as a lone transformer's. A
  single file is the transformer alone under its own names (ComfyUI's `diffusion_models/hidream_i1_*.safetensors`,
  with or without `model.diffusion_model.`); the other parts come from `model.single_file_config`.
"""

from __future__ import annotations

import math

import torch
from diffusers import HiDreamImagePipeline, HiDreamImageTransformer2DModel

from difftune.families.common.conditioning import Conditioning
from difftune.families.common.flow import FlowDrawing, FlowMatchingFamily
from difftune.families.common.layouts import DiffusersNamedLayout
from difftune.families.common.loading import Loading
from difftune.families.common.targets import AdapterTargets
from difftune.models.components import Components

TEXT_TOKENS = 128  # the pipeline's default `max_sequence_length`
CLIP_TOKENS = 218  # the most the pipeline reads with its long-context CLIP encoders
TRANSFORMER_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out",
]  # diffusers' HiDream script's default: the image stream's attention


class HiDreamLayout(DiffusersNamedLayout):
    """HiDream's files in other tools' layouts."""

    denoiser_file_key = "double_stream_blocks.0.block.adaLN_modulation.1.bias"  # what diffusers' reader detects it by

    kohya_model_version = "hidream"


class HiDreamTargets(AdapterTargets):
    default_targets = {"transformer": TRANSFORMER_TARGETS}
    lora_text_encoders = ()  # HiDreamImagePipeline's LoRA loader reads the transformer's adapters alone


class HiDreamLoading(Loading):
    single_file_pipeline = Loading.pipeline_around_denoiser_file


class HiDreamDrawing(FlowDrawing):
    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """The pipeline's `guidance_scale` is classifier-free guidance (neg + w (pos - neg)) above 1."""
        return {
            "max_sequence_length": TEXT_TOKENS,
            "guidance_scale": guidance_scale,
            "negative_prompt": negative_prompt or None,
        }

    def draw(self, pipeline, options, prompt, controls, height, width, **arguments) -> list:
        """`HiDreamImagePipeline` scales whatever size it is asked for to the area of its default (1024 x 1024 for the
        published VAE): a 512 px sample came out at 1024, and the micro model's 32 px ones at 1024 too (19 minutes of
        a CPU test in bf16). Its default set to the size asked, it draws that size (in its multiples of 16)."""
        if height and width:
            # rounded up: a default area a little over the one asked scales the size up by less than its rounding
            pipeline.default_sample_size = math.ceil(math.sqrt(height * width) / pipeline.vae_scale_factor)
        return super().draw(pipeline, options, prompt, controls, height, width, **arguments)


class HiDreamConditioning(Conditioning):
    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        def ids(tokenizer, length: int) -> torch.Tensor:
            return tokenizer(
                captions, padding="max_length", max_length=length, truncation=True, return_tensors="pt"
            ).input_ids

        t5, llama = tokenizers["tokenizer_3"], tokenizers["tokenizer_4"]
        return {
            "text_encoder": ids(tokenizers["tokenizer"], min(TEXT_TOKENS, CLIP_TOKENS)),
            "text_encoder_2": ids(tokenizers["tokenizer_2"], min(TEXT_TOKENS, CLIP_TOKENS)),
            "text_encoder_3": ids(t5, min(TEXT_TOKENS, t5.model_max_length)),
            "text_encoder_4": ids(llama, min(TEXT_TOKENS, llama.model_max_length)),
        }

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        encoders, tokenizers = components.text_encoders, components.tokenizers
        pooled = [
            encoders[name](token_ids[name], output_hidden_states=True)[0] for name in ("text_encoder", "text_encoder_2")
        ]
        t5_ids, llama_ids = token_ids["text_encoder_3"], token_ids["text_encoder_4"]
        t5 = encoders["text_encoder_3"](
            t5_ids, attention_mask=(t5_ids != tokenizers["tokenizer_3"].pad_token_id).long()
        )[0]
        # The pipeline pads Llama's captions with its end-of-text token (its `pad_token`), masked out.
        llama_mask = (llama_ids != tokenizers["tokenizer_4"].eos_token_id).long()
        llama = encoders["text_encoder_4"](
            llama_ids, attention_mask=llama_mask, output_hidden_states=True
        ).hidden_states[1:]
        return {
            "pooled_prompt_embeds": torch.cat(pooled, dim=-1),
            "encoder_hidden_states_t5": t5,
            "encoder_hidden_states_llama3": torch.stack(llama, dim=1),
        }


class HiDream(FlowMatchingFamily):
    name = "hidream"
    layout = HiDreamLayout()
    loading = HiDreamLoading()
    conditioning = HiDreamConditioning()
    drawing = HiDreamDrawing()
    targets = HiDreamTargets()
    description = "HiDream-I1"
    pipeline_class = HiDreamImagePipeline
    pipeline_classes = ("HiDreamImagePipeline",)
    denoiser_class = HiDreamImageTransformer2DModel
    denoiser_name = "transformer"
    text_encoder_names = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")
    tokenizer_names = ("tokenizer", "tokenizer_2", "tokenizer_3", "tokenizer_4")
    block_lists = ("double_stream_blocks", "single_stream_blocks")

    # Prompts and the transformer.

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_channels  # the transformer patches the latents itself

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        pooled = conditioning["pooled_prompt_embeds"]
        denoiser = components.denoiser
        prediction = denoiser(
            hidden_states=noisy.to(pooled.dtype),
            timesteps=timesteps.to(pooled.dtype),
            encoder_hidden_states_t5=conditioning["encoder_hidden_states_t5"],
            encoder_hidden_states_llama3=conditioning["encoder_hidden_states_llama3"].transpose(0, 1),
            pooled_embeds=pooled,
            return_dict=False,
        )[0]
        if denoiser.training and not denoiser.config.force_inference_output:  # patches: (B, C, tokens, p * p)
            b, c, h, w = noisy.shape
            p = denoiser.config.patch_size
            patches = prediction[:, :, : (h // p) * (w // p)].reshape(b, c, h // p, w // p, p, p)
            prediction = patches.permute(0, 1, 2, 4, 3, 5).reshape(b, c, h, w)
        return -prediction

    # Sampling.

    def max_sequence_length(self, components: Components) -> int:
        return TEXT_TOKENS


FAMILY = HiDream()
