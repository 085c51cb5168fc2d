"""HunyuanVideo (1.0, Tencent's, `HunyuanVideoPipeline`; SkyReels V1 T2V is the same model): an MMDiT
(`HunyuanVideoTransformer3DModel`: double-stream blocks, then single-stream ones, as Flux.1's, over a token refiner of
the caption) on HunyuanVideo's causal video autoencoder (autoencoders.py), conditioned on a Llama 3 language model
(LLaVA-LLaMA-3's, `LlamaModel`) and CLIP-L's pooled embedding, guidance-distilled. Trained by flow matching (flow.py)
on clips (dataset.py cuts them into windows of frames) and images, each a one-frame clip.

- Text, exactly as `HunyuanVideoPipeline.encode_prompt`: the caption in the pipeline's prompt template, padded to the
  template's `crop_start` (95) plus `TEXT_TOKENS` tokens, the states of the language model's third-to-last layer from
  position `crop_start` on, with their mask (the caption's tokens, then padding: the text cache keeps the tokens);
  CLIP-L's pooled output of the caption (77 tokens), as `pooled_projections`.
- Latents (B, 16, t, h, w) of the autoencoder (4x in time, 8x in space) times its `scaling_factor`; the transformer
  patches them 1x2x2 and reads the timestep (0-1000) as it is. Noise levels: the scheduler's one shift (7) at every
  size, which training draws with (`loss.flow_shift_by_resolution`) and samples are drawn at.
- Guidance: the model is guidance-distilled; the pipeline passes `guidance_scale` x 1000 to its guidance embedding
  (one pass; `true_cfg_scale` with a negative prompt adds a second), and training conditions on
  `model.family_options.guidance` x 1000 (1, as musubi-tuner's `--guidance_scale` default).
- Files: diffusers' layout (`transformer.`, which `HunyuanVideoPipeline.load_lora_weights` reads: transformer adapters
  alone) with musubi-tuner's targets (every double and single block's attention and MLP layers); the kohya layout is
  the one ComfyUI maps for its HunyuanVideo model, which is built of Flux.1's block layers
  (`lora_unet_double_blocks_0_img_attn_qkv`, `lora_unet_single_blocks_0_linear1`): Flux's fused tables (flux.py). A
  single file is the transformer alone in Tencent's layout (`double_blocks.0.img_attn_qkv`, `single_blocks.0.linear1`,
  the caption refiner's `self_attn_qkv`), the tables HunyuanImage 2.1's files share (hunyuan_image.py) with
  HunyuanVideo's own embedders (`time_in`, `guidance_in`, `vector_in`); files saved from ComfyUI's model, in its
  module names (`img_attn.qkv`, `mlp.0`, `mod.lin`, `in_layer`), are read too.
- SkyReels V1's image-to-video model is its own family (hunyuan_video_skyreels_i2v); Tencent's
  (`HunyuanVideoImageToVideoPipeline`) is not built, refused by its pipeline class.
"""

from __future__ import annotations

import torch
from diffusers import HunyuanVideoPipeline, HunyuanVideoTransformer3DModel
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

from difftune.families.common.conditioning import Conditioning, valid_token_states
from difftune.families.common.drawing import ClipDrawing
from difftune.families.common.flow import FlowDrawing, FlowMatchingFamily
from difftune.families.common.hunyuan_original import ORIGINAL_GLOBALS
from difftune.families.common.layouts import has_file_key
from difftune.families.common.loading import Loading
from difftune.families.common.targets import AdapterTargets, targets_in_blocks
from difftune.families.hunyuan_image import BLOCK_TARGETS, ComfyUIFileLayout, HunyuanImageLayout, comfyui_globals
from difftune.models.components import Components

TEXT_TOKENS = 256  # the pipeline's default `max_sequence_length`: caption tokens read after the template's start
CROP_START = DEFAULT_PROMPT_TEMPLATE["crop_start"]  # the template's tokens before the caption, which it drops
CLIP_TOKENS = 77
HIDDEN_LAYERS_SKIPPED = 2  # `num_hidden_layers_to_skip`: the states read are the third-to-last layer's
# HunyuanVideo's embedders in Tencent's names, beside the token refiner's and the blocks' that HunyuanImage 2.1 shares.
SINGLE_FILE_GLOBALS = {
    module: original for module, original in ORIGINAL_GLOBALS.items() if not module.startswith("context_embedder_2.")
} | {
    "time_text_embed.timestep_embedder.linear_1": "time_in.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "time_in.mlp.2",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.mlp.0",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.mlp.2",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
}
# What tells a HunyuanVideo file from HunyuanImage 2.1's (the same blocks and refiner, in either naming): its CLIP
# vector input (Flux.1's files, which have it too, have no caption refiner).
VECTOR_FILE_KEY = "vector_in.in_layer.weight"


class ComfyUIVideoFileLayout(ComfyUIFileLayout):
    """HunyuanVideo's transformer file in the names of ComfyUI's HunyuanVideo model (its own saved files: read;
    Tencent's names are what difftune writes)."""

    kohya_layout_name = "ComfyUI's HunyuanVideo"
    other_models_file_keys = ()  # HunyuanImage 2.1's file layout refuses HunyuanVideo's vector input; this is for it
    original_globals = comfyui_globals(SINGLE_FILE_GLOBALS)


COMFYUI_FILE = ComfyUIVideoFileLayout()


class HunyuanVideoLayout(HunyuanImageLayout):
    """HunyuanVideo's files: HunyuanImage 2.1's layouts (ComfyUI's names for adapters, Tencent's for single files, and
    ComfyUI's read too), with HunyuanVideo's own embedders."""

    kohya_model_version = "hunyuan_video"
    kohya_layout_name = "HunyuanVideo"
    other_models_file_keys = ()
    original_globals = SINGLE_FILE_GLOBALS
    comfyui_file = COMFYUI_FILE

    def reads_single_file(self, keys: set[str]) -> bool:
        return super().reads_single_file(keys) and has_file_key(keys, VECTOR_FILE_KEY)


class HunyuanVideoTargets(AdapterTargets):
    default_targets = {"transformer": sorted({target for targets in BLOCK_TARGETS.values() for target in targets})}
    lora_text_encoders = ()  # HunyuanVideoPipeline's LoRA loader reads the transformer's adapters alone

    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        """Each double and single block's layers by full name (the caption's token refiner is left: ComfyUI's layout
        of the blocks has no name for its adapters)."""
        return targets_in_blocks(model, BLOCK_TARGETS)


class HunyuanVideoLoading(Loading):
    # Single files: the transformer alone in Tencent's layout (ComfyUI's `hunyuan_video_t2v_720p_bf16.safetensors`);
    # the other parts come from `model.single_file_config`.
    single_file_pipeline = Loading.pipeline_around_denoiser_file


class HunyuanVideoDrawing(ClipDrawing, FlowDrawing):
    pass


class HunyuanVideoConditioning(Conditioning):
    padded_text_tokens = TEXT_TOKENS

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        llama_ids = tokenizers["tokenizer"](
            [DEFAULT_PROMPT_TEMPLATE["template"].format(caption) for caption in captions],
            max_length=CROP_START + TEXT_TOKENS,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
        ).input_ids
        clip_ids = tokenizers["tokenizer_2"](
            captions, max_length=CLIP_TOKENS, padding="max_length", truncation=True, return_tensors="pt"
        ).input_ids
        return {"text_encoder": llama_ids, "text_encoder_2": clip_ids}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = token_ids["text_encoder"]
        mask = ids != components.tokenizers["tokenizer"].pad_token_id
        states = components.text_encoders["text_encoder"](
            input_ids=ids, attention_mask=mask.long(), output_hidden_states=True
        ).hidden_states[-(HIDDEN_LAYERS_SKIPPED + 1)]
        pooled = components.text_encoders["text_encoder_2"](token_ids["text_encoder_2"]).pooler_output
        kept = valid_token_states(states[:, CROP_START:], mask[:, CROP_START:], 0, TEXT_TOKENS)
        return kept | {"pooled_projections": pooled}


class HunyuanVideo(FlowMatchingFamily):
    name = "hunyuan_video"
    layout = HunyuanVideoLayout()
    loading = HunyuanVideoLoading()
    conditioning = HunyuanVideoConditioning()
    drawing = HunyuanVideoDrawing()
    targets = HunyuanVideoTargets()
    description = "HunyuanVideo"
    pipeline_class = HunyuanVideoPipeline
    pipeline_classes = ("HunyuanVideoPipeline",)
    denoiser_class = HunyuanVideoTransformer3DModel
    denoiser_name = "transformer"
    text_encoder_names = ("text_encoder", "text_encoder_2")
    tokenizer_names = ("tokenizer", "tokenizer_2")
    reads_clips = True

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.out_channels  # the transformer patches the latents itself (SkyReels' reads more in)

    def guidance(self, components: Components, batch: int, device) -> torch.Tensor | None:
        """The pipeline's guidance embedding input: the scale x 1000."""
        guidance = super().guidance(components, batch, device)
        return None if guidance is None else guidance * 1000.0

    def transformer_input(self, components: Components, clip: torch.Tensor, conditioning: dict) -> torch.Tensor:
        """What the transformer reads as its hidden states for the noisy clip (B, C, t, h, w): the clip itself."""
        return clip

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """An image's latents (B, C, h, w) as one-frame clips; a clip's (B, C, T, h, w) as they are."""
        states = conditioning["encoder_hidden_states"]
        clip = noisy if noisy.dim() == 5 else noisy[:, :, None]
        prediction = components.denoiser(
            hidden_states=self.transformer_input(components, clip, conditioning).to(states.dtype),
            timestep=timesteps.to(states.dtype),
            encoder_hidden_states=states,
            encoder_attention_mask=conditioning["text_mask"].to(states.dtype),
            pooled_projections=conditioning["pooled_projections"].to(states.dtype),
            guidance=self.guidance(components, len(noisy), noisy.device),
            return_dict=False,
        )[0]
        return prediction if noisy.dim() == 5 else prediction[:, :, 0]


FAMILY = HunyuanVideo()
