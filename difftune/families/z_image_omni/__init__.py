"""Z-Image Omni (`ZImageOmniPipeline`): Z-Image's DiT in its omni form, whose sequence holds the caption's segments, the
images (references clean, the target noisy, each with its own time embedding) and each reference's SigLIP2 features;
trained on captioned images (text-to-image) and on edit pairs (references and their target), the family Z-Image's
otherwise (z_image.py). Trained by flow matching (flow.py).

- Text, exactly as `ZImageOmniPipeline.encode_prompt`: a caption without references is one segment, the chat turn
  "<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n" (the text Z-Image's chat template makes with thinking
  enabled, so tokenized as Z-Image's); with n references it is n + 2 segments, vision markers around each reference's
  place ("<|im_start|>user\\n<|vision_start|>", "<|vision_end|><|vision_start|>" between references, the caption
  after the last, "<|vision_end|><|im_end|>" to close). Each segment is read by the language model on its own; its
  second-to-last states at the segment's valid tokens are kept, the segments' one after the other with the number of
  the segment each token belongs to (`text_segments`), so that the text cache stores them as Z-Image's.
- References: each edit pair's control images, in order. The transformer reads each as clean latents (the
  autoencoder's mode, less its shift, times its scale: the pipeline's `prepare_image_latents`) and as SigLIP2
  features of the image (the pipeline's `prepare_siglip_embeds`: the vision model's last states over the
  processor's patch grid). The SigLIP2 model and processor are text encoders here: `tokenize` takes a caption's
  references, whose patches key the text cache entry as its tokens do (Qwen-Image-Edit's way).
- The transformer is called as the pipeline calls it: each sample a list of its images (references, noise mask 0,
  then the noisy target, 1), its caption's segments and its SigLIP features (None without references); it returns
  the target's prediction. The time as 1 - sigma and the prediction negated, as Z-Image's.
- Sizes: a reference trains at its target's area, aspect kept, sides in multiples of 16 (the pipeline crops to those)
  and at least 64 px (the pipeline refuses smaller ones); samples drawn at a set size give the pipeline references so
  sized (it keeps one of at most 1 MP as it is).
- Files: Z-Image's layouts (the kohya layout with q, k and v fused, the original single file); a single file of the
  omni transformer (it has `siglip_embedder`) is this family's, not Z-Image's.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from diffusers import ZImageOmniPipeline

from difftune.families.common.conditioning import ReferenceSizedConditioning
from difftune.families.common.drawing import ReferenceSizedDrawing
from difftune.families.common.targets import targets_in_blocks
from difftune.families.z_image import (
    BLOCK_LISTS,
    TEXT_TOKENS,
    TRANSFORMER_TARGETS,
    ZImage,
    ZImageConditioning,
    ZImageDrawing,
    ZImageLayout,
    ZImageTargets,
)
from difftune.models.components import Components

# The segments `ZImageOmniPipeline._encode_prompt` makes of a caption: with references, an opening before the first,
# a marker between each two, the caption after the last, and a closing; without, one chat turn.
SEGMENT_OPENING = "<|im_start|>user\n<|vision_start|>"
BETWEEN_REFERENCES = "<|vision_end|><|vision_start|>"
CAPTION_SEGMENT = "<|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n<|vision_start|>"
SEGMENT_CLOSING = "<|vision_end|><|im_end|>"
PLAIN_SEGMENT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
# The tokens a caption's segments may take besides its own (each at most `TEXT_TOKENS`, as the pipeline truncates
# them): the markers of `max_controls` references, a few tokens each.
MARKER_TOKENS = 64
# What the SigLIP2 processor makes of a reference, and the features the vision model reads from it: the conditioning
# entries that are per reference, not per token (the text cache keeps them whole).
SIGLIP_INPUTS = ("pixel_values", "pixel_attention_mask", "spatial_shapes")
SIGLIP_STATES = ("siglip_states", "siglip_shapes")


def prompt_segments(caption: str, references: int) -> list[str]:
    """A caption's segments for `references` reference images, as the pipeline writes them."""
    if not references:
        return [PLAIN_SEGMENT.format(caption)]
    return [
        SEGMENT_OPENING,
        *[BETWEEN_REFERENCES] * (references - 1),
        CAPTION_SEGMENT.format(caption),
        SEGMENT_CLOSING,
    ]


def _text_and_references(conditioning: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """A caption's conditioning split into its per-token entries and its references' SigLIP entries."""
    references = {name: value for name, value in conditioning.items() if name in SIGLIP_STATES}
    return {name: value for name, value in conditioning.items() if name not in references}, references


@contextmanager
def inputs_in_dtype(module: torch.nn.Module, dtype: torch.dtype):
    """A block in which `module`'s tensor input is cast to `dtype` first: the pipeline encodes references as bfloat16
    (`vae.encode(image.bfloat16())`, for its bf16 autoencoder), which an autoencoder in another dtype refuses."""
    handle = module.register_forward_pre_hook(lambda _, args: (args[0].to(dtype), *args[1:]))
    try:
        yield
    finally:
        handle.remove()


class ZImageOmniLayout(ZImageLayout):
    """Z-Image Omni's files: Z-Image's layouts over the omni transformer."""

    omni = True

    kohya_model_version = "z_image_omni"

    kohya_layout_name = "Z-Image Omni"


class ZImageOmniTargets(ZImageTargets):
    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        """Z-Image's targets in the refiner and main blocks, by name (the SigLIP refiner's blocks, which have the same
        layers, are left as they are)."""
        return targets_in_blocks(model, dict.fromkeys(BLOCK_LISTS, TRANSFORMER_TARGETS))


class ZImageOmniDrawing(ReferenceSizedDrawing, ZImageDrawing):
    inpaint_pipeline_class = None  # ZImageInpaintPipeline draws Z-Image's transformer, not Omni's

    def draw(self, pipeline, options, prompt, controls, height, width, **arguments) -> list:
        with inputs_in_dtype(pipeline.vae.encoder, pipeline.vae.dtype):
            return super().draw(pipeline, options, prompt, controls, height, width, **arguments)


class ZImageOmniConditioning(ReferenceSizedConditioning, ZImageConditioning):
    reference_encoder_names = ("siglip",)
    prompts_see_controls = True
    padded_text_tokens = TEXT_TOKENS + MARKER_TOKENS

    def encoder_tokenizers(self) -> list[tuple[str, str]]:
        return [("text_encoder", "tokenizer")]  # the language model's (SigLIP2 reads references, not tokens)

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        """Each caption's segments' token ids (B, segments, `TEXT_TOKENS`), padded and truncated as the pipeline pads
        each segment; for captions with references (PIL, a list per caption, as many for every caption of a call),
        the SigLIP2 processor's patches of each (B, references, ...)."""
        controls = controls or [[] for _ in captions]
        tokenizer = tokenizers["tokenizer"]
        segments = [prompt_segments(caption, len(images)) for caption, images in zip(captions, controls, strict=True)]
        ids = tokenizer(
            [segment for caption in segments for segment in caption],
            padding="max_length",
            max_length=TEXT_TOKENS,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        token_ids = {"text_encoder": ids.view(len(captions), -1, TEXT_TOKENS)}
        if not controls[0]:
            return token_ids
        processor = tokenizers["siglip_processor"]
        processed = [processor(images=[image], return_tensors="pt") for images in controls for image in images]
        # The pipeline has each reference processed alone: its patches padded to the processor's most.
        references = (len(captions), len(controls[0]))
        return token_ids | {
            name: torch.cat([inputs[name] for inputs in processed]).unflatten(0, references) for name in SIGLIP_INPUTS
        }

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The segments' states one after the other per caption (`encoder_hidden_states`, zero-padded to
        `padded_text_tokens`), their `text_mask` and `text_segments` (1, 2, ... per token, 0 for padding); with
        references, their SigLIP2 features (`siglip_states`, (B, references, patches, C)) and patch grids."""
        ids = token_ids["text_encoder"]
        batch, segments = ids.shape[:2]
        flat = ids.flatten(0, 1)
        mask = flat != components.tokenizers["tokenizer"].pad_token_id
        longest = int(mask.sum(dim=1).max())
        states = components.text_encoders["text_encoder"](
            input_ids=flat[:, :longest], attention_mask=mask[:, :longest], output_hidden_states=True
        ).hidden_states[-2]
        packed = states.new_zeros(batch, self.padded_text_tokens, states.shape[-1])
        segment_of = torch.zeros(batch, self.padded_text_tokens, dtype=torch.long, device=states.device)
        for i in range(batch):
            start = 0
            for s in range(segments):
                kept = states[i * segments + s][mask[i * segments + s, :longest]]
                packed[i, start : start + len(kept)] = kept
                segment_of[i, start : start + len(kept)] = s + 1
                start += len(kept)
        conditioning = {
            "encoder_hidden_states": packed,
            "text_mask": (segment_of > 0).long(),
            "text_segments": segment_of,
        }
        if "pixel_values" not in token_ids:
            return conditioning
        references = token_ids["pixel_values"].shape[1]
        siglip = components.text_encoders["siglip"]
        features = siglip(
            pixel_values=token_ids["pixel_values"].flatten(0, 1).to(siglip.dtype),
            pixel_attention_mask=token_ids["pixel_attention_mask"].flatten(0, 1),
            spatial_shapes=token_ids["spatial_shapes"].flatten(0, 1),
        ).last_hidden_state
        return conditioning | {
            "siglip_states": features.view(batch, references, *features.shape[1:]),
            "siglip_shapes": token_ids["spatial_shapes"],
        }

    def cached_conditioning(self, conditioning: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Z-Image's entry (the text past its valid tokens dropped) beside the references' SigLIP features whole."""
        text, references = _text_and_references(conditioning)
        return super().cached_conditioning(text) | references

    def uncached_conditioning(self, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        text, references = _text_and_references(stored)
        return super().uncached_conditioning(text) | references


class ZImageOmni(ZImage):
    name = "z_image_omni"
    layout = ZImageOmniLayout()
    conditioning = ZImageOmniConditioning()
    drawing = ZImageOmniDrawing()
    targets = ZImageOmniTargets()
    description = "Z-Image Omni"
    pipeline_class = ZImageOmniPipeline
    pipeline_classes = ("ZImageOmniPipeline",)
    text_encoder_names = ("text_encoder", "siglip")
    tokenizer_names = ("tokenizer", "siglip_processor")
    # The pipeline takes any number of references; each costs its latents' and SigLIP features' tokens. Three, as
    # Qwen-Image-Edit-Plus reads.
    max_controls = 3

    # The transformer.

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """Each sample as the pipeline's omni call takes it: its images (references, then the noisy target), its
        caption's segments and its references' SigLIP features (None without references)."""
        states = conditioning["encoder_hidden_states"]
        segment_of = conditioning.get("text_segments", conditioning["text_mask"])
        references = conditioning.get("control_latents", [])
        images = [
            [*(reference[i].unsqueeze(1) for reference in references), latent]
            for i, latent in enumerate(noisy.unsqueeze(2).unbind(0))
        ]
        captions = [
            [caption[segments == s] for s in range(1, int(segments.max()) + 1)]
            for caption, segments in zip(states, segment_of, strict=True)
        ]
        prediction = components.denoiser(
            [[image.to(states.dtype) for image in sample] for sample in images],
            ((1000 - timesteps) / 1000).to(states.dtype),
            captions,
            siglip_feats=[self.siglip_features(conditioning, i) if references else None for i in range(len(noisy))],
            image_noise_mask=[[0] * len(references) + [1]] * len(noisy),
            return_dict=False,
        )[0]
        return -torch.stack(prediction).squeeze(2)

    @staticmethod
    def siglip_features(conditioning: dict, sample: int) -> list:
        """One sample's references' SigLIP features as the pipeline hands them over: each its patch grid's states
        (h, w, C), then None for the target."""
        grids = conditioning["siglip_shapes"][sample].long().tolist()  # the cache writes every tensor as float32
        features = conditioning["siglip_states"][sample]
        return [states[: h * w].view(h, w, -1) for states, (h, w) in zip(features, grids, strict=True)] + [None]


FAMILY = ZImageOmni()
