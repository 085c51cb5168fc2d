"""A family's conditioning, a role it holds (`family.conditioning`): what the denoiser reads besides the noisy
latents, from captions, control images and the sample's own pixels, and how the text cache keeps it.

Tokenizing runs in the data loader's workers (it takes the tokenizers alone); encoding runs where the encoders are;
the text cache stores what `cached_conditioning` keeps and training reads back what `uncached_conditioning` restores.
Edit pairs' controls and video clips are checked and cut here too. The facts it reads are the family's
(`text_encoder_names`, `max_controls`, `reads_clips`, `description`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from difftune.config import DataConfig
from difftune.data.cache import model_identity
from difftune.data.clips import FrameWindows
from difftune.data.sound_files import SoundWindows
from difftune.errors import DifftuneError
from difftune.families.common.loading import FamilyOptions
from difftune.families.common.role import Role
from difftune.models.autoencoders import LatentNormalization, clip_lengths, latent_normalization
from difftune.models.components import Components, tokenize

NO_TOKEN = -1  # what padded ids hold where a caption has no token: no token's id, so masks and cache keys need no pad


def padded_token_ids(token_lists: list[list[int]], length: int, left: bool = False) -> torch.Tensor:
    """Captions' token ids (each list at most `length` long) as one (B, length) tensor, padded with `NO_TOKEN` on the
    right, or on the `left`."""
    ids = torch.full((len(token_lists), length), NO_TOKEN, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        where = slice(length - len(tokens), None) if left else slice(None, len(tokens))
        ids[i, where] = torch.as_tensor(tokens, dtype=torch.long)
    return ids


def valid_token_states(states: torch.Tensor, mask: torch.Tensor, skip: int, length: int) -> dict[str, torch.Tensor]:
    """A language model's states (B, L, D) kept at each caption's valid tokens (`mask`, (B, L)) after its first
    `skip` (a template's), at most `length` of them, zero-padded to `length`; with the mask of those kept."""
    kept_states = states.new_zeros(len(states), length, states.shape[-1])
    text_mask = torch.zeros(len(states), length, dtype=torch.long, device=states.device)
    for i in range(len(states)):
        kept = states[i][mask[i]][skip:][:length]
        kept_states[i, : len(kept)] = kept
        text_mask[i, : len(kept)] = 1
    return {"encoder_hidden_states": kept_states, "text_mask": text_mask}


# The conditioning `valid_token_states` makes, with a token axis that `padded_text_tokens` pads.
PER_TOKEN = ("encoder_hidden_states", "text_mask")


def trimmed(conditioning: dict[str, torch.Tensor], mask: str = "text_mask") -> dict[str, torch.Tensor]:
    """One caption's `valid_token_states` without the padding past its text (its `mask`), as the text cache stores
    it: at full length (512 x 3584 fp32 for Qwen-Image) an entry is 7 MB, a short caption's ~0.3 MB."""
    valid = int(conditioning[mask].sum())
    return {name: tensor[:valid] for name, tensor in conditioning.items()}


def padded(stored: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """Inverse of `trimmed`."""
    return {
        name: F.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, length - len(tensor))) for name, tensor in stored.items()
    }


def processed_frames(processor, frames: torch.Tensor, encoder: torch.nn.Module, **options) -> torch.Tensor:
    """First frames (B, 3, H, W) in [-1, 1] as an image-to-video pipeline's image processor reads the image it is
    given: as 8-bit pixels (`options`: the pipeline's call's), in `encoder`'s device and dtype. On the meta device (the
    memory plan's), zeros of the processed size: the processor reads no meta tensor, and only the shape counts."""
    weight = next(encoder.parameters())
    if frames.is_meta:
        size = processor.crop_size if getattr(processor, "do_center_crop", False) else processor.size
        return torch.zeros(len(frames), 3, size["height"], size["width"], device=weight.device, dtype=weight.dtype)
    eight_bit = ((frames.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    images = list(eight_bit.permute(0, 2, 3, 1).cpu().numpy())
    return processor(images=images, return_tensors="pt", **options).pixel_values.to(weight.device, weight.dtype)


def first_frame(pixels: torch.Tensor) -> torch.Tensor:
    """A training view's first frame (an image is its own), as a one-frame clip (B, 3, 1, H, W): the image an
    image-to-video base animates."""
    return (pixels if pixels.dim() == 5 else pixels[:, :, None])[:, :, :1]


def first_frame_clip(components: Components, clip: torch.Tensor, first_frame_latents: torch.Tensor) -> torch.Tensor:
    """A clip of zeros shaped as the noisy `clip` (B, C, t, h, w) whose first latent frame is the image's latents
    (unnormalised, as the cache keeps them), normalised as the clip's: what HunyuanVideo 1.5's and SkyReels'
    image-to-video pipelines give their transformers beside the noisy clip."""
    condition = torch.zeros_like(clip)
    condition[:, :, :1] = components.latent_normalization.apply(first_frame_latents.float())
    return condition


# The edit pipelines that keep a reference at its own size (Z-Image Omni's, FLUX.3's and FLUX.2's) take sides in
# multiples of 16 (the autoencoder's 8x times the transformer's 2x2 patches: what they crop or pad a reference to) and
# at least 64 px (Z-Image Omni's and FLUX.2's refuse less; FLUX.3's pads to it).
REFERENCE_GRID = 16
SHORTEST_REFERENCE_SIDE = 64


def reference_dimensions(area: int, size: tuple[int, int], most: int | None = None) -> tuple[int, int]:
    """(width, height) of a `size` reference at about `area` pixels (at most `most`, where the pipeline scales a
    larger one down), aspect kept, on `REFERENCE_GRID` and at least `SHORTEST_REFERENCE_SIDE` a side: a size those
    pipelines keep as it is."""
    ratio = size[0] / size[1]
    area = max(area, SHORTEST_REFERENCE_SIDE**2 * max(ratio, 1 / ratio))
    if most is not None:
        area = min(area, most)

    def sides(to_grid) -> tuple[int, int]:
        return tuple(
            max(SHORTEST_REFERENCE_SIDE, to_grid(math.sqrt(area * r) / REFERENCE_GRID) * REFERENCE_GRID)
            for r in (ratio, 1 / ratio)
        )

    nearest = sides(round)
    return nearest if most is None or nearest[0] * nearest[1] <= most else sides(math.floor)


class Conditioning(Role):
    # Where its text states are a language model's at each caption's tokens, zero-padded to this length with their
    # `text_mask` (`valid_token_states`): the text cache keeps the caption's tokens alone and pads them back. None:
    # stored as encoded.
    padded_text_tokens: int | None = None
    prompts_see_controls = False  # its text encoder reads an edit pair's controls (`tokenize` takes them)
    # Text encoders that read an edit pair's references, not tokens (Z-Image Omni's SigLIP2): no vocabulary, so not in
    # `encoder_tokenizers` (textual inversion and embeddings leave them)
    reference_encoder_names: tuple[str, ...] = ()
    # Its samples are an image and its layers (Qwen-Image-Layered): the data's `stem_1.png`... beside `stem.png` are
    # that image's layers (`scan_examples`' `layers`), held as its controls
    trains_layers = False
    # `pixel_conditioning` reads the views' masks where the data gives them (`data.masks`; an inpainting base's
    # subject): they are cached with what it makes, and key its cache entries
    reads_masks = False

    def data_settings(self, data: DataConfig) -> DataConfig:
        """The data settings a run of this family reads its data with: `data`, unless the family needs one of them
        (the resolved config records what was used)."""
        return data

    def planned_controls(self, components: Components, latents: torch.Tensor) -> list[torch.Tensor]:
        """The controls' latents the memory plan gives a step of `latents` (training.plan): as many as an edit pair
        may have (`max_controls`, each at the target's size: a plan holds for the largest step the data can make);
        none for a text-to-image family. A layered base plans its layers (`model.family_options.layers`)."""
        return [latents] * self.family.max_controls

    def trained_latents(self, latents: torch.Tensor, conditioning: dict) -> torch.Tensor:
        """What training noises and predicts for samples whose image latents are `latents` (B, C, ...), beside their
        `conditioning` (the text's, and an edit pair's `control_latents`): `latents`, unless the family trains more
        than the image (Qwen-Image-Layered: its layers, which it takes out of the conditioning)."""
        return latents

    def check_controls(self, examples: list, key: str) -> None:
        """Refuse a data set whose pairs have more control images than this family reads (a `DifftuneError` naming
        one such image): a text-to-image base would train as if the controls were not there."""
        over = next((e for e in examples if len(e.control_paths) > self.family.max_controls), None)
        if over is None:
            return
        if not self.family.max_controls:
            raise DifftuneError(
                f"{key}: {over.path.name} has control images ({', '.join(str(c) for c in over.control_paths)}), "
                f"but {self.family.description} bases edit no image; train an edit base (FLUX.1 "
                "Kontext, Qwen-Image-Edit) on pairs, or move the control folder away"
            )
        family = self.family
        raise DifftuneError(
            f"{key}: {over.path.name} has {len(over.control_paths)} control images; {family.description} bases read "
            f"at most {family.max_controls}"
        )

    def frame_windows(self, data, components: Components) -> FrameWindows | SoundWindows | None:
        """How this family's data cuts clips into windows (`data`'s frame settings, lengths the base's autoencoder
        takes); None for an image family, whose data leaves clips out and reports them. A sound family's cuts sounds
        (`SoundWindows`)."""
        return FrameWindows.of(data, clip_lengths(components.vae)) if self.family.reads_clips else None

    def control_size(
        self, target_size: tuple[int, int], control_size: tuple[int, int], options: FamilyOptions | None = None
    ) -> tuple[int, int]:
        """The (width, height) a control image of `control_size` trains at beside a target trained at `target_size`
        (under the base's `options`): the target's (as diffusers' Kontext training script pairs them), unless the
        family says otherwise."""
        return target_size

    def pixel_conditioning(self, components: Components, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the denoiser reads of a sample's own pixels (B, 3, [T,] H, W) besides its latents, by name (an
        image-to-video base's first frame, encoded as its pipeline encodes the image it animates): computed from the
        training view with the frozen autoencoder, cached beside its posterior, joined to the text conditioning.
        Nothing, for a base that reads text alone."""
        return {}

    def text_kept(self, components: Components) -> str:
        """What `encode_prompts` keeps beyond what every run of the family reads, as part of the text cache's key:
        nothing, unless the family's options add some (LTX-2's sound: the audio stream's caption states)."""
        return ""

    def trains_sound(self, components: Components) -> bool:
        """Whether the run trains its clips' sound beside their frames (an audio-video base asked to: LTX-2's
        `model.family_options.sound`), which `sound_conditioning` then encodes into the latent cache."""
        return False

    def sound_conditioning(self, components: Components, clips: list[tuple[Path, tuple[int, int] | None]]) -> dict:
        """What the denoiser reads of each clip window's sound (`clips`: (path, window)), by name, cached beside its
        posterior and joined to the text conditioning as `pixel_conditioning`'s is; for a family that `trains_sound`."""
        raise NotImplementedError

    def latent_identity(self, components: Components) -> str:
        """What every latent cache entry depends on besides its pixels: the autoencoder's weights and config, and where
        the family conditions on a sample's own pixels (`pixel_conditioning`), the family and its pixel encoders too:
        an image-to-video entry holds more than a text-to-video one of the same autoencoder (Wan 2.2's share it)."""
        identity = model_identity(components.vae)
        if type(self).pixel_conditioning is Conditioning.pixel_conditioning:
            return identity
        return "+".join([identity, self.family.name, *map(model_identity, components.pixel_encoders.values())])

    def tokenizer(self, components: Components) -> Callable[..., dict[str, torch.Tensor]]:
        """`tokenize` over the base's tokenizers, as this run calls it (picklable, for data-loader workers): captions
        [and their controls] -> token ids. A family whose prompts also say something of the run (ACE-Step's: the
        length of its sounds) binds it here."""
        return partial(self.tokenize, components.tokenizers)

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        """Captions -> token ids per text encoder (name -> (B, L)), padded and truncated as its pipeline does; where
        `prompts_see_controls`, each caption's control images (a list of PIL images each) join them. Takes the
        tokenizers alone: data-loader workers call it."""
        return {encoder: tokenize(tokenizers[tokenizer], captions) for encoder, tokenizer in self.encoder_tokenizers()}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Token ids (on the encoders' device) -> the denoiser's text conditioning, by name; each tensor has the
        batch first. This is what the text cache stores."""
        raise NotImplementedError

    @torch.no_grad()
    def encoded_texts(self, components: Components, texts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        """Prompts the run writes itself (a slider's, a reward run's) tokenized and encoded at once, without
        gradients: their conditioning on `device`, the text encoders already there."""
        token_ids = self.tokenizer(components)(texts)
        encoded = self.encode_prompts(components, {name: value.to(device) for name, value in token_ids.items()})
        return {name: value.to(device) for name, value in encoded.items()}

    def cached_conditioning(self, conditioning: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One caption's conditioning (no batch axis) as the text cache stores it: as it is, unless the family can
        drop what `uncached_conditioning` restores (padding: `padded_text_tokens`, in the states with a token axis;
        a pooled embedding beside them is stored whole)."""
        if not self.padded_text_tokens:
            return conditioning
        return conditioning | trimmed({name: conditioning[name] for name in PER_TOKEN if name in conditioning})

    def uncached_conditioning(self, stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Inverse of `cached_conditioning`: a stored entry as `encode_prompts` made it."""
        if not self.padded_text_tokens:
            return stored
        return stored | padded({name: stored[name] for name in PER_TOKEN if name in stored}, self.padded_text_tokens)

    def latent_normalization(self, vae) -> LatentNormalization:
        """How latents are normalised for the denoiser: as the autoencoder asks (autoencoders.py), unless the family's
        pipeline reads them otherwise."""
        return latent_normalization(vae)

    def encoder_tokenizers(self) -> list[tuple[str, str]]:
        """(text encoder, its tokenizer) names, in order."""
        return list(zip(self.family.text_encoder_names, self.family.tokenizer_names, strict=True))


class ReferenceSizedConditioning(Conditioning):
    """A text-to-image base that also edits from references its pipeline keeps at their own size (FLUX.3, FLUX.2,
    Z-Image Omni): each reference trains at its target's area, its own aspect kept (`reference_dimensions`, up to
    `largest_reference` pixels), as `ReferenceSizedDrawing` draws them."""

    largest_reference: int | None = None  # pixels past which the pipeline scales a reference down (None: no limit)

    def control_size(self, target_size, control_size, options=None):
        return reference_dimensions(target_size[0] * target_size[1], control_size, self.largest_reference)

    def planned_controls(self, components: Components, latents: torch.Tensor) -> list[torch.Tensor]:
        """None: the memory plan is text-to-image's, what these bases train most (their shipped jobs'). Unlike the
        edit bases' plans, which hold their pairs' references, an edit run here costs more than planned: each reference
        at its target's area adds as many image tokens as the target has (the family's page says how much)."""
        return []
