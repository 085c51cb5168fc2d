"""Qwen-Image: a 60-block MMDiT (`QwenImageTransformer2DModel`) over 2x2-packed 16-channel latents of Wan's video
autoencoder, conditioned on the last hidden state of a Qwen2.5-VL language model. Trained by flow matching
(flow.py).

- Text, exactly as `QwenImagePipeline.encode_prompt`: each caption is put in the pipeline's chat template, and
  the language model reads it (with its padding mask); of its last hidden state, each caption keeps its valid
  tokens after the template's first `TEMPLATE_TOKENS` (the system prompt), zero-padded. Token ids are padded
  to a fixed `TEXT_TOKENS` + `TEMPLATE_TOKENS` so that a caption's ids (and cache key) do not depend on its
  batch; the model reads them cut to the batch's longest caption, the length the pipeline pads to, and the
  transformer reads the states cut so too (the mask keeps padding out of its attention).
- Latents (B, 16, h, w) from the autoencoder's one-frame clips, normalised per channel (autoencoders.py).
  `denoise` packs each 2x2 patch into one 64-wide token; the transformer places them by `img_shapes`.
- Files: Qwen-Image was published in diffusers' layout, so the original module names are diffusers' names:
  diffusers' LoRA files key them `transformer.<module>`, kohya's layout (musubi-tuner's files, which ComfyUI
  and `QwenImagePipeline.load_lora_weights` read) `lora_unet_<module with _>`. diffusers' Qwen loader reads
  transformer adapters alone: the text encoder is not adapted. A single file is the transformer alone (how
  ComfyUI ships it: `diffusion_models/qwen_image_*.safetensors`); the other parts come from
  `model.single_file_config`.
"""

from __future__ import annotations

import torch
from diffusers import QwenImageControlNetPipeline, QwenImagePipeline, QwenImageTransformer2DModel

from difftune.families.common.conditioning import Conditioning, valid_token_states
from difftune.families.common.control import QwenImageControlNet
from difftune.families.common.flow import FlowMatchingFamily
from difftune.families.common.layouts import DiffusersNamedLayout
from difftune.families.common.loading import Loading
from difftune.families.common.targets import AdapterTargets
from difftune.families.common.tokens import pack, unpack
from difftune.models.components import Components

# QwenImagePipeline's prompt template and the number of its tokens before the caption that it drops
# (`prompt_template_encode`, `prompt_template_encode_start_idx`; tests/test_families.py checks them against it).
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
TEMPLATE_TOKENS = 34
TEXT_TOKENS = 512  # text states the transformer reads at most: the pipeline's default `max_sequence_length`

# Attention (image and text streams) and both streams' MLPs: what musubi-tuner and ai-toolkit adapt in a block.
TRANSFORMER_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
]


class QwenImageLayout(DiffusersNamedLayout):
    """QwenImage's files in other tools' layouts."""

    denoiser_file_key = "transformer_blocks.0.img_mod.1.weight"  # a key every Qwen-Image transformer file has

    kohya_model_version = "qwen_image"


class QwenImageTargets(AdapterTargets):
    default_targets = {"transformer": TRANSFORMER_TARGETS}
    lora_text_encoders = ()  # QwenImagePipeline's LoRA loader reads the transformer's adapters alone


class QwenImageLoading(Loading):
    single_file_pipeline = Loading.pipeline_around_denoiser_file


class QwenImageConditioning(Conditioning):
    template_tokens = TEMPLATE_TOKENS  # its `prompt_template_encode_start_idx`
    padded_text_tokens = TEXT_TOKENS

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        ids = tokenizers["tokenizer"](
            [self.family.prompt_template.format(caption) for caption in captions],
            padding="max_length",
            max_length=self.template_tokens + self.padded_text_tokens,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        return {"text_encoder": ids}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tokenizer = components.tokenizers["tokenizer"]
        ids = token_ids["text_encoder"]
        mask = ids != tokenizer.pad_token_id
        longest = int(mask.sum(dim=1).max())
        cut = slice(None, longest) if tokenizer.padding_side == "right" else slice(ids.shape[1] - longest, None)
        ids, mask = ids[:, cut], mask[:, cut]
        # An edit base's prompts show the language model the control images too: (B, patches, D) per sample.
        images = {
            name: token_ids[name].flatten(0, 1) for name in ("pixel_values", "image_grid_thw") if name in token_ids
        }
        states = components.text_encoders["text_encoder"](
            input_ids=ids, attention_mask=mask.long(), output_hidden_states=True, **images
        ).hidden_states[-1]
        return valid_token_states(states, mask, self.template_tokens, self.padded_text_tokens)


class QwenImage(FlowMatchingFamily):
    name = "qwen_image"
    layout = QwenImageLayout()
    loading = QwenImageLoading()
    conditioning = QwenImageConditioning()
    targets = QwenImageTargets()
    description = "Qwen-Image"
    pipeline_class = QwenImagePipeline
    controlnet = QwenImageControlNet(QwenImageControlNetPipeline)
    pipeline_classes = ("QwenImagePipeline",)
    denoiser_class = QwenImageTransformer2DModel
    denoiser_name = "transformer"
    prompt_template = PROMPT_TEMPLATE  # the pipeline's `prompt_template_encode`

    # Prompts and the transformer.

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """Reference images (an edit base's `control_latents`) follow the image's tokens, each placed by its own
        entry in `img_shapes`, and their predictions are dropped, as the Qwen-Image-Edit pipelines do."""
        h, w = noisy.shape[-2:]
        images = [noisy, *conditioning.get("control_latents", [])]
        return unpack(self.predict_tokens(components, images, timesteps, conditioning)[:, : (h // 2) * (w // 2)], h, w)

    def predict_tokens(self, components, images, timesteps, conditioning, **arguments) -> torch.Tensor:
        """The transformer's prediction (B, tokens, 4C) over `images` (each (B, C, h, w)), packed one after the other,
        each placed by its own entry in `img_shapes`; `arguments`: the rest of the transformer's call."""
        mask = conditioning["text_mask"].bool()
        longest = int(mask.sum(dim=1).max())
        states, mask = conditioning["encoder_hidden_states"][:, :longest], mask[:, :longest]
        b = len(images[0])
        tokens = torch.cat([pack(image) for image in images], dim=1).to(states.dtype)
        timestep = (timesteps / 1000).to(states.dtype)
        inputs = {
            "guidance": self.guidance(components, b, images[0].device),
            "encoder_hidden_states": states,
            "encoder_hidden_states_mask": None if mask.all() else mask,
            "img_shapes": [[(1, image.shape[-2] // 2, image.shape[-1] // 2) for image in images]] * b,
        }
        control = self.control_residuals(components, conditioning, tokens, timestep, **inputs)
        return components.denoiser(
            hidden_states=tokens, timestep=timestep, **inputs, **control, return_dict=False, **arguments
        )[0]


FAMILY = QwenImage()
