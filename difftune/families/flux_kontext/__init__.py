"""FLUX.1 Kontext: Flux.1's transformer taught to edit, trained on (control, instruction, target) pairs.

Everything but the reference image is Flux.1's (flux.py): the same transformer class, text encoders, files and
objective. The control image's latents (its posterior's mode, as `FluxKontextPipeline` encodes the image it
edits) are packed into tokens after the noisy image's, with position ids whose first coordinate is 1 (the noisy
image's is 0); the prediction for them is dropped. Pairs train with the control at the target's size (as
diffusers' Kontext training script pairs them), and samples are drawn the same way: the control resized to the
sample's size, without the pipeline's snap to Kontext's preferred resolutions, which would draw at about 1 MP.
Targets without a control train and sample as text-to-image, which Kontext also does.
"""

from __future__ import annotations

from diffusers import FluxKontextPipeline

from difftune.data.dataset import resize_and_crop
from difftune.families.common.flow import FlowDrawing
from difftune.families.flux import Flux


class FluxKontextDrawing(FlowDrawing):
    def image_arguments(self, controls: list, height: int | None, width: int | None) -> dict:
        if height is None:  # the pipeline's own size and its snap of the control to Kontext's resolutions
            return {"image": controls[0]} if controls else {}
        # `max_area`: the pipeline rescales any size to this area (by default about 1 MP)
        arguments = {"max_area": height * width}
        if controls:
            [control] = controls
            arguments |= {"image": resize_and_crop(control, (width, height), "center"), "_auto_resize": False}
        return arguments


class FluxKontext(Flux):
    name = "flux_kontext"
    description = "FLUX.1 Kontext edit transformers"
    pipeline_class = FluxKontextPipeline
    controlnet = None  # diffusers' Flux ControlNets are Flux.1 [dev]'s; none reads an edit's references
    input_control = None  # FluxControlPipeline draws Flux.1 [dev]'s widened transformer alone
    pipeline_classes = ("FluxKontextPipeline",)
    file_inputs = (64,)
    max_controls = 1  # FluxKontextPipeline takes one image
    edit_base = True
    drawing = FluxKontextDrawing()


FAMILY = FluxKontext()
