"""FLUX.3 (`Flux3ModularPipeline`, a diffusers modular pipeline: modular.py): FLUX.3's transformer
(`Flux3Transformer2DModel`: per-mode blocks, the text's and the image's each attending within itself, then joint
single blocks over text and image) over FLUX.2's autoencoder, conditioned on a Qwen3-VL language model
(`Qwen3VLForConditionalGeneration`). Trained by flow matching (flow.py).

- Latents: FLUX.2's autoencoder's, patched 2x2 into 128 channels and batch-normalised (autoencoders.py), each latent
  pixel one token, as the pipeline's VAE steps make them; the image's position ids are its rows and columns scaled by
  `IMAGE_ROPE_SCALE`, the text's run along the fourth axis (the pipeline's own helpers).
- Text, exactly as `Flux3TextEncoderStep` encodes a prompt: the caption as one user turn of the processor's chat
  template (with the generation prompt), right-padded to a multiple of `PAD_MULTIPLE` tokens, its padding masked
  in the language model with position id 1 (the pipeline's fix for transformers 5), the states of `TEXT_LAYERS`
  stacked along the width. The transformer reads every position of a caption's window, padding included, and takes
  no mask: captions of different windows in a batch are denoised group by group, each at its own window, as the
  pipeline (one prompt a call) reads it. A caption's templated tokens past `MAX_TEXT_TOKENS` are cut before the
  template's end (the pipeline reads 8192; the other families cut at 512).
- Time: the transformer reads sigma (the scheduler's timestep / 1000); the pipeline samples with a constant shift
  (its scheduler's 6.93, what `loss.flow_shift_by_resolution` draws with at every size) and classifier-free guidance
  (its guider). The step-distilled base (`Flux3DistilledModularPipeline`, a flow map reading a target timestep) is not
  trained: its pipeline class is no family's.
- References (the image-conditioned mode): an edit pair's control images, in order, each encoded as the pipeline's
  VAE step encodes a reference (the posterior's mode, patched and batch-normalised as the image's latents) and read as
  clean tokens (`image_cond_hidden_states`) whose position ids carry the reference's number on the fourth axis (-1,
  -2, ...; `Flux3PrepareImageCondLatentsStep`). The transformer runs them through its `image_cond` per-mode blocks
  and joins them to the joint blocks; it predicts the image's tokens alone. A control trains at its target's area,
  its aspect kept, on the 16 px grid and at least 64 px a side (conditioning.py's `reference_dimensions`, Z-Image
  Omni's way), and samples are drawn so: the control resized so, which the pipeline's image step then keeps as it
  is (it pads a smaller one to 64 px, and scales one down only past 1 or 4 megapixels). The `image_cond`
  blocks are left out of the adapter's targets (a text-to-image run never runs them; Z-Image Omni's SigLIP refiner
  is left so too): an edit LoRA adapts the image's and the joint blocks, which read the references. Pairs and
  captioned images may share a run, each batch of one kind.
- Files: diffusers' layout (`transformer.`, which `Flux3ModularPipeline.load_lora_weights` reads: transformer
  adapters alone). BFL's original model renames modules one for one (`content_mode_blocks.image.0.q_proj`,
  `single_blocks.0.mlp_in`): the kohya / ComfyUI layout names them so, and a single file is the transformer alone in
  that layout (diffusers' `convert_flux3_transformer_checkpoint_to_diffusers` reads it back).
"""

from __future__ import annotations

import re

import torch
from diffusers import Flux3ModularPipeline, Flux3Transformer2DModel
from diffusers.loaders.single_file_utils import convert_flux3_transformer_checkpoint_to_diffusers
from transformers import Qwen3VLProcessor

from difftune.families.common.conditioning import ReferenceSizedConditioning, padded_token_ids
from difftune.families.common.drawing import ReferenceSizedDrawing
from difftune.families.common.flow import FlowDrawing, FlowMatchingFamily
from difftune.families.common.layouts import RenamedLayout, swap_halves
from difftune.families.common.loading import FamilyOptions
from difftune.families.common.modular import ModularDrawing, ModularLoading
from difftune.families.common.targets import AdapterTargets, targets_in_blocks
from difftune.models.components import Components
from difftune.models.processors import load_without_video_processor

PAD_MULTIPLE = 80  # `Flux3TextEncoderStep`'s: a caption's window is its tokens rounded up to a multiple of this
MAX_TEXT_TOKENS = 7 * PAD_MULTIPLE  # templated tokens a caption is read with at most: 512 of text and the template
TEXT_LAYERS = (4, 8, 12, 16, 20, 24, 28, 32)  # the pipeline's default `text_encoder_out_layers`
IMAGE_ROPE_SCALE = 0.5  # `Flux3PrepareLatentsStep`'s: the image's rows and columns as its position ids see them
CAPTION = "\0"  # where the caption goes in the chat template, to find the template's two ends
# The blocks a text-to-image run runs, by list: the text's and the image's per-mode blocks, then the joint ones (the
# reference images' `mode_blocks.image_cond` run only in the image-conditioned mode).
TRAINED_BLOCK_LISTS = ("txt_mode_blocks", "mode_blocks.image", "single_transformer_blocks")
BLOCK_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.linear_in", "ff.linear_out"]
# The original (BFL) model's names: block lists, layers in a block, and the layers outside the blocks.
ORIGINAL_BLOCK_LISTS = {
    "mode_blocks.image": "content_mode_blocks.image",
    "mode_blocks.image_cond": "content_mode_blocks.image_cond",
    "txt_mode_blocks": "txt_mode_blocks",
    "single_transformer_blocks": "single_blocks",
}
ORIGINAL_IN_BLOCK = {
    "attn.to_q": "q_proj",
    "attn.to_k": "k_proj",
    "attn.to_v": "v_proj",
    "attn.to_out.0": "attn_out",
    "ff.linear_in": "mlp_in",
    "ff.linear_out": "mlp_out",
}
ORIGINAL_NORMS = {"attn.norm_q.weight": "norm.query_norm.scale", "attn.norm_k.weight": "norm.key_norm.scale"}
ORIGINAL_GLOBALS = {
    "x_embedders.image": "emb_in.image",
    "x_embedders.image_cond": "emb_in.image_cond",
    "context_embedder": "txt_in",
    "timestep_embedder.linear_1": "time_in.in_layer",
    "timestep_embedder.linear_2": "time_in.out_layer",
    "proj_out": "final_layer.image.linear",
    **{
        f"{stream}_stream_modulations.{mode}.linear": f"{stream}_stream_modulations.{mode}.lin"
        for stream in ("early", "single")
        for mode in ("image", "image_cond", "txt")
    },
}
# The final modulation holds (shift, scale) in the original model, (scale, shift) in diffusers': adapters leave it.
SWAPPED_FINAL_MODULATION = ("norm_out.linear", "final_layer.image.adaLN_modulation.1")
BLOCK = re.compile(r"^(mode_blocks\.\w+|txt_mode_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")

load_without_video_processor(Qwen3VLProcessor)


def original_name(module: str) -> str | None:
    """A transformer module's name in the original model (None: no adaptable counterpart there)."""
    if match := BLOCK.match(module):
        blocks, index, member = match.groups()
        if member in ORIGINAL_IN_BLOCK:
            return f"{ORIGINAL_BLOCK_LISTS[blocks]}.{index}.{ORIGINAL_IN_BLOCK[member]}"
        return None
    return ORIGINAL_GLOBALS.get(module)


def original_weight(key: str, value: torch.Tensor) -> tuple[str, torch.Tensor]:
    """A transformer weight's name (and value) in the original model's single files."""
    module, parameter = key.rsplit(".", 1)
    if module == SWAPPED_FINAL_MODULATION[0]:
        return f"{SWAPPED_FINAL_MODULATION[1]}.{parameter}", swap_halves(value)
    if match := BLOCK.match(key):
        blocks, index, member = match.groups()
        if member in ORIGINAL_NORMS:
            return f"{ORIGINAL_BLOCK_LISTS[blocks]}.{index}.{ORIGINAL_NORMS[member]}", value
    return f"{original_name(module)}.{parameter}", value


def position_ids(
    positions: torch.Tensor, width: int | None = None, scale: float = 1.0, reference: int = 0
) -> torch.Tensor:
    """4-D position ids (time, row, column, text position) as the pipeline's helpers make them: an image's token
    `positions` in raster order on a grid `width` wide, its rows and columns times `scale`
    (`Flux3PrepareLatentsStep`), and the k-th reference's (`reference` k, from 1) with -k on the fourth axis
    (`Flux3PrepareImageCondLatentsStep`); without `width`, a text's positions along the fourth axis
    (`Flux3TextRoPEInputsStep`)."""
    ids = torch.zeros(len(positions), 4, device=positions.device)
    if width is None:
        ids[:, 3] = positions
    else:
        ids[:, 1], ids[:, 2], ids[:, 3] = positions // width * scale, positions % width * scale, -reference
    return ids


def reference_tokens(references: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The references' latents (each (B, C, h, w)) as the transformer reads them: their tokens one after the other
    (B, sum of h x w, C) and their position ids."""
    tokens = torch.cat([latents.flatten(2).transpose(1, 2) for latents in references], dim=1)
    ids = [
        position_ids(torch.arange(h * w, device=latents.device), w, IMAGE_ROPE_SCALE, number)
        for number, latents in enumerate(references, 1)
        for h, w in [latents.shape[-2:]]
    ]
    return tokens, torch.cat(ids)


def template_ends(processor) -> tuple[str, str]:
    """The chat template's text before and after a caption (one user turn, with the generation prompt)."""
    text = processor.apply_chat_template(
        [{"role": "user", "content": CAPTION}], tokenize=False, add_generation_prompt=True
    )
    before, after = text.split(CAPTION)
    return before, after


class Flux3Layout(RenamedLayout):
    """FLUX.3's files in other tools' layouts."""

    single_file_layout = "transformer alone (BFL layout)"

    denoiser_file_key = "early_stream_modulations.image.lin.weight"  # what diffusers' reader detects FLUX.3 files by

    kohya_prefixes = {"transformer": "lora_unet_"}

    kohya_text_model_parts = ()

    kohya_model_version = "flux3"

    kohya_layout_name = "FLUX.3"

    def original_name(self, module: str) -> str | None:
        return original_name(module)

    def diffusers_names(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.denoiser_file_key not in weights:
            return weights
        return convert_flux3_transformer_checkpoint_to_diffusers(dict(weights))

    def to_single_file(self, components: Components) -> dict[str, torch.Tensor]:
        return dict(original_weight(key, value.contiguous()) for key, value in components.denoiser.state_dict().items())


class Flux3Targets(AdapterTargets):
    lora_text_encoders = ()  # Flux3LoraLoaderMixin reads the transformer's adapters alone
    default_targets = {"transformer": BLOCK_TARGETS}

    def targets_of(self, part: str, model: torch.nn.Module) -> list[str]:
        """Each trained block's attention and feed-forward layers, by name (the reference images' blocks have the
        same layers, and no text-to-image step runs them)."""
        return targets_in_blocks(model, dict.fromkeys(TRAINED_BLOCK_LISTS, BLOCK_TARGETS))


class Flux3Loading(ModularLoading):
    left_out_steps = ("prompt_upsampler",)  # captions are trained as written, so samples are drawn so too


class Flux3Drawing(ReferenceSizedDrawing, ModularDrawing, FlowDrawing):
    pass


class Flux3Conditioning(ReferenceSizedConditioning):
    padded_text_tokens = MAX_TEXT_TOKENS

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        """Each caption's ids in the chat template, right-padded with -1 (no token's id) to `MAX_TEXT_TOKENS`."""
        processor = tokenizers["tokenizer"]
        before, after = template_ends(processor)
        suffix = len(processor.tokenizer(after)["input_ids"])
        token_lists = []
        for caption in captions:
            tokens = processor.tokenizer(before + caption + after)["input_ids"]
            if len(tokens) > MAX_TEXT_TOKENS:
                tokens = tokens[: MAX_TEXT_TOKENS - suffix] + tokens[-suffix:]
            token_lists.append(tokens)
        return {"text_encoder": padded_token_ids(token_lists, MAX_TEXT_TOKENS)}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each caption's states over its window (`text_mask`), zero past it: the batch is read at its widest
        window, the padding masked as the pipeline masks it, so a caption's window holds what the pipeline reads."""
        ids = token_ids["text_encoder"]
        tokens = ids >= 0
        windows = (tokens.sum(dim=1) + PAD_MULTIPLE - 1) // PAD_MULTIPLE * PAD_MULTIPLE
        widest = int(windows.max())
        ids, tokens = ids[:, :widest], tokens[:, :widest]
        positions = torch.arange(widest, device=ids.device).expand_as(ids).masked_fill(~tokens, 1)
        pad = components.tokenizers["tokenizer"].tokenizer.pad_token_id
        hidden = components.text_encoders["text_encoder"](
            input_ids=ids.masked_fill(~tokens, pad),
            attention_mask=tokens.long(),
            position_ids=positions,
            output_hidden_states=True,
            use_cache=False,
        ).hidden_states
        states = torch.stack([hidden[layer] for layer in TEXT_LAYERS], dim=2).flatten(2)  # (B, L, layers x D)
        window = torch.arange(widest, device=ids.device) < windows[:, None]
        states = states * window[..., None]
        padding = MAX_TEXT_TOKENS - widest
        return {
            "encoder_hidden_states": torch.nn.functional.pad(states, (0, 0, 0, padding)),
            "text_mask": torch.nn.functional.pad(window.long(), (0, padding)),
        }


class Flux3(FlowMatchingFamily):
    name = "flux3"
    layout = Flux3Layout()
    loading = Flux3Loading()
    conditioning = Flux3Conditioning()
    drawing = Flux3Drawing()
    targets = Flux3Targets()
    description = "FLUX.3"
    pipeline_class = Flux3ModularPipeline
    pipeline_classes = ("Flux3ModularPipeline",)
    denoiser_class = Flux3Transformer2DModel
    denoiser_name = "transformer"
    patch_size = 1  # a token is one (patched) latent pixel
    block_lists = TRAINED_BLOCK_LISTS
    options_model = FamilyOptions  # no guidance embedding: classifier-free guidance
    # The pipeline takes any number of references; each adds its tokens to every joint block. Three, as
    # Qwen-Image-Edit-Plus and Z-Image Omni read.
    max_controls = 3

    def monitored_blocks(self, denoiser: torch.nn.Module) -> dict[str, torch.nn.Module]:
        return {
            f"{blocks}.{index}": block
            for blocks in TRAINED_BLOCK_LISTS
            for index, block in enumerate(denoiser.get_submodule(blocks))
        }

    # Prompts and the transformer.

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_channels  # the autoencoder's latents are patched already: one token a latent pixel

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """The batch in groups of one text window each (the transformer takes no mask, so a caption's padding is
        part of its conditioning), each group at its window; the predictions back in the batch's order."""
        states = conditioning["encoder_hidden_states"]
        windows = conditioning["text_mask"].sum(dim=1).long()
        b, c, h, w = noisy.shape
        tokens = noisy.flatten(2).transpose(1, 2).to(states.dtype)
        image_ids = position_ids(torch.arange(h * w, device=noisy.device), w, IMAGE_ROPE_SCALE)
        sigmas = (timesteps / 1000).to(states.dtype)
        controls = conditioning.get("control_latents")  # an edit pair's: its references, read clean
        references, reference_ids = reference_tokens(controls) if controls else (None, None)
        references = None if references is None else references.to(states.dtype)
        groups, predictions = [], []
        for window in sorted(set(windows.tolist())):
            rows = (windows == window).nonzero().flatten()
            text = states[rows, :window]
            predictions.append(
                components.denoiser(
                    hidden_states=tokens[rows],
                    encoder_hidden_states=text,
                    timestep=sigmas[rows],
                    img_ids=image_ids,
                    txt_ids=position_ids(torch.arange(window, device=noisy.device)),
                    image_cond_hidden_states=None if references is None else references[rows],
                    image_cond_ids=reference_ids,
                    return_dict=False,
                )[0]
            )
            groups.append(rows)
        prediction = torch.cat(predictions)[torch.cat(groups).argsort()]
        return prediction.transpose(1, 2).reshape(b, c, h, w)

    def max_sequence_length(self, components: Components) -> int:
        return MAX_TEXT_TOKENS


FAMILY = Flux3()
