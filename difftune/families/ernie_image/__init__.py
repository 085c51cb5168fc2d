"""ERNIE-Image (`ErnieImagePipeline`): Baidu's single-stream transformer (`ErnieImageTransformer2DModel`, image tokens
then text tokens in one sequence, one shared AdaLN modulation) over FLUX.2's autoencoder, conditioned on a Ministral 3
language model (`Mistral3Model`). Trained by flow matching (flow.py); ERNIE-Image-Turbo is the same family.

- Text, exactly as `ErnieImagePipeline.encode_prompt`: each caption tokenized on its own (the tokenizer's special
  tokens, Ministral's `<s>`), no template, the language model run on it alone (no padding, no mask), and its
  second-to-last hidden state kept at every token. Captions are read up to `TEXT_TOKENS` (the pipeline reads a caption
  whole; one past 512 tokens is cut here, as the other families' are). The transformer reads the batch padded to its
  longest caption with the lengths (`text_lens`), which mask the padding and place the image after the text.
- Latents: FLUX.2's autoencoder, patched 2x2 into 128 channels and batch-normalised (autoencoders.py), each latent
  pixel one token. The pipeline un-normalises with an epsilon of 1e-5, the value the autoencoder was trained with,
  whatever its config says (`batch_norm_eps`, 1e-4 in FLUX.2's); `latent_normalization` uses the pipeline's.
- Time: the transformer reads the scheduler's timestep (0-1000) and predicts noise minus image, as FLUX.1 does. The
  pipeline samples one shift at every size (its sigmas handed to the scheduler, which shifts them by its `shift`);
  `loss.flow_shift_by_resolution` draws training's noise levels with that shift.
- The prompt enhancer (`pe`, a second Ministral 3 that rewrites prompts by sampling) is never loaded: training reads
  the captions as written, and drawing passes `use_pe=False` so that a sample is the prompt's, and repeatable.
- Files: diffusers' layout (`transformer.`, which `ErnieImagePipeline.load_lora_weights` reads: transformer adapters
  alone). ERNIE-Image's own module names are diffusers' (its loader only renames the `diffusion_model.` prefix of
  ai-toolkit's files), so the kohya layout is `lora_unet_<module with _>`, and a single file is the transformer alone
  under those names (`diffusion_models/ernie-image*.safetensors`, as ComfyUI ships it; its model, comfy/ldm/ernie,
  names every weight so).
"""

from __future__ import annotations

import torch
from diffusers import ErnieImagePipeline, ErnieImageTransformer2DModel

from difftune.families.common.conditioning import Conditioning, padded_token_ids, valid_token_states
from difftune.families.common.flow import FlowDrawing, FlowMatchingFamily
from difftune.families.common.layouts import DiffusersNamedLayout
from difftune.families.common.loading import FamilyOptions, Loading
from difftune.families.common.targets import AdapterTargets
from difftune.models.autoencoders import LatentNormalization, latent_normalization
from difftune.models.components import Components

TEXT_TOKENS = 512  # tokens of a caption read at most
TRAINED_BATCH_NORM_EPS = 1e-5  # what `ErnieImagePipeline` un-normalises latents with (see the module's docstring)
# Every block's attention and its gated MLP: the projections ai-toolkit's and DiffSynth-Studio's LoRAs adapt.
TRANSFORMER_TARGETS = [
    "self_attention.to_q",
    "self_attention.to_k",
    "self_attention.to_v",
    "self_attention.to_out.0",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.linear_fc2",
]


class ErnieImageLayout(DiffusersNamedLayout):
    """ERNIE-Image's files in other tools' layouts: its original names are diffusers'."""

    denoiser_file_key = "layers.0.self_attention.to_q.weight"  # a key every ERNIE-Image transformer file has

    kohya_model_version = "ernie_image"


class ErnieImageTargets(AdapterTargets):
    default_targets = {"transformer": TRANSFORMER_TARGETS}
    lora_text_encoders = ()  # ErnieImagePipeline's LoRA loader reads the transformer's adapters alone


class ErnieImageLoading(Loading):
    single_file_pipeline = Loading.pipeline_around_denoiser_file


class ErnieImageDrawing(FlowDrawing):
    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """Classifier-free guidance above 1 (the pipeline's `guidance_scale`, with its negative prompt), the prompt
        enhancer off (see the module's docstring)."""
        return {"guidance_scale": guidance_scale, "negative_prompt": negative_prompt or "", "use_pe": False}


class ErnieImageConditioning(Conditioning):
    padded_text_tokens = TEXT_TOKENS

    def latent_normalization(self, vae) -> LatentNormalization:
        return latent_normalization(vae, batch_norm_eps=TRAINED_BATCH_NORM_EPS)

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        """Each caption's ids as the pipeline makes them (an empty caption: the `<s>` it reads instead), padded to
        `TEXT_TOKENS` with -1, which no token has, so that the cache key and the lengths need no pad token."""
        tokenizer = tokenizers["tokenizer"]
        token_lists = []
        for caption in captions:
            tokens = tokenizer(caption, add_special_tokens=True, truncation=True, padding=False)["input_ids"]
            token_lists.append(
                (tokens or [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0])[:TEXT_TOKENS]
            )
        return {"text_encoder": padded_token_ids(token_lists, TEXT_TOKENS)}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One caption at a time, unpadded, as the pipeline runs its language model (bit for bit the same)."""
        ids = token_ids["text_encoder"]
        mask = ids >= 0
        encoder = components.text_encoders["text_encoder"]
        states = [encoder(input_ids=row[row >= 0][None], output_hidden_states=True).hidden_states[-2][0] for row in ids]
        longest = int(mask.sum(dim=1).max())
        padded = torch.stack([torch.nn.functional.pad(s, (0, 0, 0, longest - len(s))) for s in states])
        return valid_token_states(padded, mask[:, :longest], 0, TEXT_TOKENS)


class ErnieImage(FlowMatchingFamily):
    name = "ernie_image"
    layout = ErnieImageLayout()
    loading = ErnieImageLoading()
    conditioning = ErnieImageConditioning()
    drawing = ErnieImageDrawing()
    targets = ErnieImageTargets()
    description = "ERNIE-Image"
    pipeline_class = ErnieImagePipeline
    pipeline_classes = ("ErnieImagePipeline",)
    denoiser_class = ErnieImageTransformer2DModel
    denoiser_name = "transformer"
    block_lists = ("layers",)
    patch_size = 1  # a token is one (patched) latent pixel
    options_model = FamilyOptions  # no guidance embedding
    # The prompt enhancer and its tokenizer: left out whenever a pipeline is loaded (None is what the pipeline takes
    # for "none"), so a 3B model is never read for a run that does not use it.
    fixed_pipeline_arguments = {"pe": None, "pe_tokenizer": None}

    # Prompts and the transformer.

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.in_channels  # the autoencoder's latents are patched already: one token a latent pixel

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        lengths = conditioning["text_mask"].sum(dim=1)
        states = conditioning["encoder_hidden_states"][:, : int(lengths.max())]
        return components.denoiser(
            hidden_states=noisy.to(states.dtype),
            timestep=timesteps.to(states.dtype),
            text_bth=states,
            text_lens=lengths.to(noisy.device),
            return_dict=False,
        )[0]

    # Sampling.

    def max_sequence_length(self, components: Components) -> int:
        return TEXT_TOKENS


FAMILY = ErnieImage()
