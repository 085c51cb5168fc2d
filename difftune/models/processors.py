"""transformers processors as difftune loads them."""

from __future__ import annotations

import importlib.util


def load_without_video_processor(processor_class: type) -> None:
    """transformers builds (and loads) a Qwen-VL processor only with its video processor, which needs torchvision
    (transformers#43986); the image pipelines show their language model images alone. Without torchvision, the
    processor is built and loaded without a video processor, so CPU machines with no torchvision build train too."""
    if importlib.util.find_spec("torchvision") is None:
        processor_class.get_attributes = classmethod(lambda cls: ["image_processor", "tokenizer"])
