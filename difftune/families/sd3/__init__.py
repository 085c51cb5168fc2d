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
- Single files: the MMDiT alone in its original layout, written from this module's tables and read through
  diffusers' converter.
- Files: diffusers' layout (`transformer.`, `text_encoder.`, `text_encoder_2.`, which
  `StableDiffusion3Pipeline.load_lora_weights` reads); kohya's SD3 layout names the original MMDiT's modules, with
  q, k and v fused (`lora_unet_joint_blocks_0_x_block_attn_qkv`, `..._context_block_attn_qkv`,
  `..._x_block_attn2_qkv`), and `lora_te1_` / `lora_te2_` for the CLIPs, as kohya's sd3 scripts write and ComfyUI
  maps. T5 is never adapted (the pipeline's LoRA loader reads the CLIPs alone).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import SD3Transformer2DModel, StableDiffusion3ControlNetPipeline, StableDiffusion3Pipeline
from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

from difftune.families.common.conditioning import Conditioning
from difftune.families.common.control import SD3ControlNet
from difftune.families.common.flow import FlowDrawing, FlowMatchingFamily
from difftune.families.common.layouts import BLOCK, FusedLayout, swap_halves
from difftune.families.common.loading import FamilyOptions, Loading
from difftune.families.common.targets import AdapterTargets
from difftune.families.flux import T5_ATTENTION
from difftune.families.sd import CLIP_ATTENTION
from difftune.models.components import Components, tokenize

T5_TOKENS = 256  # StableDiffusion3Pipeline's default `max_sequence_length`
ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]
SECOND_ATTENTION_TARGETS = [f"attn2.{name}" for name in ATTENTION]  # SD3.5 Medium's first blocks have it
TRANSFORMER_TARGETS = [
    *(f"attn.{name}" for name in ATTENTION),
    *SECOND_ATTENTION_TARGETS,
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
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


# The original MMDiT's layers in a block -> the diffusers modules each holds (single files; the kohya layout above
# leaves the context modulation out: the last block's is (shift, scale), which an adapter's rows would follow).
ORIGINAL_BLOCK = {
    **{
        f"x_block.{attention}.{layer}": [f"{attention}.{module}" for module in modules]
        for attention in ("attn", "attn2")
        for layer, modules in {
            "qkv": ["to_q", "to_k", "to_v"],
            "proj": ["to_out.0"],
            "ln_q": ["norm_q"],
            "ln_k": ["norm_k"],
        }.items()
    },
    "x_block.mlp.fc1": ["ff.net.0.proj"],
    "x_block.mlp.fc2": ["ff.net.2"],
    "x_block.adaLN_modulation.1": ["norm1.linear"],
    "context_block.attn.qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    "context_block.attn.proj": ["attn.to_add_out"],
    "context_block.attn.ln_q": ["attn.norm_added_q"],
    "context_block.attn.ln_k": ["attn.norm_added_k"],
    "context_block.mlp.fc1": ["ff_context.net.0.proj"],
    "context_block.mlp.fc2": ["ff_context.net.2"],
    "context_block.adaLN_modulation.1": ["norm1_context.linear"],
}
ORIGINAL_GLOBALS = {
    "pos_embed.proj": "x_embedder.proj",
    "context_embedder": "context_embedder",
    "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
    "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
}


class StableDiffusion3Layout(FusedLayout):
    """StableDiffusion3's files in other tools' layouts."""

    single_file_layout = "transformer alone (original MMDiT layout)"

    denoiser_file_key = "joint_blocks.0.x_block.attn.qkv.weight"

    original_blocks = {"transformer_blocks": ("joint_blocks", ORIGINAL_BLOCK)}

    original_globals = ORIGINAL_GLOBALS

    swapped_halves = ("norm_out.linear.weight", "norm_out.linear.bias")

    kohya_prefixes = {
        "transformer": "lora_unet_",
        "text_encoder": "lora_te1_",
        "text_encoder_2": "lora_te2_",
        "text_encoder_3": "lora_te3_",
    }

    kohya_text_model_parts = ("text_encoder", "text_encoder_2")

    kohya_model_version = "sd3"

    kohya_layout_name = "SD3"

    kohya_blocks = {"transformer_blocks": KOHYA_BLOCK}

    embedding_keys = ("clip_l", "clip_g", "t5")

    def diffusers_state_dict(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return convert_sd3_transformer_checkpoint_to_diffusers(dict(weights))

    def original_state_dict(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tables' layout, with the position embedding under its own name and the last block's context
        modulation (a final-layer kind of norm there) in the original's order."""
        weights = dict(weights)
        last = max(int(match.group(2)) for key in weights if (match := BLOCK.match(key)))
        for parameter in ("weight", "bias"):
            key = f"transformer_blocks.{last}.norm1_context.linear.{parameter}"
            weights[key] = swap_halves(weights[key])
        position = weights.pop("pos_embed.pos_embed")
        return super().original_state_dict(weights) | {"pos_embed": position.contiguous()}


class StableDiffusion3Targets(AdapterTargets):
    default_targets = {
        "transformer": TRANSFORMER_TARGETS,
        "text_encoder": CLIP_ATTENTION,
        "text_encoder_2": CLIP_ATTENTION,
        "text_encoder_3": T5_ATTENTION,
    }
    lora_text_encoders = (
        "text_encoder",
        "text_encoder_2",
    )  # StableDiffusion3Pipeline's LoRA loader reads the CLIPs, not T5

    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        """The default targets, without the second image attention's where the transformer has none (SD3 Medium,
        SD3.5 Large: `dual_attention_layers` empty), which would otherwise name no module and be refused."""
        targets = super().targets_of(part, model)
        if part == self.family.denoiser_name and not model.config.get("dual_attention_layers"):
            return [target for target in targets if target not in SECOND_ATTENTION_TARGETS]
        return targets


class StableDiffusion3Loading(Loading):
    # Single files: the MMDiT alone (Stability's `sd3.5_large.safetensors`; an all-in-one file's text encoders and
    # autoencoder are left out), read through diffusers' converter; the other parts come from
    # `model.single_file_config`.
    single_file_pipeline = Loading.pipeline_around_denoiser_file


class StableDiffusion3Drawing(FlowDrawing):
    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """Classifier-free guidance above 1, in the pipeline's own `guidance_scale` (neg + w (pos - neg))."""
        return {
            "max_sequence_length": self.family.max_sequence_length(components),
            "guidance_scale": guidance_scale,
            "negative_prompt": negative_prompt or None,
        }


class StableDiffusion3Conditioning(Conditioning):
    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        t5 = tokenizers["tokenizer_3"]
        return {
            "text_encoder": tokenize(tokenizers["tokenizer"], captions),
            "text_encoder_2": tokenize(tokenizers["tokenizer_2"], captions),
            "text_encoder_3": t5(
                captions,
                padding="max_length",
                max_length=self.family.t5_tokens(t5),
                truncation=True,
                return_tensors="pt",
            ).input_ids,
        }

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        clips = [
            components.text_encoders[name](token_ids[name], output_hidden_states=True)
            for name in ("text_encoder", "text_encoder_2")
        ]
        t5 = components.text_encoders["text_encoder_3"](token_ids["text_encoder_3"])[0]
        clip_states = torch.cat([clip.hidden_states[-2] for clip in clips], dim=-1)
        clip_states = F.pad(clip_states, (0, t5.shape[-1] - clip_states.shape[-1]))
        return {
            "encoder_hidden_states": torch.cat([clip_states, t5], dim=-2),
            "pooled_prompt_embeds": torch.cat([clip[0] for clip in clips], dim=-1),
        }


class StableDiffusion3(FlowMatchingFamily):
    name = "sd3"
    layout = StableDiffusion3Layout()
    loading = StableDiffusion3Loading()
    conditioning = StableDiffusion3Conditioning()
    drawing = StableDiffusion3Drawing()
    targets = StableDiffusion3Targets()
    description = "Stable Diffusion 3 / 3.5"
    options_model = FamilyOptions  # no guidance embedding
    pipeline_class = StableDiffusion3Pipeline
    controlnet = SD3ControlNet(StableDiffusion3ControlNetPipeline)
    pipeline_classes = ("StableDiffusion3Pipeline",)
    denoiser_class = SD3Transformer2DModel
    denoiser_name = "transformer"
    text_encoder_names = ("text_encoder", "text_encoder_2", "text_encoder_3")
    tokenizer_names = ("tokenizer", "tokenizer_2", "tokenizer_3")

    # Prompts and the transformer.

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_channels  # the transformer patches the latents itself

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        states = conditioning["encoder_hidden_states"]
        noisy, timesteps = noisy.to(states.dtype), timesteps.to(states.dtype)
        text = {"encoder_hidden_states": states, "pooled_projections": conditioning["pooled_prompt_embeds"]}
        control = self.control_residuals(components, conditioning, noisy, timesteps, **text)
        return components.denoiser(hidden_states=noisy, timestep=timesteps, **text, **control, return_dict=False)[0]

    def t5_tokens(self, tokenizer) -> int:
        return min(T5_TOKENS, tokenizer.model_max_length)

    # Sampling.

    def max_sequence_length(self, components: Components) -> int:
        return self.t5_tokens(components.tokenizers["tokenizer_3"])


FAMILY = StableDiffusion3()
