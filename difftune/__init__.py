"""difftune: fine-tune latent diffusion models (LoRA, DoRA or full) with accelerate."""

import logging


class _TorchvisionFallbackNotice(logging.Filter):
    """diffusers imports CLIP's and SigLIP's image processors (for IP-Adapter) on every start; without torchvision,
    transformers then announces that it falls back to their PIL versions. difftune never uses them, so the
    notice is dropped; every other transformers message is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed); falling back" not in record.getMessage()


logging.getLogger("transformers.utils.import_utils").addFilter(_TorchvisionFallbackNotice())
