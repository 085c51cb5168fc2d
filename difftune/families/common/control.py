"""A family's control roles, as objects: its ControlNet (`Family.controlnet`) and its control LoRA's input
(`Family.input_control`), each None where diffusers has no pipeline for it.

A ControlNet (Zhang et al. 2023) is a trainable copy of the first blocks of the denoiser that reads a control image
beside the noisy latents; its zero-initialised output layers add to the frozen denoiser's blocks, so it starts as the
base and learns only what the control says. It reads exactly what the denoiser reads (the same noisy input, timestep
and text states), so the family's `denoise` passes its inputs through `Family.control_residuals` and adds what comes
back, as the family's ControlNet pipeline does in drawing. Each model below is started as diffusers' `from_unet` /
`from_transformer` start it (the same parts copied, the same layers zeroed), from the weights as the denoiser
computes with them: a denoiser whose frozen layers are stored in fp8 or 16 bits (memory/storage.py) is read through
its casts, and only the tensors the copy holds are computed.

A control LoRA (`adapter.control_input`; Flux.1's Canny and Depth LoRAs) has no second network: the control image's
latents join the noisy latents' channels, the denoiser's input layer is widened with zeros to read them (so it starts
as the base) and adapted with the rest, and the pipeline that draws with it passes the control image the same way.
"""

from __future__ import annotations

import inspect
import math
from contextlib import nullcontext

import torch
from diffusers import ControlNetModel, FluxControlNetModel, QwenImageControlNetModel, SD3ControlNetModel

from difftune.families.common.tokens import pack
from difftune.memory.storage import computed_tensors
from difftune.models.components import Components

# diffusers' `ControlNetModel.from_unet` default: four widths, three stride-2 steps down to the latents' 1/8 size.
UNET_CONDITIONING_WIDTHS = (16, 32, 96, 256)


class ControlNets:
    """What a family's ControlNet is: its model class, the pipeline that draws with one, how a new one starts from
    the denoiser, how it reads a control image and what it adds to the denoiser's call."""

    model_class: type  # the diffusers ControlNet class (its `from_pretrained` reads the saved folder)
    reads_latents = True  # the control image's latents (else its pixels: the latent cache then holds no controls)
    image_argument = "control_image"  # the control image's name in the pipeline's call
    copied_parts: tuple[str, ...] = ()  # the denoiser's parts a new ControlNet starts as a copy of (blocks: the first)
    zeroed_parts: tuple[str, ...] = ()  # layers a new ControlNet starts at zero besides its zero-initialised outputs

    def __init__(self, pipeline_class: type):
        self.pipeline_class = pipeline_class  # the family's ControlNet pipeline, over the same parts plus `controlnet`

    def build(self, components: Components) -> torch.nn.Module:
        """A new ControlNet for the loaded denoiser, started from its weights (on the meta device, the memory plan's
        model, shapes alone)."""
        denoiser = components.denoiser
        on_meta = next(denoiser.parameters()).is_meta
        with torch.device("meta") if on_meta else nullcontext():
            controlnet = self.empty(components)
        if on_meta:
            return controlnet
        # Every tensor of the copied parts that the denoiser has in the same shape: a block the ControlNet holds in
        # another form (SD3's last block reads no text after it in the transformer, but does in its ControlNet) keeps
        # its own init, as diffusers' non-strict copy of the blocks leaves the layers it lacks.
        own = controlnet.state_dict()
        wanted = [name for name in own if name.split(".")[0] in self.copied_parts]
        copied = {
            name: self.fitted(name, tensor, own[name].shape)
            for name, tensor in computed_tensors(denoiser, wanted).items()
        }
        controlnet.load_state_dict(
            {name: tensor for name, tensor in copied.items() if tensor is not None}, strict=False
        )
        for part in self.zeroed_parts:
            for parameter in getattr(controlnet, part).parameters():
                torch.nn.init.zeros_(parameter)
        return controlnet

    def empty(self, components: Components) -> torch.nn.Module:
        """A new ControlNet of the denoiser's shape, its weights not yet copied."""
        raise NotImplementedError

    def fitted(self, name: str, tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
        """The denoiser's `tensor` as the ControlNet's `name` of `shape` starts from, None where it has another
        shape (the ControlNet's own init is kept)."""
        return tensor if tensor.shape == shape else None

    def control_input(self, components: Components, control: torch.Tensor) -> torch.Tensor:
        """A batch of control images as the data gives them (with `reads_latents` their normalised latents (B, C, h,
        w), else pixels in [-1, 1]) as the ControlNet reads them."""
        return control

    def residuals(self, controlnet, control, hidden_states, timestep, **inputs) -> dict:
        """The denoiser's extra arguments for one call: what `controlnet` adds, reading `control` (`control_input`'s)
        beside the denoiser's own inputs (`inputs`, by the denoiser's argument names)."""
        raise NotImplementedError


class UNetControlNet(ControlNets):
    """SD's and SDXL's ControlNet (diffusers' `ControlNetModel`): a copy of the UNet's down and mid blocks whose
    conditioning embedding reads the control image's pixels in [0, 1] (as the ControlNet pipelines' image processor
    gives them, `do_normalize=False`), stepped down to the latents' size, and adds one residual per down block output
    and one to the mid block (diffusers' `train_controlnet.py`, `train_controlnet_sdxl.py`)."""

    model_class = ControlNetModel
    reads_latents = False
    image_argument = "image"
    copied_parts = ("conv_in", "time_proj", "time_embedding", "class_embedding", "add_embedding", "down_blocks")
    copied_parts += ("mid_block",)

    def empty(self, components: Components) -> torch.nn.Module:
        # Its conditioning embedding steps the control image down as the autoencoder steps pixels down: a base with a
        # 4x autoencoder gets two stride-2 steps, not three.
        steps = round(math.log2(components.pixels_per_latent))
        return ControlNetModel.from_unet(
            components.denoiser,
            conditioning_embedding_out_channels=UNET_CONDITIONING_WIDTHS[: steps + 1],
            load_weights_from_unet=False,
        )

    def control_input(self, components: Components, control: torch.Tensor) -> torch.Tensor:
        return (control + 1) / 2

    def residuals(self, controlnet, control, hidden_states, timestep, **inputs) -> dict:
        down, mid = controlnet(hidden_states, timestep, controlnet_cond=control, return_dict=False, **inputs)
        return {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}


class UNetInpaintControlNet(UNetControlNet):
    """An inpainting UNet's ControlNet (diffusers' `StableDiffusionControlNetInpaintPipeline` and its SDXL twin): SD's
    or SDXL's ControlNet, reading the noisy latents alone, as those pipelines give it the latents before the mask and
    the masked image join them (their `control_model_input`). So a ControlNet trained on the text-to-image base draws
    there too, and one trained here starts as the inpainting UNet's blocks, its input layer the UNet's first channels
    (the noisy latents'); the pipelines take its control image as `control_image`."""

    image_argument = "control_image"

    def empty(self, components: Components) -> torch.nn.Module:
        controlnet = super().empty(components)
        latents, conv = components.denoiser.config.out_channels, controlnet.conv_in
        controlnet.conv_in = torch.nn.Conv2d(latents, conv.out_channels, conv.kernel_size, padding=conv.padding)
        controlnet.register_to_config(in_channels=latents)
        return controlnet

    def fitted(self, name: str, tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
        """The UNet's input layer's weights over the noisy latents' channels (its first)."""
        if name == "conv_in.weight":
            return tensor[:, : shape[1]]
        return super().fitted(name, tensor, shape)

    def residuals(self, controlnet, control, hidden_states, timestep, **inputs) -> dict:
        """The UNet's input is [noisy latents, mask, masked image's latents]: the ControlNet reads the first."""
        latents = hidden_states[:, : controlnet.config.in_channels]
        return super().residuals(controlnet, control, latents, timestep, **inputs)


class SD3ControlNet(ControlNets):
    """SD3's and SD3.5's ControlNet (diffusers' `SD3ControlNetModel`, `train_controlnet_sd3.py`): the transformer's
    first 12 blocks (all of a shallower one) with their embeddings, reading the control image's latents through an
    input embedding that starts at zero, each block's output added to the transformer's blocks."""

    model_class = SD3ControlNetModel
    copied_parts = ("pos_embed", "time_text_embed", "context_embedder", "transformer_blocks")
    zeroed_parts = ("pos_embed_input",)
    layers = 12  # `SD3ControlNetModel.from_transformer`'s default, as the script leaves it

    def empty(self, components: Components) -> torch.nn.Module:
        config = components.denoiser.config
        layers = min(self.layers, config.num_layers)
        return SD3ControlNetModel.from_config(
            init_settings(SD3ControlNetModel, {**config, "num_layers": layers, "extra_conditioning_channels": 0})
        )

    def residuals(self, controlnet, control, hidden_states, timestep, **inputs) -> dict:
        [samples] = controlnet(hidden_states, controlnet_cond=control, timestep=timestep, return_dict=False, **inputs)
        return {"block_controlnet_hidden_states": samples}


class FluxControlNet(ControlNets):
    """Flux.1's ControlNet (diffusers' `FluxControlNetModel`, `train_controlnet_flux.py`): the transformer's first 4
    double-stream and 4 single-stream blocks (the script's defaults) with their embeddings, reading the control
    image's packed latents through an input embedding that starts at zero, each block's output added to the
    transformer's blocks."""

    model_class = FluxControlNetModel
    copied_parts = ("pos_embed", "time_text_embed", "context_embedder", "x_embedder", "transformer_blocks")
    copied_parts += ("single_transformer_blocks",)
    zeroed_parts = ("controlnet_x_embedder",)
    layers, single_layers = 4, 4

    def empty(self, components: Components) -> torch.nn.Module:
        config = components.denoiser.config
        layers = {
            "num_layers": min(self.layers, config.num_layers),
            "num_single_layers": min(self.single_layers, config.num_single_layers),
        }
        return FluxControlNetModel.from_config(init_settings(FluxControlNetModel, {**config, **layers}))

    def control_input(self, components: Components, control: torch.Tensor) -> torch.Tensor:
        return pack(control)  # (B, h/2 * w/2, 4C): the image tokens' layout

    def residuals(self, controlnet, control, hidden_states, timestep, **inputs) -> dict:
        blocks, single_blocks = controlnet(
            hidden_states,
            controlnet_cond=control.to(hidden_states.dtype),
            timestep=timestep,
            return_dict=False,
            **inputs,
        )
        return {"controlnet_block_samples": blocks, "controlnet_single_block_samples": single_blocks}


class QwenImageControlNet(ControlNets):
    """Qwen-Image's ControlNet (diffusers' `QwenImageControlNetModel`, as InstantX's Union): the transformer's first 5
    blocks (`from_transformer`'s default) with its embeddings, reading the control image's packed latents through an
    input embedding that starts at zero, each block's output added to the transformer's blocks."""

    model_class = QwenImageControlNetModel
    copied_parts = ("pos_embed", "time_text_embed", "img_in", "txt_in", "transformer_blocks")
    zeroed_parts = ("controlnet_x_embedder",)
    layers = 5

    def empty(self, components: Components) -> torch.nn.Module:
        config = components.denoiser.config
        settings = {**config, "num_layers": min(self.layers, config.num_layers), "extra_condition_channels": 0}
        return QwenImageControlNetModel.from_config(init_settings(QwenImageControlNetModel, settings))

    def control_input(self, components: Components, control: torch.Tensor) -> torch.Tensor:
        return pack(control)  # (B, h/2 * w/2, 4C), as `QwenImageControlNetPipeline._pack_latents`

    def residuals(self, controlnet, control, hidden_states, timestep, **inputs) -> dict:
        inputs.pop("guidance", None)  # the pipeline calls it without (Qwen-Image has no guidance embedding)
        samples = controlnet(
            hidden_states,
            controlnet_cond=control.to(hidden_states.dtype),
            timestep=timestep,
            return_dict=False,
            **inputs,
        )
        return {"controlnet_block_samples": samples}


class InputControl:
    """Control images as extra input channels (`adapter.control_input`): the input layer `input_layer` of the
    denoiser widened to twice its inputs, the new half zero (diffusers' `train_control_lora_flux.py`), and the
    pipeline that draws with such a denoiser (`FluxControlPipeline`). A widened denoiser is told by its input layer
    reading twice the channels its output layer gives back: one diffusers' LoRA loader widened as it read a control
    LoRA's file is drawn with this pipeline too."""

    image_argument = "control_image"

    def __init__(self, pipeline_class: type, input_layer: str, output_layer: str):
        self.pipeline_class = pipeline_class
        self.input_layer, self.output_layer = input_layer, output_layer

    def reads_control(self, denoiser: torch.nn.Module) -> bool:
        """Whether `denoiser` is widened: its input layer reads twice the channels its output layer gives back."""
        inputs = getattr(denoiser, self.input_layer).in_features
        return inputs == 2 * getattr(denoiser, self.output_layer).out_features

    def widen(self, denoiser: torch.nn.Module) -> None:
        """Double the input layer's inputs, the new half zero, and say so in the config (its `in_channels`, the
        original `out_channels`), as the diffusers script does. Where it is widened already, the config alone:
        diffusers' LoRA loader widens the layer as it reads a control LoRA but leaves the saved config's width."""
        layer = getattr(denoiser, self.input_layer)
        if self.reads_control(denoiser):
            denoiser.register_to_config(in_channels=layer.in_features, out_channels=layer.in_features // 2)
            return
        weight = layer.weight.detach()  # a stored layer's as it computes
        wide = torch.nn.Linear(
            2 * layer.in_features, layer.out_features, layer.bias is not None, weight.device, weight.dtype
        ).requires_grad_(False)
        if not weight.is_meta:
            with torch.no_grad():
                wide.weight.zero_()
                wide.weight[:, : layer.in_features] = weight
                if layer.bias is not None:
                    wide.bias.copy_(layer.bias)
        setattr(denoiser, self.input_layer, wide)
        denoiser.register_to_config(in_channels=2 * layer.in_features, out_channels=layer.in_features)


def init_settings(model_class: type, config: dict) -> dict:
    """The entries of a denoiser's `config` that `model_class` takes (a transformer's `out_channels` is not a
    ControlNet's, and diffusers warns of every key it ignores)."""
    taken = inspect.signature(model_class.__init__).parameters
    return {key: value for key, value in config.items() if key in taken}
