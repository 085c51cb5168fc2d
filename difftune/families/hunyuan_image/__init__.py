"""HunyuanImage 2.1 (`HunyuanImagePipeline`): Tencent's MMDiT (`HunyuanImageTransformer2DModel`: double-stream blocks,
then single-stream ones, as Flux.1's, over a token refiner of the caption) on the 64-channel latents of a 32x
autoencoder (`AutoencoderKLHunyuanImage`), each latent pixel one token, conditioned on a Qwen2.5-VL language model and,
for the text a caption quotes, on ByT5's glyph states. Trained by flow matching (flow.py).

- Text, exactly as `HunyuanImagePipeline.encode_prompt` (hunyuan_text.py, shared with HunyuanVideo 1.5): the caption
  in the pipeline's template, the language model's states and, where the caption quotes text ('...', "...", or
  Chinese quotes; `extract_glyph_text`), ByT5's glyph states of it; a batch without quoted text passes no glyph
  states (all would be masked).
- Latents (B, 64, h, w) at 32x, the autoencoder's scaled by its `scaling_factor` (no shift), as the pipeline decodes
  them. Time: the scheduler's timestep (0-1000), and the prediction the flow velocity (noise minus image).
- The distilled model (meanflow: a second time, the next step's, and a guidance embedding) is refused by name: its
  training objective is its own; the base model trains.
- Samples: the pipeline guides through its `guider` (and `ocr_guider` where the caption quotes text): both are
  `AdaptiveProjectedMixGuidance` at `sample.guidance_scale` (on above 1), at diffusers' defaults for the rest, which
  are HunyuanImage 2.1's.
- Files: diffusers' layout (`transformer.`; `HunyuanImagePipeline` has no LoRA loader, so the family's pipeline is
  `HunyuanImageLoraPipeline`, the same pipeline with diffusers' generic transformer LoRA loading
  (`with_transformer_lora_loading`), saved as a `HunyuanImagePipeline`). The kohya layout is ComfyUI's: ComfyUI runs
  HunyuanImage 2.1 as its HunyuanVideo model, on Flux.1's block layers (`double_blocks.0.img_attn.qkv`, a single
  block's `linear1`), and maps `lora_unet_` + those names: Flux's fused tables (flux.py), whose diffusers modules are
  this transformer's too. A single file is the transformer alone in Tencent's layout (`hunyuanimage2.1.safetensors`,
  and Comfy-Org's repackaged bf16 file: `double_blocks.0.img_attn_qkv`, `single_blocks.0.linear1` (q, k, v and the
  MLP input), `linear2`), read and written by the mapping of diffusers' converter inverted (hunyuan_original.py,
  shared with HunyuanVideo 1.5, whose files keep q, k and v apart; the output modulation's halves swapped). Files
  saved from ComfyUI's model name the same layers as its modules do (`img_attn.qkv`, `mlp.0`, `mod.lin`,
  `in_layer`), and are read too. The text encoders and the autoencoder come from `model.single_file_config`.
"""

from __future__ import annotations

import re

import torch
from diffusers import AdaptiveProjectedMixGuidance, HunyuanImagePipeline, HunyuanImageTransformer2DModel
from diffusers.pipelines.hunyuan_image.pipeline_hunyuanimage import extract_glyph_text

from difftune.families.common.flow import FlowDrawing, FlowMatchingFamily
from difftune.families.common.hunyuan_original import FUSED_BLOCKS, ORIGINAL_GLOBALS, SWAPPED_HALVES
from difftune.families.common.hunyuan_text import (
    HunyuanTextConditioning,
    attributes_set,
    padded_ids,
    refuse_meanflow,
    text_arguments,
)
from difftune.families.common.layouts import FusedLayout, Layout, OriginalFileLayout
from difftune.families.common.loading import FamilyOptions, Loading, with_transformer_lora_loading
from difftune.families.common.targets import AdapterTargets, targets_in_blocks
from difftune.families.flux import DOUBLE_BLOCK_TARGETS, FluxLayout, SingleBlockRows
from difftune.families.flux import ORIGINAL_BLOCKS as FLUX_ORIGINAL_BLOCKS
from difftune.models.autoencoders import LatentNormalization
from difftune.models.components import Components

# The pipeline's prompt template and the number of its tokens before the caption that it drops
# (`prompt_template_encode`, `prompt_template_encode_start_idx`; tests/test_families.py checks them against it).
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>"
)
TEMPLATE_TOKENS = 34
TEXT_TOKENS = 1000  # the pipeline's `tokenizer_max_length`: caption tokens read after the template's start
GLYPH_TOKENS = 128  # its `tokenizer_2_max_length`: ByT5's bytes of the quoted text
# Every double-stream block's attention and MLP projections (image and text streams), every single-stream block's
# attention, MLP input and output: the blocks musubi-tuner adapts, not the caption's token refiner (which has no name
# in ComfyUI's layout of the blocks). A single block's fused `linear1` (q, k, v and the MLP input) is adapted whole.
BLOCK_TARGETS = {
    "transformer_blocks": DOUBLE_BLOCK_TARGETS,  # Flux.1's double blocks' modules are this transformer's
    "single_transformer_blocks": ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out"],
}
BLOCK_LISTS = tuple(BLOCK_TARGETS)


HunyuanImageLoraPipeline = with_transformer_lora_loading(HunyuanImagePipeline)


# Tencent's single file (see the module's docstring): q, k and v fused in the double blocks (`img_attn_qkv`,
# hunyuan_original.py) and in the single blocks' input layer (`linear1`: q, k, v and the MLP input), as Tencent's
# `hunyuanimage2.1.safetensors` holds them (its loader and diffusers' converter split them first:
# `convert_hunyuan_dict_for_tensor_parallel`), and its own time and guidance embedders.
SINGLE_FILE_BLOCKS = FUSED_BLOCKS | {
    "single_transformer_blocks": (
        "single_blocks",
        {
            "modulation.linear": ["norm.linear"],
            "linear1": ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"],
            "q_norm": ["attn.norm_q"],
            "k_norm": ["attn.norm_k"],
            "linear2": ["proj_out"],
        },
    ),
}
SINGLE_FILE_GLOBALS = ORIGINAL_GLOBALS | {
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.mlp.0",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.mlp.2",
    "time_guidance_embed.timestep_embedder_r.linear_1": "time_r_in.mlp.0",  # the distilled model's (refused)
    "time_guidance_embed.timestep_embedder_r.linear_2": "time_r_in.mlp.2",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.mlp.0",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.mlp.2",
}
# The same file under the names of ComfyUI's HunyuanVideo model (its own saved and fp8 files): Flux.1's block layers
# (flux.py), the token refiner's `self_attn.qkv` and `mlp.0`, its embedders as `MLPEmbedder`s (`in_layer`, `out_layer`).
COMFYUI_BLOCKS = FLUX_ORIGINAL_BLOCKS | {
    "context_embedder.token_refiner.refiner_blocks": (
        "txt_in.individual_token_refiner.blocks",
        {
            "norm1": ["norm1"],
            "self_attn.qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
            "self_attn.proj": ["attn.to_out.0"],
            "norm2": ["norm2"],
            "mlp.0": ["ff.net.0.proj"],
            "mlp.2": ["ff.net.2"],
            "adaLN_modulation.1": ["norm_out.linear"],
        },
    )
}
# HunyuanVideo (1.0)'s files, in either naming, have this model's blocks and a CLIP vector input besides
HUNYUAN_VIDEO_FILE_KEYS = ("vector_in.in_layer.weight",)
EMBEDDERS = ("time_in.", "time_r_in.", "guidance_in.", "txt_in.t_embedder.", "txt_in.c_embedder.")


def comfyui_globals(single_file_globals: dict[str, str]) -> dict[str, str]:
    """Tencent's layers outside the blocks under ComfyUI's names: its embedders are `MLPEmbedder`s."""
    return {
        module: re.sub(
            r"\.(?:mlp\.0|linear_1)$", ".in_layer", re.sub(r"\.(?:mlp\.2|linear_2)$", ".out_layer", original)
        )
        if original.startswith(EMBEDDERS)
        else original
        for module, original in single_file_globals.items()
    }


class ComfyUIFileLayout(SingleBlockRows, OriginalFileLayout, Layout):
    """HunyuanImage 2.1's transformer file in ComfyUI's names (read; Tencent's names are what difftune writes)."""

    kohya_prefixes = {}
    kohya_layout_name = "ComfyUI's HunyuanImage 2.1"
    denoiser_file_key = "txt_in.individual_token_refiner.blocks.0.self_attn.qkv.weight"  # Tencent's: `self_attn_qkv`
    other_models_file_keys = HUNYUAN_VIDEO_FILE_KEYS
    original_blocks = COMFYUI_BLOCKS
    original_globals = comfyui_globals(SINGLE_FILE_GLOBALS)
    swapped_halves = SWAPPED_HALVES


COMFYUI_FILE = ComfyUIFileLayout()


class ComfyUINamesRead:
    """A layout in Tencent's names whose single files saved from ComfyUI's HunyuanVideo model (its module names:
    `comfyui_file`) are read too."""

    comfyui_file: Layout

    def reads_single_file(self, keys: set[str]) -> bool:
        return super().reads_single_file(keys) or self.comfyui_file.reads_single_file(keys)

    def diffusers_names(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.comfyui_file.denoiser_file_key in weights:
            return self.comfyui_file.diffusers_names(weights)
        return super().diffusers_names(weights)


class HunyuanImageLayout(ComfyUINamesRead, SingleBlockRows, FusedLayout):
    """HunyuanImage 2.1's adapter files in ComfyUI's layout, Flux's block tables; its single files in Tencent's, and
    read in ComfyUI's names too (see the module's docstring)."""

    kohya_prefixes = {"transformer": "lora_unet_"}
    kohya_text_model_parts = ()
    kohya_model_version = "hunyuan_image"
    kohya_layout_name = "HunyuanImage 2.1"
    kohya_blocks = FluxLayout.kohya_blocks
    single_file_layout = "transformer alone (Tencent's layout; ComfyUI's names read too)"
    denoiser_file_key = "double_blocks.0.img_attn_qkv.weight"  # Flux's names fuse it as `img_attn.qkv`
    other_models_file_keys = HUNYUAN_VIDEO_FILE_KEYS
    original_blocks = SINGLE_FILE_BLOCKS
    original_globals = SINGLE_FILE_GLOBALS
    swapped_halves = SWAPPED_HALVES
    comfyui_file = COMFYUI_FILE


class HunyuanImageTargets(AdapterTargets):
    default_targets = {"transformer": sorted({target for targets in BLOCK_TARGETS.values() for target in targets})}
    lora_text_encoders = ()  # the transformer's adapters alone (see the module's docstring)

    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        """Each block's layers by full name (see `BLOCK_TARGETS`)."""
        return targets_in_blocks(model, BLOCK_TARGETS)


class HunyuanImageLoading(Loading):
    single_file_pipeline = Loading.pipeline_around_denoiser_file

    def components_of(self, pipeline, options) -> Components:
        refuse_meanflow(
            pipeline.transformer,
            "a distilled HunyuanImage 2.1 base",
            "the base model (hunyuanvideo-community/HunyuanImage-2.1-Diffusers)",
        )
        return super().components_of(pipeline, options)


class HunyuanImageDrawing(FlowDrawing):
    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """The pipeline's guiders at this scale (see the module's docstring), with the negative prompt."""
        guider = AdaptiveProjectedMixGuidance(guidance_scale=guidance_scale, enabled=guidance_scale > 1)
        return {"guidance": guider, "negative_prompt": negative_prompt or None}

    def draw(self, pipeline, options, prompt, controls, height, width, guidance=None, **arguments) -> list:
        guiders = {"guider": guidance, "ocr_guider": guidance.new() if guidance is not None else None}
        with attributes_set(pipeline, **guiders):  # the sample's own, then the pipeline's again
            return pipeline(prompt=prompt, height=height, width=width, **arguments).images


class HunyuanImageConditioning(HunyuanTextConditioning):
    padded_text_tokens = TEXT_TOKENS
    template_tokens = TEMPLATE_TOKENS
    glyph_tokens = GLYPH_TOKENS

    def latent_normalization(self, vae) -> LatentNormalization:
        return LatentNormalization(scale=float(vae.config.scaling_factor))  # the pipeline decodes without a shift

    def templated_ids(self, tokenizer, captions: list[str]) -> torch.Tensor:
        texts = [self.family.prompt_template.format(caption) for caption in captions]
        return padded_ids(tokenizer, texts, self.template_tokens + TEXT_TOKENS)

    def glyph_text(self, caption: str) -> str | None:
        return extract_glyph_text(caption)


class HunyuanImage(FlowMatchingFamily):
    name = "hunyuan_image"
    layout = HunyuanImageLayout()
    loading = HunyuanImageLoading()
    conditioning = HunyuanImageConditioning()
    drawing = HunyuanImageDrawing()
    targets = HunyuanImageTargets()
    description = "HunyuanImage 2.1"
    pipeline_class = HunyuanImageLoraPipeline
    pipeline_classes = ("HunyuanImagePipeline",)
    denoiser_class = HunyuanImageTransformer2DModel
    denoiser_name = "transformer"
    text_encoder_names = ("text_encoder", "text_encoder_2")
    tokenizer_names = ("tokenizer", "tokenizer_2")
    block_lists = BLOCK_LISTS
    options_model = FamilyOptions  # no guidance embedding in the base model
    prompt_template = PROMPT_TEMPLATE
    # The guiders are made for each sample at its guidance scale (`draw`), never read from the base.
    fixed_pipeline_arguments = {"guider": None, "ocr_guider": None}

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_channels  # each latent pixel is one token

    # Prompts and the transformer.

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        texts = text_arguments(conditioning, components.denoiser)
        states = texts["encoder_hidden_states"]
        return components.denoiser(
            hidden_states=noisy.to(states.dtype), timestep=timesteps.to(states.dtype), **texts, return_dict=False
        )[0]


FAMILY = HunyuanImage()
