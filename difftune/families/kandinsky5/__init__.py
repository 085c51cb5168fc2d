"""Kandinsky 5 text-to-image (`Kandinsky5T2IPipeline`): a DiT (`Kandinsky5Transformer3DModel`: text blocks that refine
the caption, then visual blocks with self-attention, cross-attention to the caption and a feed-forward layer) over
Flux.1's 16-channel autoencoder, conditioned on a Qwen2.5-VL language model's states and a CLIP text model's pooled
output. Trained by flow matching (flow.py).

- Text, exactly as `Kandinsky5T2IPipeline.encode_prompt`: the caption cleaned as the pipeline cleans it
  (`prompt_clean`), put in its prompt template, read by the language model (its last hidden state, right-padded
  with no mask: the causal model's states at the caption do not see the padding), the template's first
  `TEMPLATE_TOKENS` dropped; and CLIP's pooled output of the cleaned caption (77 tokens). The transformer reads a
  caption's states without a mask, at their own length (the pipeline draws one prompt a call, unpadded): a batch's
  captions of different lengths are denoised group by group, each at its own length.
- Latents (B, 16, h, w) as the pipeline decodes them: the autoencoder's times its `scaling_factor` (no shift);
  the transformer takes them channels-last as one-frame clips, and the time as the scheduler's timestep (0-1000).
- Sampling at the size asked: the pipeline snaps every size to its own list of seven (1024 x 1024, 640 x 1408...),
  so its list is set to the size drawn.
- Files: the original model's module names are diffusers' (`visual_transformer_blocks.0.self_attention.to_query`):
  diffusers' LoRA files key them `transformer.<module>`, the kohya layout `lora_unet_<module with _>`; a single file
  is the transformer alone under those names. `KandinskyLoraLoaderMixin` reads the transformer's adapters alone.
"""

from __future__ import annotations

import torch
from diffusers import Kandinsky5T2IPipeline, Kandinsky5Transformer3DModel
from diffusers.pipelines.kandinsky5.pipeline_kandinsky_t2i import prompt_clean

from difftune.families.common.conditioning import Conditioning, padded_token_ids, valid_token_states
from difftune.families.common.flow import FlowDrawing, FlowMatchingFamily
from difftune.families.common.layouts import DiffusersNamedLayout
from difftune.families.common.loading import FamilyOptions, Loading
from difftune.families.common.targets import AdapterTargets, targets_in_blocks
from difftune.models.autoencoders import LatentNormalization
from difftune.models.components import Components

# The pipeline's prompt template and the number of its tokens before the caption that it drops (`prompt_template`,
# `prompt_template_encode_start_idx`; tests/test_families.py checks them against it).
PROMPT_TEMPLATE = (
    "<|im_start|>system\nYou are a prompt engineer. Describe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>"
)
TEXT_TOKENS = 512  # the pipeline's default `max_sequence_length`: caption tokens read after the template's start
TEMPLATE_TOKENS = 40  # the pipeline's `prompt_template_encode_start_idx`: the system prompt's tokens, dropped
CLIP_TOKENS = 77
BLOCK_LISTS = ("text_transformer_blocks", "visual_transformer_blocks")
ATTENTION = ("to_query", "to_key", "to_value", "out_layer")
FEED_FORWARD = ["feed_forward.in_layer", "feed_forward.out_layer"]
# The layers musubi-tuner and ai-toolkit adapt: every block's attention and feed-forward layers.
BLOCK_TARGETS = {
    "text_transformer_blocks": [f"self_attention.{layer}" for layer in ATTENTION] + FEED_FORWARD,
    "visual_transformer_blocks": [
        f"{attention}.{layer}" for attention in ("self_attention", "cross_attention") for layer in ATTENTION
    ]
    + FEED_FORWARD,
}


class Kandinsky5Layout(DiffusersNamedLayout):
    """Kandinsky 5's files in other tools' layouts."""

    denoiser_file_key = "visual_transformer_blocks.0.cross_attention.to_query.weight"

    kohya_model_version = "kandinsky5"


class Kandinsky5Targets(AdapterTargets):
    lora_text_encoders = ()  # KandinskyLoraLoaderMixin reads the transformer's adapters alone
    default_targets = {"transformer": [target for targets in BLOCK_TARGETS.values() for target in targets]}

    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        """Each block's attention and feed-forward layers (the text blocks have no cross-attention), by name."""
        return targets_in_blocks(model, BLOCK_TARGETS)


class Kandinsky5Loading(Loading):
    single_file_pipeline = Loading.pipeline_around_denoiser_file


class Kandinsky5Drawing(FlowDrawing):
    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """Classifier-free guidance by the pipeline's own scale (above 1), with its negative prompt."""
        arguments = {"max_sequence_length": TEXT_TOKENS, "guidance_scale": guidance_scale}
        return arguments | ({"negative_prompt": negative_prompt or ""} if guidance_scale > 1 else {})

    def draw(self, pipeline, options, prompt, controls, height, width, **arguments) -> list:
        """At the size asked (the pipeline would snap it to the nearest of its own sizes)."""
        height, width = height or 1024, width or 1024
        pipeline.resolutions = [(width, height)]
        return pipeline(prompt=prompt, height=height, width=width, **arguments).image


class Kandinsky5Conditioning(Conditioning):
    padded_text_tokens = TEXT_TOKENS
    template_tokens = TEMPLATE_TOKENS  # its `prompt_template_encode_start_idx`

    def latent_normalization(self, vae) -> LatentNormalization:
        return LatentNormalization(scale=float(vae.config.scaling_factor))  # the pipeline decodes without a shift

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        """The templated captions' ids, padded with -1 (no token's id) to the most the pipeline reads; CLIP's as the
        pipeline pads them."""
        captions = [prompt_clean(caption) for caption in captions]
        tokenizer = tokenizers["tokenizer"]
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor's
        length = self.template_tokens + TEXT_TOKENS
        texts = [self.family.prompt_template.format(caption) for caption in captions]
        ids = padded_token_ids(tokenizer(texts, truncation=True, max_length=length)["input_ids"], length)
        clip_ids = tokenizers["tokenizer_2"](
            captions, max_length=CLIP_TOKENS, truncation=True, padding="max_length", return_tensors="pt"
        ).input_ids
        return {"text_encoder": ids, "text_encoder_2": clip_ids}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = token_ids["text_encoder"]
        mask = ids >= 0
        longest = int(mask.sum(dim=1).max())
        tokenizer = components.tokenizers["tokenizer"]
        pad = getattr(tokenizer, "tokenizer", tokenizer).pad_token_id
        states = components.text_encoders["text_encoder"](
            input_ids=ids[:, :longest].masked_fill(~mask[:, :longest], pad), output_hidden_states=True
        ).hidden_states[-1]
        pooled = components.text_encoders["text_encoder_2"](input_ids=token_ids["text_encoder_2"]).pooler_output
        return valid_token_states(states, mask[:, :longest], self.template_tokens, TEXT_TOKENS) | {
            "pooled_prompt_embeds": pooled
        }


class Kandinsky5(FlowMatchingFamily):
    name = "kandinsky5"
    layout = Kandinsky5Layout()
    loading = Kandinsky5Loading()
    conditioning = Kandinsky5Conditioning()
    drawing = Kandinsky5Drawing()
    targets = Kandinsky5Targets()
    description = "Kandinsky 5"
    pipeline_class = Kandinsky5T2IPipeline
    pipeline_classes = ("Kandinsky5T2IPipeline",)
    denoiser_class = Kandinsky5Transformer3DModel
    denoiser_name = "transformer"
    text_encoder_names = ("text_encoder", "text_encoder_2")
    tokenizer_names = ("tokenizer", "tokenizer_2")
    block_lists = BLOCK_LISTS
    options_model = FamilyOptions  # no guidance embedding: classifier-free guidance
    prompt_template = PROMPT_TEMPLATE  # the pipeline's `prompt_template`

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_visual_dim

    # Prompts and the transformer.

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """The batch in groups of one caption length each (the transformer takes no mask), each at its length; an
        image as a one-frame clip, channels last (and, for a transformer that reads a conditioning clip, `visual_cond`,
        an empty one beside it, as the text-to-video pipeline passes)."""
        states, pooled = conditioning["encoder_hidden_states"], conditioning["pooled_prompt_embeds"]
        lengths = conditioning["text_mask"].sum(dim=1).long()
        clips = noisy if noisy.dim() == 5 else noisy.unsqueeze(2)
        denoiser = components.denoiser
        latents = clips.permute(0, 2, 3, 4, 1).to(states.dtype)  # (B, t, h, w, C)
        if denoiser.visual_cond:
            latents = torch.cat([latents, torch.zeros_like(latents), torch.zeros_like(latents[..., :1])], dim=-1)
        patch = denoiser.config.patch_size
        t, h, w = clips.shape[2:]
        visual_positions = [torch.arange(size, device=noisy.device) for size in (t, h // patch[1], w // patch[2])]
        rope_scale = self.rope_scale(*(int(side) for side in geometry[0, 4:6]))  # the batch's size (one bucket)
        sparse_params = self.sparse_attention(denoiser, latents)  # by the clip's shape alone
        groups, predictions = [], []
        for length in sorted(set(lengths.tolist())):
            rows = (lengths == length).nonzero().flatten()
            text = states[rows, :length]
            predictions.append(
                denoiser(
                    hidden_states=latents[rows],
                    encoder_hidden_states=text,
                    timestep=timesteps[rows].to(states.dtype),
                    pooled_projections=pooled[rows],
                    visual_rope_pos=visual_positions,
                    text_rope_pos=torch.arange(text.shape[1], device=noisy.device),
                    scale_factor=rope_scale,
                    sparse_params=sparse_params,
                    return_dict=False,
                )  # the prediction itself, not a tuple
            )
            groups.append(rows)
        prediction = torch.cat(predictions)[torch.cat(groups).argsort()].permute(0, 4, 1, 2, 3)
        return prediction if noisy.dim() == 5 else prediction[:, :, 0]

    def rope_scale(self, height: int, width: int) -> tuple[float, float, float]:
        """The visual rotary embedding's scale at a size in pixels: none for images (the pipeline's)."""
        return (1.0, 1.0, 1.0)

    def sparse_attention(self, denoiser: torch.nn.Module, latents: torch.Tensor) -> dict | None:
        """The transformer's sparse attention settings for `latents`: none for the image models' regular attention."""
        return None

    # Sampling.

    def max_sequence_length(self, components: Components) -> int:
        return TEXT_TOKENS


FAMILY = Kandinsky5()
