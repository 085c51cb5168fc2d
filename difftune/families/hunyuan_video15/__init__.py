"""HunyuanVideo 1.5 text-to-video (`HunyuanVideo15Pipeline`): Tencent's 8.3B MMDiT (`HunyuanVideo15Transformer3DModel`:
54 double-stream blocks over a token refiner of the caption) on the 32-channel latents of a causal video autoencoder
(`AutoencoderKLHunyuanVideo15`: 16x in space, 4x in time), each latent pixel one token, conditioned on a Qwen2.5-VL
language model and, for the text a caption quotes, on ByT5's glyph states. Trained by flow matching (flow.py) on clips
(dataset.py cuts them into windows of frames) and images, each a one-frame clip.

- Text, exactly as `HunyuanVideo15Pipeline.encode_prompt` (hunyuan_text.py, shared with HunyuanImage 2.1): the
  caption as the user's turn after the pipeline's system message, through the tokenizer's chat template, padded to
  the 108 + 1000 tokens the pipeline reads, the language model's third-to-last state with the first 108 dropped; and
  ByT5's states of the text the caption quotes ("..." or Chinese quotes: `extract_glyph_texts`), 256 bytes. The
  transformer always reads glyph states (at least one masked token where no caption of the batch quotes text).
- Latents (B, 32, t, h, w) as the pipeline decodes them: the autoencoder's times its `scaling_factor` (no shift). The
  transformer reads 65 channels: the noisy latents, the conditioning clip (zeros in text-to-video) and its mask
  (zeros), as the pipeline passes them; and SigLIP image states, zeros in text-to-video, which it masks out (one
  zero token instead of the pipeline's 729: masked, they change nothing). Time: the scheduler's timestep (0-1000),
  the prediction the flow velocity.
- The step-distilled model (meanflow: the next step's time too) is refused by name, as HunyuanImage 2.1's.
- Samples: clips of `sample.frames` frames (images: one-frame clips) at the size asked, guided by the pipeline's
  `guider`, a `ClassifierFreeGuidance` at `sample.guidance_scale` (on above 1; the model card's 6).
- Files: diffusers' layout (`transformer.`; the pipeline has no LoRA loader, so the family's pipeline is
  `HunyuanVideo15PipelineWithLora`: diffusers' generic transformer LoRA loading, saved as a
  `HunyuanVideo15Pipeline`). The kohya layout is ComfyUI's: ComfyUI runs HunyuanVideo 1.5 as its HunyuanVideo model
  (`HunyuanVideo15` subclasses `HunyuanVideo` in comfy/supported_models.py), whose double blocks are Flux.1's
  (`double_blocks.0.img_attn.qkv`, `img_mlp.0`, `img_mod.lin`), and maps `lora_unet_` + those names: Flux's fused
  table (flux.py) of the double blocks, whose diffusers modules are this transformer's too. Files difftune wrote before
  (Tencent's names one for one, `lora_unet_double_blocks_0_img_attn_q`, `img_mlp_fc1`: musubi-tuner's
  `networks.lora_hv_1_5` files, of which ComfyUI loads only the projections) are still read. A single file is the
  transformer alone as ComfyUI's files (Comfy-Org's repackaged `hunyuanvideo1.5_*.safetensors`) hold it: Tencent's
  names with each stream's q, k and v fused (`img_attn_qkv`, the layer ComfyUI's loader renames to `img_attn.qkv`),
  the token refiner's fused as `self_attn_qkv`, the output modulation's halves swapped; Tencent's own files, whose q,
  k and v are apart, are read too. The text encoders and the autoencoder come from `model.single_file_config`.
"""

from __future__ import annotations

import inspect
import re

import torch
from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline, HunyuanVideo15Transformer3DModel
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts, format_text_input

from difftune.families.common.conditioning import NO_TOKEN
from difftune.families.common.drawing import ClipDrawing
from difftune.families.common.flow import FlowDrawing, FlowMatchingFamily
from difftune.families.common.hunyuan_original import FUSED_BLOCKS, ORIGINAL_BLOCKS, ORIGINAL_IN_BLOCK, SWAPPED_HALVES
from difftune.families.common.hunyuan_original import ORIGINAL_GLOBALS as SHARED_GLOBALS
from difftune.families.common.hunyuan_text import (
    HunyuanTextConditioning,
    attributes_set,
    refuse_meanflow,
    text_arguments,
)
from difftune.families.common.layouts import FusedLayout, Layout, OriginalFileLayout
from difftune.families.common.loading import FamilyOptions, Loading, with_transformer_lora_loading
from difftune.families.common.targets import AdapterTargets, targets_in_blocks
from difftune.families.flux import DOUBLE_BLOCK_TARGETS, FluxLayout
from difftune.models.autoencoders import LatentNormalization
from difftune.models.components import Components

# The pipeline's system message, as its prompt encoder's default (diffusers keeps it nowhere else but the instance).
SYSTEM_MESSAGE = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
# The pipeline's numbers (tests/test_families.py checks them against it): the template's tokens before the caption
# that it drops (`prompt_template_encode_start_idx`), the caption's tokens it reads (`tokenizer_max_length`), ByT5's
# bytes of the quoted text (`tokenizer_2_max_length`).
TEMPLATE_TOKENS = 108
TEXT_TOKENS = 1000
GLYPH_TOKENS = 256
BLOCK = re.compile(r"^transformer_blocks\.(\d+)\.(.+)$")
# The single file's tables (`OriginalFileLayout`): the layout HunyuanImage 2.1's files share (hunyuan_original.py),
# and HunyuanVideo 1.5's own time and image embedders.
ORIGINAL_GLOBALS = SHARED_GLOBALS | {
    "time_embed.timestep_embedder.linear_1": "time_in.mlp.0",
    "time_embed.timestep_embedder.linear_2": "time_in.mlp.2",
    "time_embed.timestep_embedder_r.linear_1": "time_r_in.mlp.0",  # the step-distilled model's
    "time_embed.timestep_embedder_r.linear_2": "time_r_in.mlp.2",
    "image_embedder.norm_in": "vision_in.proj.0",
    "image_embedder.linear_1": "vision_in.proj.1",
    "image_embedder.linear_2": "vision_in.proj.3",
    "image_embedder.norm_out": "vision_in.proj.4",
    "cond_type_embed": "cond_type_embedding",
}
IMAGE_TOKENS = 1  # the masked image states passed in text-to-video (see the module's docstring)


class TencentFileLayout(OriginalFileLayout, Layout):
    """HunyuanVideo 1.5's transformer file in Tencent's layout, q, k and v apart (read; difftune writes ComfyUI's)."""

    kohya_prefixes = {}
    kohya_layout_name = "Tencent's HunyuanVideo 1.5"
    denoiser_file_key = "double_blocks.0.img_attn_q.weight"
    original_blocks = ORIGINAL_BLOCKS
    original_globals = ORIGINAL_GLOBALS
    swapped_halves = SWAPPED_HALVES


TENCENT_FILE = TencentFileLayout()


class HunyuanVideo15Layout(FusedLayout):
    """HunyuanVideo 1.5's files in other tools' layouts (see the module's docstring)."""

    kohya_prefixes = {"transformer": "lora_unet_"}
    kohya_text_model_parts = ()
    kohya_model_version = "hunyuan_video_1_5"
    kohya_layout_name = "HunyuanVideo 1.5"
    kohya_blocks = {"transformer_blocks": FluxLayout.kohya_blocks["transformer_blocks"]}
    single_file_layout = "transformer alone (ComfyUI's: q, k and v fused; Tencent's read too)"
    denoiser_file_key = "vision_in.proj.0.weight"  # its SigLIP projection: HunyuanVideo 1.5's alone, every task's
    original_blocks = FUSED_BLOCKS
    original_globals = ORIGINAL_GLOBALS
    swapped_halves = SWAPPED_HALVES

    def original_module_names(self, denoiser_modules: list[str]) -> dict[str, str]:
        """Tencent's names one for one (`double_blocks.0.img_attn_q`), as files written before name the modules."""
        names = {}
        for module in denoiser_modules:
            if (match := BLOCK.match(module)) and (member := ORIGINAL_IN_BLOCK.get(match.group(2))):
                names[f"double_blocks.{match.group(1)}.{member}"] = module
        return names

    def diffusers_names(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if TENCENT_FILE.denoiser_file_key in weights:
            return TENCENT_FILE.diffusers_names(weights)
        return super().diffusers_names(weights)


class HunyuanVideo15Targets(AdapterTargets):
    default_targets = {"transformer": DOUBLE_BLOCK_TARGETS}  # Flux.1's double blocks' modules are these blocks' too
    lora_text_encoders = ()  # the transformer's adapters alone (see the module's docstring)

    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        """Each double-stream block's layers by full name: the token refiner has layers of the same names, which
        the original layout fuses (its `self_attn_qkv`) and musubi-tuner leaves out."""
        return targets_in_blocks(model, {"transformer_blocks": DOUBLE_BLOCK_TARGETS})


class HunyuanVideo15Loading(Loading):
    single_file_pipeline = Loading.pipeline_around_denoiser_file

    def components_of(self, pipeline, options) -> Components:
        refuse_meanflow(
            pipeline.transformer,
            "a step-distilled HunyuanVideo 1.5 base",
            "a base model (hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v or -480p_i2v)",
        )
        if pipeline.vae is not None:
            # diffusers' autoencoder broadcasts its mid-block's causal attention mask across a batch wrongly (a batch
            # of two clips fails to encode or decode): one clip at a time, as its own slicing runs it.
            pipeline.vae.enable_slicing()
        return super().components_of(pipeline, options)


class HunyuanVideo15Drawing(ClipDrawing, FlowDrawing):
    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """The pipeline's guider at this scale (see the module's docstring), with the negative prompt."""
        guider = ClassifierFreeGuidance(guidance_scale=guidance_scale, enabled=guidance_scale > 1)
        return {"guidance": guider, "negative_prompt": negative_prompt or None}

    def draw_clips(self, pipeline, prompt, controls, height, width, frames, guidance=None, **arguments) -> list[list]:
        with attributes_set(pipeline, guider=guidance):
            return super().draw_clips(pipeline, prompt, controls, height, width, frames, **arguments)


class HunyuanVideo15Conditioning(HunyuanTextConditioning):
    padded_text_tokens = TEXT_TOKENS
    template_tokens = TEMPLATE_TOKENS
    glyph_tokens = GLYPH_TOKENS

    def latent_normalization(self, vae) -> LatentNormalization:
        return LatentNormalization(scale=float(vae.config.scaling_factor))  # the pipeline decodes without a shift

    def templated_ids(self, tokenizer, captions: list[str]) -> torch.Tensor:
        encoded = tokenizer.apply_chat_template(
            format_text_input(captions, SYSTEM_MESSAGE),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            padding="max_length",
            max_length=TEMPLATE_TOKENS + TEXT_TOKENS,
            truncation=True,
            return_tensors="pt",
        )
        return encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, NO_TOKEN)

    def glyph_text(self, caption: str) -> str | None:
        return extract_glyph_texts(caption)


class HunyuanVideo15(FlowMatchingFamily):
    name = "hunyuan_video15"
    layout = HunyuanVideo15Layout()
    loading = HunyuanVideo15Loading()
    conditioning = HunyuanVideo15Conditioning()
    drawing = HunyuanVideo15Drawing()
    targets = HunyuanVideo15Targets()
    description = "HunyuanVideo 1.5"
    pipeline_class = with_transformer_lora_loading(HunyuanVideo15Pipeline)
    pipeline_classes = ("HunyuanVideo15Pipeline",)
    denoiser_class = HunyuanVideo15Transformer3DModel
    denoiser_name = "transformer"
    text_encoder_names = ("text_encoder", "text_encoder_2")
    tokenizer_names = ("tokenizer", "tokenizer_2")
    block_lists = ("transformer_blocks",)
    options_model = FamilyOptions  # no guidance embedding: classifier-free guidance
    reads_clips = True
    # The guider a saved folder carries (diffusers' loader requires one): the model card's classifier-free guidance at
    # 6, as diffusers' converter writes it; each sample is drawn with its own (`draw_clips`).
    fixed_pipeline_arguments = {"guider": ClassifierFreeGuidance(guidance_scale=6.0)}

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.out_channels  # it reads a conditioning clip and its mask beside them

    # Prompts and the transformer.

    def conditions(self, components: Components, clip: torch.Tensor, conditioning: dict) -> dict[str, torch.Tensor]:
        """What the transformer reads beside the noisy clip (B, C, t, h, w): the conditioning clip and its mask
        (B, C + 1, t, h, w) and the image states. Text-to-video's are empty: zeros, and one zero image state (masked:
        the pipeline's 729 change nothing more)."""
        return {
            "clip": clip.new_zeros(clip.shape[0], clip.shape[1] + 1, *clip.shape[2:]),
            "image_embeds": clip.new_zeros(len(clip), IMAGE_TOKENS, components.denoiser.config.image_embed_dim),
        }

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """An image's latents (B, C, h, w) as one-frame clips; a clip's (B, C, t, h, w) as they are; beside them the
        conditioning clip with its mask, and the image states (`conditions`)."""
        texts = text_arguments(conditioning, components.denoiser, least_glyphs=1)
        dtype = texts["encoder_hidden_states"].dtype
        clip = (noisy if noisy.dim() == 5 else noisy[:, :, None]).to(dtype)
        conditions = self.conditions(components, clip, conditioning)
        prediction = components.denoiser(
            hidden_states=torch.cat([clip, conditions["clip"].to(dtype)], dim=1),
            timestep=timesteps.to(dtype),
            image_embeds=conditions["image_embeds"].to(dtype),
            **texts,
            return_dict=False,
        )[0]
        return prediction if noisy.dim() == 5 else prediction[:, :, 0]


FAMILY = HunyuanVideo15()
