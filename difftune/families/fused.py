"""The kohya / ComfyUI layout of denoisers whose original model fuses layers that diffusers keeps apart (Flux.1's
and SD3's attention `qkv`, Flux's single-block `linear1`): one adapter per original layer, named by the original
model (`lora_unet_<original name with _>`), over the diffusers modules it holds.

`FusedKohyaLayout` is mixed into such a family before its `Family` base; the family gives `kohya_blocks` (per list
of blocks, each original name with the block's index as `{i}` -> the diffusers modules it holds, in the order of its
output rows), `kohya_globals` for layers outside the blocks and, where the modules' widths differ, `fused_row_sizes`. Writing stacks the modules' downs and puts their ups block-diagonal (`kohya.fuse`), so the
fused change is exactly the modules' changes; reading splits them back, or shares a trained fused down
(`kohya.split`).
"""

from __future__ import annotations

import re

import torch

from difftune import kohya
from difftune.adapters import derived_lora_configs

KOHYA_DENOISER_PREFIX = "lora_unet_"
BLOCK = re.compile(r"^(\w+)\.(\d+)\.")  # a block's list and index: `single_transformer_blocks.3.`


class FusedKohyaLayout:
    kohya_layout_name: str  # the original model's name, as messages name its layout ("Flux", "SD3")
    kohya_blocks: dict[str, dict[str, list[str]]]  # block list -> {original name with `{i}`: its modules in the block}
    kohya_globals: dict[str, list[str]] = {}  # original name -> the modules it holds, outside the blocks

    def kohya_table(self, denoiser_modules) -> dict[str, list[str]]:
        """Original (kohya) name -> the denoiser's modules (diffusers names) it holds, for every block that
        `denoiser_modules` (module names, or adapted module names) mention."""
        blocks = sorted({(match.group(1), int(match.group(2))) for module in denoiser_modules
                         if (match := BLOCK.match(module)) and match.group(1) in self.kohya_blocks})
        table = {}
        for kind, index in blocks:
            table |= {pattern.format(i=index): [f"{kind}.{index}.{member}" for member in members]
                      for pattern, members in self.kohya_blocks[kind].items()}
        return table | self.kohya_globals

    def adapter_problems(self, config) -> list[str]:
        problems = super().adapter_problems(config)
        if config.adapter.kind in ("loha", "lokr") and config.export.format == "kohya":
            problems.append(
                f"adapter.kind = \"{config.adapter.kind}\" with export.format = \"kohya\": the {self.kohya_layout_name} "
                "layout fuses q, k and v into one layer, and separate LoHa/LoKr factors have no fused form; use "
                "export.format = \"diffusers\""
            )
        return problems

    def fused_row_sizes(self, modules: list[str], rows: int) -> list[int]:
        """How a fused layer's `rows` output rows split among its `modules`: evenly, unless the family says
        otherwise."""
        return [rows // len(modules)] * len(modules)

    def to_kohya(self, tensors: dict, lora_configs: dict) -> dict[str, torch.Tensor]:
        prefix = f"{self.denoiser_name}."
        denoiser = {key: value for key, value in tensors.items() if key.startswith(prefix)}
        out = super().to_kohya({key: value for key, value in tensors.items() if key not in denoiser}, lora_configs)
        adapted = {kohya.split_adapter_key(key.removeprefix(prefix))[0] for key in denoiser}
        table = self.kohya_table(adapted)
        for name, modules in table.items():
            present = [module in adapted for module in modules]
            if not any(present):
                continue
            if not all(present):
                raise ValueError(
                    f"the kohya {self.kohya_layout_name} layout fuses {', '.join(modules)} into {name}: adapt all of them "
                    "(or none), or write the diffusers layout"
                )
            fused = kohya.fuse(denoiser, lora_configs, self.denoiser_name, modules)
            out |= {f"{KOHYA_DENOISER_PREFIX}{name}.{kind}": value for kind, value in fused.items()}
        unnamed = adapted - {module for modules in table.values() for module in modules}
        if unnamed:
            raise ValueError(f"{prefix}{sorted(unnamed)[0]}: has no name in the kohya {self.kohya_layout_name} layout; "
                             "write the diffusers layout")
        return out

    def from_kohya(self, tensors: dict, module_names: dict[str, list[str]]) -> tuple[dict, dict]:
        fused = {key: value for key, value in tensors.items() if key.startswith(KOHYA_DENOISER_PREFIX)}
        out, configs = super().from_kohya({key: value for key, value in tensors.items() if key not in fused}, module_names)
        table = self.kohya_table(module_names[self.denoiser_name])
        by_name: dict[str, dict] = {}
        for key, value in fused.items():
            name, _, kind = key.removeprefix(KOHYA_DENOISER_PREFIX).partition(".")
            if name not in table:
                raise ValueError(f"{key}: no module of this {self.kohya_layout_name} {self.denoiser_name} is named {name!r}; "
                                 "is this adapter for this model?")
            by_name.setdefault(name, {})[kind] = value
        ranks, alphas = {}, {}
        for name, found in by_name.items():
            modules = table[name]
            sizes = self.fused_row_sizes(modules, found["lora_up.weight"].shape[0])
            for module, split in zip(modules, kohya.split(found, sizes)):
                out |= {f"{self.denoiser_name}.{module}.{kind}": value for kind, value in split.tensors.items()}
                ranks[module], alphas[module] = split.rank, split.alpha
        if ranks:
            dora = {self.denoiser_name: any("dora_scale" in found for found in by_name.values())}
            configs |= derived_lora_configs({self.denoiser_name: ranks}, {self.denoiser_name: alphas}, dora)
        return out, configs
