"""Wan 2.2 A14B's two experts trained in one run (`model.family_options.expert = "both"`), as one denoiser.

The pipeline denoises with `transformer` at times >= `boundary_ratio` x 1000 and with `transformer_2` below; a run
of both routes each sample to the expert its time picks, so each expert learns exactly the noise levels it will
serve (ai-toolkit's Wan 2.2 runs, musubi-tuner's `--dit_high_noise`). The experts stay the pipeline's own modules:
each carries its own adapter, and a run's files are one per expert (wan.py), each the file a run of that expert
alone writes.

Memory: at A14B's size an expert is 28 GB of bf16, so only one is resident on the device. Before an expert computes
(in training, in previews, in the pipeline's own loop), its frozen weights move to the device its input is on and the
other's move to host memory, in the dtype they are stored in (fp8 stays fp8). Trained weights (the adapters') never
move: the optimizer's state for them stays beside them. Flow matching draws a batch's noise levels on one side of the
boundary (flow.py), so a step runs one expert and a switch costs one copy of an expert between steps.
"""

from __future__ import annotations

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput

EXPERTS = ("transformer", "transformer_2")  # high noise levels, then low: the pipeline's part names
HOST = torch.device("cpu")


class WanExperts(torch.nn.Module):
    """Both experts as one denoiser: `forward` takes the transformer's arguments and runs each sample on its
    expert."""

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module, boundary_ratio: float):
        super().__init__()
        self.transformer, self.transformer_2 = transformer, transformer_2
        self.boundary = boundary_ratio * 1000  # in the pipeline's times
        self.resident = "transformer"
        for name in EXPERTS:
            getattr(self, name).register_forward_pre_hook(
                lambda module, args, kwargs, name=name: self._made_resident(
                    name, kwargs.get("hidden_states", args[0] if args else None)
                ),
                with_kwargs=True,
            )

    @property
    def config(self):
        """The experts' shared config (one architecture: the pipeline patches, channels and sizes by it)."""
        return self.transformer.config

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def experts(self) -> dict[str, torch.nn.Module]:
        """The experts by their pipeline part names."""
        return {name: getattr(self, name) for name in EXPERTS}

    def expert_of(self, timestep: torch.Tensor) -> torch.Tensor:
        """Per sample, whether `transformer_2` serves it (a time per sample, or per token: the first token's)."""
        times = timestep if timestep.dim() == 1 else timestep[:, 0]
        return times < self.boundary

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, return_dict: bool = True, **kwargs):
        low = self.expert_of(timestep)
        if bool(low.all()) or not bool(low.any()):  # one expert serves the batch (training draws so)
            expert = self.transformer_2 if bool(low.all()) else self.transformer
            return expert(hidden_states=hidden_states, timestep=timestep, return_dict=return_dict, **kwargs)
        batch, prediction = hidden_states.shape[0], None
        for expert, chosen in ((self.transformer, ~low), (self.transformer_2, low)):
            picked = {
                key: value[chosen] if isinstance(value, torch.Tensor) and value.shape[:1] == (batch,) else value
                for key, value in kwargs.items()
            }
            output = expert(hidden_states=hidden_states[chosen], timestep=timestep[chosen], return_dict=False, **picked)
            if prediction is None:
                prediction = output[0].new_empty((batch, *output[0].shape[1:]))
            prediction[chosen] = output[0]
        return Transformer2DModelOutput(sample=prediction) if return_dict else (prediction,)

    def enable_gradient_checkpointing(self, gradient_checkpointing_func=None) -> None:
        for expert in self.experts().values():
            expert.enable_gradient_checkpointing(gradient_checkpointing_func)

    def enable_xformers_memory_efficient_attention(self) -> None:
        for expert in self.experts().values():
            expert.enable_xformers_memory_efficient_attention()

    def add_adapter(self, adapter_config, adapter_name: str = "default") -> None:
        """The same adapter settings on each expert, each its own weights."""
        for expert in self.experts().values():
            expert.add_adapter(adapter_config, adapter_name=adapter_name)

    @property
    def peft_config(self) -> dict:
        return self.transformer.peft_config

    def to(self, *args, **kwargs):
        """A move to a device takes the trained weights and the resident expert's frozen ones there, the other
        expert's frozen weights staying where they are (loaded in host memory); dtypes and memory formats apply to
        both."""
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None or memory_format is not None:
            super().to(**{k: v for k, v in {"dtype": dtype, "memory_format": memory_format}.items() if v is not None})
        if device is not None:
            _move(self, device, trained=True)
            _move(getattr(self, self.resident), device, trained=False)
        return self

    def _made_resident(self, name: str, hidden_states: torch.Tensor | None) -> None:
        """Before `name` computes: its frozen weights onto its input's device, the other's to host memory."""
        if hidden_states is None or hidden_states.is_meta:  # the memory plan's step: nothing to move
            return
        device, expert = hidden_states.device, getattr(self, name)
        if self.resident == name and all(t.device == device for t in expert.parameters() if not t.requires_grad):
            return
        for other_name, other in self.experts().items():
            if other_name != name:  # first, so the device never holds both
                _move(other, HOST, trained=False)
        _move(expert, device, trained=False)
        self.resident = name


def _move(module: torch.nn.Module, device: torch.device, trained: bool) -> None:
    """`module`'s trained parameters, or its frozen parameters and buffers, to `device` in place, as `Module.to`
    moves them: the same parameter objects where the storage allows (the optimizer keeps its references)."""
    for owner in module.modules():
        for store in (owner._parameters, *(() if trained else (owner._buffers,))):
            for name, tensor in store.items():
                if tensor is None or tensor.requires_grad != trained and store is owner._parameters:
                    continue
                moved = tensor.data.to(device)
                if torch._has_compatible_shallow_copy_type(tensor, moved):
                    tensor.data = moved
                elif store is owner._parameters:
                    store[name] = torch.nn.Parameter(moved, requires_grad=tensor.requires_grad)
                else:
                    store[name] = moved
