"""Textual inversion: new token embeddings learned for a concept, the rest of the model frozen.

`adapter.kind = "embedding"` adds `adapter.embedding_token` (and `<token>_1`, ... for more vectors: diffusers'
multi-vector convention) to every text encoder's tokenizer, starts the new rows from `embedding_init_word`, and
trains those rows alone through peft's trainable-tokens layer (no other row moves, and the optimizer holds
state for these rows only). The file holds each encoder's vectors under the keys A1111 and ComfyUI read
(the family's `embedding_keys`: `emb_params`; SDXL's `clip_l` and `clip_g`), which diffusers'
`load_textual_inversion` reads too; the token is in its metadata.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from peft import TrainableTokensConfig
from safetensors.torch import save_file

from difftune.config import AdapterConfig
from difftune.errors import DifftuneError
from difftune.files import open_safetensors, replace_atomically
from difftune.models.components import Components

TOKEN_METADATA_KEY = "difftune_embedding_token"


def token_names(config: AdapterConfig) -> list[str]:
    """The tokens the concept is learned in: `<token>`, `<token>_1`, ..."""
    token = config.embedding_token
    return [token] + [f"{token}_{i}" for i in range(1, config.embedding_vectors)]


def caption_with_token(caption: str, config: AdapterConfig) -> str:
    """The caption as training reads it: `embedding_caption_word` replaced by the token, and the token spelled as all
    of its vectors."""
    if config.embedding_caption_word:
        caption = re.sub(rf"\b{re.escape(config.embedding_caption_word)}\b", config.embedding_token, caption)
    return caption.replace(config.embedding_token, " ".join(token_names(config)))


def check_captions(captions: list[str], config: AdapterConfig) -> None:
    if not any(config.embedding_token in caption for caption in captions):
        where = (
            f"adapter.embedding_caption_word {config.embedding_caption_word!r} is in none of them"
            if config.embedding_caption_word
            else "set adapter.embedding_caption_word to the word it stands for"
        )
        raise DifftuneError(f"adapter.embedding_token {config.embedding_token!r} appears in no caption: {where}")


def add_tokens(components: Components, config: AdapterConfig) -> None:
    """The new tokens in every tokenizer, their rows in every text encoder (initialised), and peft's trainable-tokens
    layer on each encoder's input embedding, so that only those rows train."""
    names = token_names(config)
    for encoder_name, tokenizer_name in components.family.conditioning.encoder_tokenizers():
        tokenizer, encoder = components.tokenizers[tokenizer_name], components.text_encoders[encoder_name]
        # Known: one token already (CLIP spells a word `red</w>` in its vocabulary, so ask the tokenizer itself).
        known = [name for name in names if len(tokenizer(name, add_special_tokens=False).input_ids) == 1]
        if known:
            raise DifftuneError(
                f"adapter.embedding_token: {known[0]!r} is already a token of {tokenizer_name}; choose a new one, "
                f"e.g. <{config.embedding_token.strip('<>')}-concept>"
            )
        tokenizer.add_tokens(names)
        ids = tokenizer.convert_tokens_to_ids(names)
        # Without an init word the new rows are drawn with the vocabulary's mean and covariance (transformers).
        encoder.resize_token_embeddings(len(tokenizer), mean_resizing=not config.embedding_init_word)
        table = encoder.get_input_embeddings()
        if config.embedding_init_word:
            init_ids = tokenizer(config.embedding_init_word, add_special_tokens=False).input_ids
            with torch.no_grad():
                table.weight[ids] = table.weight[init_ids].mean(dim=0)
        module_name = next(name for name, module in encoder.named_modules() if module is table)
        encoder.add_adapter(TrainableTokensConfig(target_modules=[module_name.rpartition(".")[2]], token_indices=ids))


def embedding_vectors(components: Components, config: AdapterConfig) -> dict[str, torch.Tensor]:
    """Each text encoder's learned vectors (n, dim) under its file key, as the encoder now embeds the tokens."""
    vectors = {}
    for (encoder_name, tokenizer_name), key in zip(
        components.family.conditioning.encoder_tokenizers(), components.family.layout.embedding_keys, strict=True
    ):
        ids = components.tokenizers[tokenizer_name].convert_tokens_to_ids(token_names(config))
        encoder = components.text_encoders[encoder_name]
        with torch.no_grad():
            embedded = encoder.get_input_embeddings()(torch.tensor(ids, device=encoder.device))
        vectors[key] = embedded.to("cpu", torch.float32, copy=True).contiguous()
    return vectors


def write_embedding(path: Path, components: Components, config: AdapterConfig, metadata: dict[str, str]) -> Path:
    """The learned vectors, with the token and `metadata` (the run's config) in the file's metadata."""
    vectors = embedding_vectors(components, config)
    bad = [key for key, value in vectors.items() if not torch.isfinite(value).all()]
    if bad:
        raise DifftuneError(f"embedding {path}: NaN or inf in {bad[0]}; not written")
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", TOKEN_METADATA_KEY: config.embedding_token, **metadata}
    return replace_atomically(path, lambda staging: save_file(vectors, staging, metadata=metadata))


def is_token_keyed(keys, embedding_keys) -> bool:
    """diffusers' textual-inversion layout (its training script, `load_textual_inversion`): `{token: (n, dim)}`, one
    dotless key that is none of the layouts' `embedding_keys` (adapter keys always name a module path)."""
    keys = set(keys)
    return len(keys) == 1 and not keys & set(embedding_keys) and "." not in next(iter(keys))


def load_embedding(components: Components, path: Path) -> str:
    """Teach the components' tokenizers and encoders the file's token (diffusers' `load_textual_inversion`, one
    encoder at a time); the token, from the file's metadata, else its key in diffusers' layout, else the file's name
    (A1111's rule)."""
    with open_safetensors(path, "embedding") as handle:
        token = (handle.metadata() or {}).get(TOKEN_METADATA_KEY)
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    family, pipeline = components.family, components.pipeline()
    if is_token_keyed(tensors, family.layout.embedding_keys):
        [(token, vectors)] = tensors.items()
        tensors = {family.layout.embedding_keys[0]: vectors}
        if len(family.text_encoder_names) > 1:
            raise DifftuneError(
                f"embedding {path}: diffusers' layout ({{token: vectors}}) holds one text encoder's vectors, and this "
                f"{family.description} base has {len(family.text_encoder_names)} text encoders; use a file with "
                f"{' and '.join(family.layout.embedding_keys)} vectors (the layout A1111, ComfyUI and difftune write)"
            )
    token = token or path.stem
    for (encoder_name, tokenizer_name), key in zip(
        family.conditioning.encoder_tokenizers(), family.layout.embedding_keys, strict=True
    ):
        if key not in tensors:
            raise DifftuneError(
                f"embedding {path}: no {key!r} vectors for the {encoder_name} of this {family.description} base"
            )
        width = components.text_encoders[encoder_name].get_input_embeddings().weight.shape[1]
        if tensors[key].shape[-1] != width:
            raise DifftuneError(
                f"embedding {path}: its {key!r} vectors are {tensors[key].shape[-1]} wide, but this "
                f"base's {encoder_name} embeds tokens in {width}: the embedding was made for another model"
            )
        pipeline.load_textual_inversion(
            {token: tensors[key]},
            token=token,
            text_encoder=components.text_encoders[encoder_name],
            tokenizer=components.tokenizers[tokenizer_name],
        )
    return token


def embedding_file_name(config: AdapterConfig) -> str:
    """A1111 and ComfyUI name an embedding by its file: the token, less characters a file name cannot hold."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "", config.embedding_token) or "embedding"
