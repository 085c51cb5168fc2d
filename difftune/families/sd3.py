"""Stable Diffusion 3 and 3.5 (`StableDiffusion3Pipeline`): an MMDiT (`SD3Transformer2DModel`, with SD3.5's second
image attention `attn2` in its first blocks where the base has them) over 16-channel latents it patches itself,
conditioned on two CLIPs and T5. Trained by flow matching (flow.py).

- Text, exactly as `StableDiffusion3Pipeline.encode_prompt`: each CLIP's penultimate hidden state (77 tokens),
  concatenated along the width and zero-padded to T5's width, then T5's last hidden state (at most
  `T5_TOKENS`, the pipeline's default `max_sequence_length`) after them along the sequence; the pooled embedding
  is the two CLIPs' projections side by side.
- The transformer reads unpacked latents and the time as sigma x 1000; its scheduler shifts every size by 3
  (`loss.flow_shift_by_resolution` draws that shift).
- The loss is the velocity one (diffusers' SD3 script with `--precondition_outputs 0`; its default, 1, predicts x0
  as `noisy - sigma v`, which is this loss weighted by sigma^2: `loss.weighting` has no such weighting).
- Files: diffusers' layout (`transformer.`, `text_encoder.`, `text_encoder_2.`, which
  `StableDiffusion3Pipeline.load_lora_weights` reads); kohya's SD3 layout names the original MMDiT's modules, with
  q, k and v fused (`lora_unet_joint_blocks_0_x_block_attn_qkv`, `..._context_block_attn_qkv`,
  `..._x_block_attn2_qkv`), and `lora_te1_` / `lora_te2_` for the CLIPs, as kohya's sd3 scripts write and ComfyUI
  maps. T5 is never adapted (the pipeline's LoRA loader reads the CLIPs alone).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from diffusers import StableDiffusion3Pipeline

from difftune.errors import DifftuneError
from difftune.families.family import FamilyOptions
from difftune.families.flow import FlowMatchingFamily
from difftune.families.flux import T5_ATTENTION
from difftune.families.fused import FusedKohyaLayout
from difftune.families.sd import CLIP_ATTENTION
from difftune.models import Components, tokenize

T5_TOKENS = 256  # StableDiffusion3Pipeline's default `max_sequence_length`
ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
TRANSFORMER_TARGETS = [
    *(f"attn.{name}" for name in ATTENTION), *(f"attn2.{name}" for name in ATTENTION),
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
]
# The original MMDiT's layers, as kohya names them after `lora_unet_`, -> the diffusers modules each holds, in the
# order of its output rows. `{i}` is the block index.
KOHYA_BLOCK = {
    "joint_blocks_{i}_x_block_attn_qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
    "joint_blocks_{i}_x_block_attn_proj": ["attn.to_out.0"],
    "joint_blocks_{i}_x_block_attn2_qkv": ["attn2.to_q", "attn2.to_k", "attn2.to_v"],
    "joint_blocks_{i}_x_block_attn2_proj": ["attn2.to_out.0"],
    "joint_blocks_{i}_x_block_mlp_fc1": ["ff.net.0.proj"],
    "joint_blocks_{i}_x_block_mlp_fc2": ["ff.net.2"],
    "joint_blocks_{i}_x_block_adaLN_modulation_1": ["norm1.linear"],
    "joint_blocks_{i}_context_block_attn_qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    "joint_blocks_{i}_context_block_attn_proj": ["attn.to_add_out"],
    "joint_blocks_{i}_context_block_mlp_fc1": ["ff_context.net.0.proj"],
    "joint_blocks_{i}_context_block_mlp_fc2": ["ff_context.net.2"],
}


class StableDiffusion3(FusedKohyaLayout, FlowMatchingFamily):
    name = "sd3"
    description = "Stable Diffusion 3 / 3.5"
    options_model = FamilyOptions  # no guidance embedding
    pipeline_class = StableDiffusion3Pipeline
    pipeline_classes = ("StableDiffusion3Pipeline",)
    denoiser_name = "transformer"
    text_encoder_names = ("text_encoder", "text_encoder_2", "text_encoder_3")
    tokenizer_names = ("tokenizer", "tokenizer_2", "tokenizer_3")
    kohya_prefixes = {"transformer": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_",
                      "text_encoder_3": "lora_te3_"}
    kohya_text_model_parts = ("text_encoder", "text_encoder_2")
    kohya_model_version = "sd3"
    kohya_layout_name = "SD3"
    kohya_blocks = {"transformer_blocks": KOHYA_BLOCK}
    embedding_keys = ("clip_l", "clip_g", "t5")
    default_targets = {"transformer": TRANSFORMER_TARGETS, "text_encoder": CLIP_ATTENTION,
                       "text_encoder_2": CLIP_ATTENTION, "text_encoder_3": T5_ATTENTION}

    def adapted_text_encoders(self) -> tuple[str, ...]:
        return ("text_encoder", "text_encoder_2")  # StableDiffusion3Pipeline's LoRA loader reads the CLIPs, not T5

    # Prompts and the transformer.

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        t5 = tokenizers["tokenizer_3"]
        return {"text_encoder": tokenize(tokenizers["tokenizer"], captions),
                "text_encoder_2": tokenize(tokenizers["tokenizer_2"], captions),
                "text_encoder_3": t5(captions, padding="max_length", max_length=self.t5_tokens(t5), truncation=True,
                                     return_tensors="pt").input_ids}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        clips = [components.text_encoders[name](token_ids[name], output_hidden_states=True)
                 for name in ("text_encoder", "text_encoder_2")]
        t5 = components.text_encoders["text_encoder_3"](token_ids["text_encoder_3"])[0]
        clip_states = torch.cat([clip.hidden_states[-2] for clip in clips], dim=-1)
        clip_states = F.pad(clip_states, (0, t5.shape[-1] - clip_states.shape[-1]))
        return {"encoder_hidden_states": torch.cat([clip_states, t5], dim=-2),
                "pooled_prompt_embeds": torch.cat([clip[0] for clip in clips], dim=-1)}

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_channels  # the transformer patches the latents itself

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        states = conditioning["encoder_hidden_states"]
        return components.denoiser(
            hidden_states=noisy.to(states.dtype), timestep=timesteps.to(states.dtype), encoder_hidden_states=states,
            pooled_projections=conditioning["pooled_prompt_embeds"], return_dict=False,
        )[0]

    def t5_tokens(self, tokenizer) -> int:
        return min(T5_TOKENS, tokenizer.model_max_length)

    # Sampling.

    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """Classifier-free guidance above 1, in the pipeline's own `guidance_scale` (neg + w (pos - neg))."""
        return {"max_sequence_length": self.max_sequence_length(components), "guidance_scale": guidance_scale,
                "negative_prompt": negative_prompt or None}

    def max_sequence_length(self, components: Components) -> int:
        return self.t5_tokens(components.tokenizers["tokenizer_3"])

    # Files.

    def to_single_file(self, components: Components) -> dict[str, torch.Tensor]:
        raise DifftuneError(
            "merge --single-file: not written for SD3 yet; the merged diffusers folder loads in diffusers, and "
            "ComfyUI reads the adapter's kohya layout"
        )
