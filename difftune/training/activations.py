"""Per-block activation statistics on chosen steps (`log.activations_every_steps`).

Forward hooks are attached to the denoiser's blocks (the family names them) for one optimizer step and removed
after it, so every other step runs without them. Each block's first forward of the step is measured: gradient
checkpointing's recomputation and later accumulation micro-steps would repeat it.
"""

from __future__ import annotations

import torch


class BlockActivations:
    """A context manager: inside it, each monitored block's output RMS and largest absolute value are kept."""

    def __init__(self, family, denoiser: torch.nn.Module):
        self.blocks = family.monitored_blocks(denoiser)
        self._stats: dict[str, torch.Tensor] = {}  # block -> (rms, max-abs), still on the device
        self._handles = []

    def __enter__(self) -> BlockActivations:
        for name, block in self.blocks.items():
            self._handles.append(block.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def record(module, args, output) -> None:
            if name in self._stats:
                return
            with torch.no_grad():
                values = _first_tensor(output).detach().float()
                self._stats[name] = torch.stack([values.square().mean().sqrt(), values.abs().max()])

        return record

    def _read(self) -> dict[str, list[float]]:
        if not self._stats:
            return {}
        names = list(self._stats)
        return dict(zip(names, torch.stack([self._stats[n] for n in names]).tolist(), strict=True))  # one device sync

    def values(self) -> dict[str, float]:
        """Metrics: `act_rms/<block>` and `act_max/<block>` (TensorBoard groups them by the prefix)."""
        stats = self._read()
        return {f"act_rms/{name}": rms for name, (rms, _) in stats.items()} | {
            f"act_max/{name}": largest for name, (_, largest) in stats.items()
        }

    def maxima(self) -> dict[str, float]:
        return {name: largest for name, (_, largest) in self._read().items()}


def _first_tensor(output) -> torch.Tensor:
    """A block's main output: UNet down blocks return (hidden states, skip connections), transformer blocks a
    diffusers output object whose first field is the sample."""
    while not isinstance(output, torch.Tensor):
        output = output[0]
    return output
