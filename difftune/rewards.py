"""Scorers for reward training (`reward.scorer = "difftune.rewards:<name>"`), each `images, prompts -> scores`.

`clip_score` is the prompt-image cosine similarity of a CLIP model the user has (a local folder or a hub id already in
the cache; `reward.scorer_options.model`), computed on the tensors themselves so that it has gradients for DRaFT. Its
image preprocessing is the model's own processor's (resize of the shorter side, centre crop, its mean and std),
done with torch ops instead of PIL's.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from difftune.errors import DifftuneError


@lru_cache(maxsize=2)
def _clip(model: str):
    from transformers import CLIPImageProcessor, CLIPModel, CLIPTokenizer

    try:
        clip = CLIPModel.from_pretrained(model).eval().requires_grad_(False)
        return clip, CLIPTokenizer.from_pretrained(model), CLIPImageProcessor.from_pretrained(model)
    except OSError as error:
        raise DifftuneError(
            f"reward.scorer_options.model {model}: cannot load a CLIP model from it ({error}); point it at a folder "
            "holding a CLIP model, its tokenizer and its image processor (or a hub id you have downloaded)"
        ) from error


def clip_pixels(images: torch.Tensor, processor) -> torch.Tensor:
    """Images (B, 3, H, W) in [0, 1] as `processor` hands them to CLIP: the shorter side resized (bicubic), the
    centre cropped, then normalised."""
    side = processor.size["shortest_edge"]
    height, width = images.shape[-2:]
    scale = side / min(height, width)
    resized = (round(height * scale), round(width * scale))
    if resized != (height, width):
        images = F.interpolate(images, size=resized, mode="bicubic", align_corners=False, antialias=True)
    crop_height, crop_width = processor.crop_size["height"], processor.crop_size["width"]
    top, left = (resized[0] - crop_height) // 2, (resized[1] - crop_width) // 2
    images = images[..., top : top + crop_height, left : left + crop_width]
    mean = torch.tensor(processor.image_mean, device=images.device, dtype=images.dtype).view(1, 3, 1, 1)
    std = torch.tensor(processor.image_std, device=images.device, dtype=images.dtype).view(1, 3, 1, 1)
    return (images - mean) / std


def clip_score(images: torch.Tensor, prompts: list[str], model: str = "openai/clip-vit-large-patch14") -> torch.Tensor:
    """The cosine similarity of each image's CLIP embedding and its prompt's (B,), with gradients to the images."""
    clip, tokenizer, processor = _clip(model)
    clip.to(images.device)
    tokens = tokenizer(prompts, padding=True, truncation=True, return_tensors="pt").to(images.device)
    image_features = _projected(clip.get_image_features(pixel_values=clip_pixels(images.float(), processor)))
    text_features = _projected(clip.get_text_features(**tokens))
    return F.cosine_similarity(image_features, text_features, dim=-1)


def _projected(features) -> torch.Tensor:
    """The projected embedding: transformers 5 returns it as the output's pooled output, 4 as the tensor."""
    return features if isinstance(features, torch.Tensor) else features.pooler_output
