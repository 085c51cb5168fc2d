"""difftune: fine-tune latent diffusion models (LoRA, DoRA or full) with accelerate."""

import logging


class _DropNotice(logging.Filter):
    """Drops one start-up notice of a library that difftune's use makes moot; its other messages are kept."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


# diffusers imports CLIP's and SigLIP's image processors (for IP-Adapter) on every start; without torchvision,
# transformers then announces that it falls back to their PIL versions, which difftune never uses.
logging.getLogger("transformers.utils.import_utils").addFilter(
    _DropNotice("requires torchvision (not installed); falling back")
)
# With torchao (the QLoRA / FP8 extra) installed, diffusers and peft import it on every start: diffusers says it
# cannot register tensor types of older torchao releases (for loading checkpoints serialized with torchao, which
# difftune never reads), torchao that its GPU-only kernels did not load, and torch that torchao registers enums
# the old way. None of it is actionable here; torchao's errors still show.
logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").addFilter(
    _DropNotice("Unable to import `torchao` Tensor")
)
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
# bitsandbytes (the QLoRA / 8-bit Adam extra) is imported by peft on every start; on CPUs with AVX-512 BF16 it says
# a Hub kernel for its CPU inference layout did not load. difftune never uses that layout (quantize.py), so the
# notice would be the first line of every job, nf4 or not.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropNotice("Failed to load CPU gemm_4bit_forward"))
