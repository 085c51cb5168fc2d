"""Host-to-device copies that do not stop the host: a training step's inputs (its batch, its noise and timesteps, drawn
on the host from each sample's own generator so that a sample's draws do not depend on its batch or device).

A plain `tensor.to("cuda")` from ordinary host memory makes the host wait until the device has finished everything
queued before the copy (torch copies through `cudaMemcpy` and synchronizes the stream). In a step that is a stall per
input: the host stops launching work, the device drains its queue and idles until the next kernel is launched. From
page-locked memory with `non_blocking=True` the copy is queued like a kernel; torch's page-locked allocator keeps the
source alive until the copy has run. diffusers' `randn_tensor` with host generators copies its result the plain way.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`tensor` on `device` (in `dtype` when given), copied without making the host wait where the device is CUDA."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        source = tensor if tensor.is_pinned() else tensor.pin_memory()
        tensor = source.to(device, non_blocking=True)
    else:
        tensor = tensor.to(device)
    return tensor if dtype is None else tensor.to(dtype)


def host_randn(
    shape: tuple[int, ...], generators: list[torch.Generator], device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Standard normal (B, ...) on `device`, sample b drawn on the host from `generators[b]`: the numbers diffusers'
    `randn_tensor` draws from host generators, copied as `to_device` copies."""
    draws = [torch.randn((1, *shape[1:]), generator=generator, dtype=dtype) for generator in generators]
    return to_device(torch.cat(draws), device)
