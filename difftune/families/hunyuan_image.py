"""HunyuanImage 2.1 (`HunyuanImagePipeline`): Tencent's MMDiT (`HunyuanImageTransformer2DModel`: double-stream blocks,
then single-stream ones, as Flux.1's, over a token refiner of the caption) on the 64-channel latents of a 32x
autoencoder (`AutoencoderKLHunyuanImage`), each latent pixel one token, conditioned on a Qwen2.5-VL language model and,
for the text a caption quotes, on ByT5's glyph states. Trained by flow matching (flow.py).

- Text, exactly as `HunyuanImagePipeline.encode_prompt`: the caption in the pipeline's template, padded to the
  `TEMPLATE_TOKENS` + `TEXT_TOKENS` it reads, the language model's third-to-last hidden state (it skips two layers),
  the template's first `TEMPLATE_TOKENS` dropped, with the mask of real tokens; and, where the caption quotes text
  ('...', "...", or Chinese quotes), ByT5's states of it as the pipeline formats it (`extract_glyph_text`: `Text
  "...". `), `GLYPH_TOKENS` of them with their mask; none (zeros, a zero mask) where it quotes nothing. The language
  model reads the padding as the pipeline runs it (every caption at the full length, masked), so its states are the
  pipeline's bit for bit. The cache keeps each caption's real tokens of both and pads them back.
- The transformer masks the padding of both out of its attention and its token refiner's pooling, so `denoise` cuts
  both to the batch's longest caption (a batch without quoted text passes no glyph states: all would be masked).
- Latents (B, 64, h, w) at 32x, the autoencoder's scaled by its `scaling_factor` (no shift), as the pipeline decodes
  them. Time: the scheduler's timestep (0-1000), and the prediction the flow velocity (noise minus image).
- The distilled model (meanflow: a second time, the next step's, and a guidance embedding) is refused by name: its
  training objective is its own; the base model trains.
- Samples: the pipeline guides through its `guider` (and `ocr_guider` where the caption quotes text): both are
  `AdaptiveProjectedMixGuidance` at `sample.guidance_scale` (on above 1), at diffusers' defaults for the rest, which
  are HunyuanImage 2.1's.
- Files: diffusers' layout (`transformer.`; `HunyuanImagePipeline` has no LoRA loader, so the family's pipeline is
  `HunyuanImageLoraPipeline`, the same pipeline with diffusers' generic transformer LoRA loading, which reads it as
  `transformer.load_lora_adapter` does). The kohya layout is ComfyUI's: ComfyUI runs HunyuanImage 2.1 as its
  HunyuanVideo model, on Flux.1's block layers (`double_blocks.0.img_attn.qkv`, a single block's `linear1`), and
  maps `lora_unet_` + those names: Flux's fused tables (flux.py), whose diffusers modules are this transformer's too.
  No single file is read or written yet (ComfyUI's repackaged checkpoint's names outside the blocks are not pinned).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import AdaptiveProjectedMixGuidance, HunyuanImagePipeline, HunyuanImageTransformer2DModel
from diffusers.loaders.lora_pipeline import CogView4LoraLoaderMixin
from diffusers.pipelines.hunyuan_image.pipeline_hunyuanimage import extract_glyph_text

from difftune.errors import DifftuneError
from difftune.families.conditioning import NO_TOKEN, padded, trimmed, valid_token_states
from difftune.families.flow import FlowMatchingFamily
from difftune.families.flux import DOUBLE_BLOCK_TARGETS, FluxLayout, single_block_row_sizes
from difftune.families.layouts import FusedLayout
from difftune.families.loading import FamilyOptions
from difftune.families.targets import targets_in_blocks
from difftune.models.autoencoders import LatentNormalization
from difftune.models.parts import Components

# The pipeline's prompt template and the number of its tokens before the caption that it drops
# (`prompt_template_encode`, `prompt_template_encode_start_idx`; tests/test_families.py checks them against it).
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>"
)
TEMPLATE_TOKENS = 34
TEXT_TOKENS = 1000  # the pipeline's `tokenizer_max_length`: caption tokens read after the template's start
GLYPH_TOKENS = 128  # its `tokenizer_2_max_length`: ByT5's bytes of the quoted text
SKIPPED_LAYERS = 2  # the language model's last layers the pipeline skips (`hidden_state_skip_layer`)
# The language model's states and the glyph states, each with its mask: what the text cache trims to a caption's real
# tokens.
TEXT = ("encoder_hidden_states", "text_mask")
GLYPHS = ("encoder_hidden_states_2", "text_mask_2")
# Every double-stream block's attention and MLP projections (image and text streams), every single-stream block's
# attention, MLP input and output: the blocks musubi-tuner adapts, not the caption's token refiner (which has no name
# in ComfyUI's layout of the blocks). A single block's fused `linear1` (q, k, v and the MLP input) is adapted whole.
BLOCK_TARGETS = {
    "transformer_blocks": DOUBLE_BLOCK_TARGETS,  # Flux.1's double blocks' modules are this transformer's
    "single_transformer_blocks": ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out"],
}
BLOCK_LISTS = tuple(BLOCK_TARGETS)


def padded_ids(tokenizer, texts: list[str], length: int) -> torch.Tensor:
    """`texts`' ids as the pipeline tokenizes them (padded to `length`, truncated), -1 at the padding."""
    encoded = tokenizer(texts, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    return encoded.input_ids.masked_fill(encoded.attention_mask == 0, NO_TOKEN)


def _picked(conditioning: dict[str, torch.Tensor], names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {name: conditioning[name] for name in names}


class HunyuanImageLoraPipeline(HunyuanImagePipeline, CogView4LoraLoaderMixin):
    """`HunyuanImagePipeline` with diffusers' LoRA loading of a transformer-only pipeline (`load_lora_weights`,
    `fuse_lora`, `set_adapters`), which diffusers ships for other transformer families but not this one: CogView 4's
    mixin, whose conversions apply to CogView files alone, reads a `transformer.` file as the transformer's
    `load_lora_adapter` does."""

    _lora_loadable_modules = ["transformer"]


class HunyuanImageLayout(FusedLayout):
    """HunyuanImage 2.1's files in ComfyUI's layout (see the module's docstring): Flux's block tables."""

    kohya_prefixes = {"transformer": "lora_unet_"}
    kohya_text_model_parts = ()
    kohya_model_version = "hunyuan_image"
    kohya_layout_name = "ComfyUI's HunyuanVideo (Flux block)"
    kohya_blocks = FluxLayout.kohya_blocks

    def fused_row_sizes(self, modules: list[str], rows: int, columns: int) -> list[int]:
        return single_block_row_sizes(modules, rows) or super().fused_row_sizes(modules, rows, columns)


class HunyuanImage(FlowMatchingFamily):
    name = "hunyuan_image"
    layout = HunyuanImageLayout()
    description = "HunyuanImage 2.1"
    pipeline_class = HunyuanImageLoraPipeline
    pipeline_classes = ("HunyuanImagePipeline",)
    denoiser_class = HunyuanImageTransformer2DModel
    denoiser_name = "transformer"
    text_encoder_names = ("text_encoder", "text_encoder_2")
    tokenizer_names = ("tokenizer", "tokenizer_2")
    block_lists = BLOCK_LISTS
    default_targets = {"transformer": sorted({target for targets in BLOCK_TARGETS.values() for target in targets})}
    padded_text_tokens = TEXT_TOKENS
    options_model = FamilyOptions  # no guidance embedding in the base model
    lora_text_encoders = ()  # the transformer's adapters alone (see the module's docstring)
    prompt_template = PROMPT_TEMPLATE
    template_tokens = TEMPLATE_TOKENS
    # The guiders are made for each sample at its guidance scale (`draw`), never read from the base.
    fixed_pipeline_arguments = {"guider": None, "ocr_guider": None}

    def components_of(self, pipeline, options) -> Components:
        if pipeline.transformer is not None and pipeline.transformer.config.use_meanflow:
            raise DifftuneError(
                "a distilled HunyuanImage 2.1 base (meanflow: the transformer reads the next step's time too): its "
                "objective is its own and is not trained; train the base model (hunyuanvideo-community/"
                "HunyuanImage-2.1-Diffusers)"
            )
        return super().components_of(pipeline, options)

    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        """Each block's layers by full name (see `BLOCK_TARGETS`)."""
        return targets_in_blocks(model, BLOCK_TARGETS)

    def save_pipeline(self, pipeline, folder: Path) -> None:
        """Written as a `HunyuanImagePipeline` folder, the class diffusers and other tools load (not as the subclass
        that gives difftune its LoRA loading)."""
        super().save_pipeline(pipeline, folder)
        index = Path(folder) / "model_index.json"
        index.write_text(
            json.dumps(json.loads(index.read_text()) | {"_class_name": HunyuanImagePipeline.__name__}, indent=2) + "\n"
        )

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_channels  # each latent pixel is one token

    def latent_normalization(self, vae) -> LatentNormalization:
        return LatentNormalization(scale=float(vae.config.scaling_factor))  # the pipeline decodes without a shift

    # Prompts and the transformer.

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        """The templated captions' ids as the pipeline pads them (to the full length it reads), and each caption's
        glyph text's ByT5 ids so too (none where it quotes nothing); -1 (no token's id) where the padding mask is 0."""
        texts = [self.prompt_template.format(caption) for caption in captions]
        ids = padded_ids(tokenizers["tokenizer"], texts, self.template_tokens + TEXT_TOKENS)
        glyph_ids = torch.full((len(captions), GLYPH_TOKENS), NO_TOKEN, dtype=torch.long)
        for i, caption in enumerate(captions):
            if (glyph := extract_glyph_text(caption)) is not None:
                glyph_ids[i] = padded_ids(tokenizers["tokenizer_2"], [glyph], GLYPH_TOKENS)[0]
        return {"text_encoder": ids, "text_encoder_2": glyph_ids}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The language model over every caption padded to the full length, as the pipeline runs it; ByT5 over each
        quoted text padded to `GLYPH_TOKENS`, with its mask as a float (the pipeline's call)."""
        ids = token_ids["text_encoder"]
        mask = ids != NO_TOKEN
        pad = components.tokenizers["tokenizer"].pad_token_id
        states = components.text_encoders["text_encoder"](
            input_ids=ids.masked_fill(~mask, pad), attention_mask=mask.long(), output_hidden_states=True
        ).hidden_states[-(SKIPPED_LAYERS + 1)]
        conditioning = valid_token_states(states, mask, self.template_tokens, TEXT_TOKENS)
        glyph_ids = token_ids["text_encoder_2"]
        glyph_mask = glyph_ids != NO_TOKEN
        encoder = components.text_encoders["text_encoder_2"]
        glyph_states = torch.zeros(*glyph_ids.shape, encoder.config.d_model, device=ids.device, dtype=states.dtype)
        quoted = glyph_mask.any(dim=1)
        if quoted.any():
            glyph_pad = components.tokenizers["tokenizer_2"].pad_token_id
            glyph_states[quoted] = encoder(
                input_ids=glyph_ids[quoted].masked_fill(~glyph_mask[quoted], glyph_pad),
                attention_mask=glyph_mask[quoted].float(),
            )[0].to(states.dtype)
        glyph_states = glyph_states * glyph_mask[..., None]  # zero past the glyph bytes, as the cache pads them back
        return conditioning | {"encoder_hidden_states_2": glyph_states, "text_mask_2": glyph_mask.long()}

    def cached_conditioning(self, conditioning: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each text's real tokens alone: the language model's and the glyph text's."""
        return trimmed(_picked(conditioning, TEXT)) | trimmed(_picked(conditioning, GLYPHS), mask=GLYPHS[1])

    def uncached_conditioning(self, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return padded(_picked(stored, TEXT), TEXT_TOKENS) | padded(_picked(stored, GLYPHS), GLYPH_TOKENS)

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """Both texts cut to the batch's longest (their padding is masked out); the glyph states left out where no
        caption of the batch quotes text."""
        mask = conditioning["text_mask"].bool()
        longest = int(mask.sum(dim=1).max())
        states = conditioning["encoder_hidden_states"][:, :longest]
        glyph_mask = conditioning["text_mask_2"].bool()
        glyph_longest = int(glyph_mask.sum(dim=1).max())
        glyphs = {}
        if glyph_longest:
            glyphs = {
                "encoder_hidden_states_2": conditioning["encoder_hidden_states_2"][:, :glyph_longest].to(states.dtype),
                "encoder_attention_mask_2": glyph_mask[:, :glyph_longest],
            }
        return components.denoiser(
            hidden_states=noisy.to(states.dtype),
            timestep=timesteps.to(states.dtype),
            encoder_hidden_states=states,
            encoder_attention_mask=mask[:, :longest],
            **glyphs,
            return_dict=False,
        )[0]

    # Sampling.

    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """The pipeline's guiders at this scale (see the module's docstring), with the negative prompt."""
        guider = AdaptiveProjectedMixGuidance(guidance_scale=guidance_scale, enabled=guidance_scale > 1)
        return {"guidance": guider, "negative_prompt": negative_prompt or None}

    def draw(self, pipeline, options, prompt, controls, height, width, guidance=None, **arguments) -> list:
        pipeline.guider, pipeline.ocr_guider = guidance, guidance.new() if guidance is not None else None
        return pipeline(prompt=prompt, height=height, width=width, **arguments).images

    def max_sequence_length(self, components: Components) -> int:
        return TEXT_TOKENS
