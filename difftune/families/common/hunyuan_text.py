"""Tencent Hunyuan's text conditioning, shared by HunyuanImage 2.1 and HunyuanVideo 1.5 (a `Conditioning` role): a
Qwen2.5-VL language model's states of the caption in the pipeline's template and, for the text a caption quotes,
ByT5's glyph states of it.

- The language model reads every caption padded to the full length the pipeline reads (`template_tokens` +
  `padded_text_tokens`), masked, as the pipeline runs it, so its states are the pipeline's bit for bit; its
  third-to-last hidden state (the pipeline skips two layers), the template's first `template_tokens` dropped, with the
  mask of real tokens.
- ByT5 reads the caption's quoted text as the pipeline formats it (the family's `glyph_text`: `Text "...". `),
  `glyph_tokens` bytes of it with their mask (a float mask, the pipeline's call); zeros and a zero mask where the
  caption quotes nothing.
- The text cache keeps each caption's real tokens of both and pads them back.
- Both transformers mask the padding of both out of their attention and their token refiner's pooling, so
  `text_arguments` cuts both to the batch's longest caption.

The family gives `templated_ids` (its template, padded as its pipeline pads it), `glyph_text`, `template_tokens`,
`padded_text_tokens` and `glyph_tokens`.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from difftune.errors import DifftuneError
from difftune.families.common.conditioning import NO_TOKEN, Conditioning, padded, trimmed, valid_token_states
from difftune.models.components import Components

SKIPPED_LAYERS = 2  # the language model's last layers both pipelines skip (their third-to-last hidden state)
# The language model's states and the glyph states, each with its mask: what the text cache trims to a caption's real
# tokens.
TEXT = ("encoder_hidden_states", "text_mask")
GLYPHS = ("encoder_hidden_states_2", "text_mask_2")


def padded_ids(tokenizer, texts: list[str], length: int) -> torch.Tensor:
    """`texts`' ids as the pipelines tokenize them (padded to `length`, truncated), -1 at the padding."""
    encoded = tokenizer(texts, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    return encoded.input_ids.masked_fill(encoded.attention_mask == 0, NO_TOKEN)


def refuse_meanflow(transformer: torch.nn.Module | None, distilled: str, train_instead: str) -> None:
    """A step-distilled Hunyuan base (meanflow: its transformer reads the next step's time too) is refused by name:
    its objective is its own."""
    if transformer is not None and transformer.config.use_meanflow:
        raise DifftuneError(
            f"{distilled} (meanflow: the transformer reads the next step's time too): its objective is its own and is "
            f"not trained; train {train_instead}"
        )


@contextmanager
def attributes_set(pipeline, **attributes):
    """`pipeline` with `attributes` set for one call (a sample's guider), then as it was."""
    kept = {name: getattr(pipeline, name) for name in attributes}
    for name, value in attributes.items():
        setattr(pipeline, name, value)
    try:
        yield pipeline
    finally:
        for name, value in kept.items():
            setattr(pipeline, name, value)


def norms_dtype(denoiser: torch.nn.Module) -> torch.dtype:
    """The dtype a Hunyuan transformer computes in: its layer norms' (never stored in fewer bits). Its ByT5 and image
    projections start with a norm, which on a CPU takes no input of a wider dtype than its weights: their inputs are
    cast to it."""
    return next(
        module.weight.dtype
        for module in denoiser.modules()
        if isinstance(module, torch.nn.LayerNorm) and module.weight is not None
    )


def _picked(conditioning: dict[str, torch.Tensor], names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {name: conditioning[name] for name in names}


def text_arguments(
    conditioning: dict[str, torch.Tensor], denoiser: torch.nn.Module, least_glyphs: int = 0
) -> dict[str, torch.Tensor]:
    """The transformer's text arguments, both texts cut to the batch's longest (their padding is masked out), in
    the dtype of `denoiser`'s norms; the glyph states at least `least_glyphs` long (0: left out where no caption
    of the batch quotes text)."""
    dtype = norms_dtype(denoiser)
    mask = conditioning["text_mask"].bool()
    longest = int(mask.sum(dim=1).max())
    arguments = {
        "encoder_hidden_states": conditioning["encoder_hidden_states"][:, :longest].to(dtype),
        "encoder_attention_mask": mask[:, :longest],
    }
    glyph_mask = conditioning["text_mask_2"].bool()
    glyph_longest = max(int(glyph_mask.sum(dim=1).max()), least_glyphs)
    if glyph_longest:
        arguments |= {
            "encoder_hidden_states_2": conditioning["encoder_hidden_states_2"][:, :glyph_longest].to(dtype),
            "encoder_attention_mask_2": glyph_mask[:, :glyph_longest],
        }
    return arguments


class HunyuanTextConditioning(Conditioning):
    """The text side of a Hunyuan family (see the module's docstring)."""

    template_tokens: int  # the template's tokens before the caption, which the pipeline drops
    padded_text_tokens: int  # the caption's tokens the pipeline reads after them
    glyph_tokens: int  # ByT5's bytes of the quoted text

    def templated_ids(self, tokenizer, captions: list[str]) -> torch.Tensor:
        """The captions in the pipeline's template, padded to `template_tokens + padded_text_tokens` as the pipeline
        pads them, -1 (no token's id) at the padding."""
        raise NotImplementedError

    def glyph_text(self, caption: str) -> str | None:
        """The text `caption` quotes as the pipeline formats it for ByT5; None where it quotes nothing."""
        raise NotImplementedError

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        glyph_ids = torch.full((len(captions), self.glyph_tokens), NO_TOKEN, dtype=torch.long)
        for i, caption in enumerate(captions):
            if (glyph := self.glyph_text(caption)) is not None:
                glyph_ids[i] = padded_ids(tokenizers["tokenizer_2"], [glyph], self.glyph_tokens)[0]
        return {"text_encoder": self.templated_ids(tokenizers["tokenizer"], captions), "text_encoder_2": glyph_ids}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = token_ids["text_encoder"]
        mask = ids != NO_TOKEN
        pad = components.tokenizers["tokenizer"].pad_token_id
        states = components.text_encoders["text_encoder"](
            input_ids=ids.masked_fill(~mask, pad), attention_mask=mask.long(), output_hidden_states=True
        ).hidden_states[-(SKIPPED_LAYERS + 1)]
        conditioning = valid_token_states(states, mask, self.template_tokens, self.padded_text_tokens)
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
        return padded(_picked(stored, TEXT), self.padded_text_tokens) | padded(
            _picked(stored, GLYPHS), self.glyph_tokens
        )
