"""The conformance suite: every registered family, on its random-init micro model (`micro.build_pipeline`), passes
the same checks. A new family is a module in difftune/families/ plus its micro-model builder; these tests then
run it, checked against its own diffusers pipeline wherever one can be asked:

- a pipeline folder is read as its family, and a single file where the family has one;
- prompts are encoded exactly (bit for bit) as the family's diffusers pipeline encodes them;
- one training step of LoRA, DoRA and a full fine-tune each changes the model, with a finite loss;
- cached latents and text train as encoding each step does; a stopped run resumes exactly;
- the adapter, loaded by the family's own pipeline (`load_lora_weights`), renders what difftune's merged model
  renders, and `difftune sample` redraws the in-training sample;
- the kohya / ComfyUI layout round-trips bit for bit, and diffusers reads it as the same change.

What differs between families here is only how their pipelines are asked (`PIPELINE_PROMPTS`, `render`), and what a
sound family trains on: tones (toy/tones.py) where the others train on the shapes, `MICRO_SECONDS` long.
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path
from types import SimpleNamespace

import diffusers
import diffusers.pipelines.qwenimage.pipeline_qwenimage_layered as layered_pipeline_module
import gguf
import numpy as np
import pytest
import torch
from diffusers import ClassifierFreeGuidance, GGUFQuantizationConfig
from diffusers.modular_pipelines.anima.before_denoise import AnimaTextConditioningStep
from diffusers.modular_pipelines.anima.encoders import AnimaTextEncoderStep
from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep
from diffusers.modular_pipelines.ltx2.encoders import _get_gemma_prompt_embeds
from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds
from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter, dequantize_gguf_tensor
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.nn.utils import parametrize

from difftune.adapters import export
from difftune.cli import main
from difftune.config import FAMILY_NAMES, Config, ModelConfig
from difftune.data.sound_files import read_sound_file
from difftune.errors import DifftuneError
from difftune.families import FAMILIES, family_of, family_table_markdown, load_components
from difftune.families.ace_step.micro import SAMPLE_RATE as ACE_STEP_RATE
from difftune.families.common.inpainting import InpaintDrawing
from difftune.families.common.layouts import FusedLayout
from difftune.families.common.modular import ModularLoading
from difftune.families.ltx2 import text_tokens
from difftune.families.ltx25 import shortest_clip
from difftune.families.lumina2 import SYSTEM_PROMPT
from difftune.families.qwen_image_edit import set_for_the_call
from difftune.families.qwen_image_layered import LayeredOptions
from difftune.memory import storage
from difftune.models.autoencoders import PATCHED_AUTOENCODERS, downsampling, latent_channels
from difftune.models.components import loads_encoders_first
from difftune.models.dtypes import AS_STORED, PartDtypes
from difftune.toy.tiny import (
    layered_shapes,
    recolor_pairs,
    shape_images,
    write_caption_folder,
    write_layered_folder,
)
from difftune.toy.tones import tone_sounds, write_sound_folder
from difftune.training.checkpoint import complete_checkpoints
from difftune.training.metrics import read_metrics
from difftune.training.plan import plan_memory
from difftune.training.train import train

from conftest import comfyui_applies_as

Q8_0 = gguf.GGMLQuantizationType.Q8_0

NAMES = sorted(FAMILIES)
MICRO_SECONDS = 0.25  # a sound family's windows and samples: 50 latent frames of the micro ACE-Step
LAYERED_SAMPLE_LAYERS = LayeredOptions().layers  # what a layered base's samples split their image into


def _settings(name: str, base: Path, out: Path, **overrides) -> dict:
    """A family's run on the micro base; a layered base's (Qwen-Image-Layered's) on images with their layers, a sound
    base's on tones."""
    family = FAMILIES[name]
    data = {}
    if family.conditioning.trains_layers:
        data = {"data__path": str(write_training_folder(name, out.parent / "layered", shape_images(8, seed=3)))}
    if family.reads_sound:
        data = {
            "data__path": str(write_training_folder(name, out.parent / "tones", shape_images(8, seed=3))),
            "model__family_options": {"seconds": MICRO_SECONDS},
        }
    return {
        "model__base": str(base),
        "train__output_dir": str(out),
        "adapter__text_encoder": bool(family.targets.adapted_text_encoders()),
        **data,
        **overrides,
    }


def write_training_folder(name: str, folder: Path, examples: list[tuple[Image.Image, str]]) -> Path:
    """`examples` (image, caption) as the family trains them: captioned images, for a layered base each caption's
    shape in two layers (`layered_shapes`, its color and shape the caption's), for a sound base tones under the
    captions."""
    if folder.exists():
        return folder
    if FAMILIES[name].reads_sound:
        tones = tone_sounds(len(examples), seed=3, seconds=MICRO_SECONDS, rate=ACE_STEP_RATE)
        write_sound_folder(folder, [(tone, caption) for (tone, _), (_, caption) in zip(tones, examples, strict=True)])
        return folder
    if not FAMILIES[name].conditioning.trains_layers:
        write_caption_folder(folder, examples)
        return folder
    named = [caption.split()[1:] for _, caption in examples]  # "a red circle": its color and shape
    write_layered_folder(
        folder,
        [layered_shapes(1, seed=i, colors=(color,), shapes=(shape,))[0] for i, (color, shape) in enumerate(named)],
    )
    return folder


def _padded_states(states: list) -> dict:
    """Each prompt's states (L_i, D), as pipelines that encode one at its own length give them: padded as one batch,
    with their mask."""
    longest = max(len(state) for state in states)
    return {
        "encoder_hidden_states": torch.stack([torch.nn.functional.pad(s, (0, 0, 0, longest - len(s))) for s in states]),
        "text_mask": torch.stack([torch.arange(longest) < len(s) for s in states]).long(),
    }


# How each family's pipeline encodes prompts: -> the conditioning `encode_prompts` must equal, by name.
def _sd_prompts(pipeline, prompts):
    states, _ = pipeline.encode_prompt(prompts, "cpu", 1, False)
    return {"encoder_hidden_states": states}


def _sdxl_prompts(pipeline, prompts):
    states, _, pooled, _ = pipeline.encode_prompt(prompts, device="cpu", do_classifier_free_guidance=False)
    return {"encoder_hidden_states": states, "pooled_prompt_embeds": pooled}


def _flux_prompts(pipeline, prompts):
    states, pooled, _ = pipeline.encode_prompt(prompts, prompts, device="cpu", max_sequence_length=32)
    return {"encoder_hidden_states": states, "pooled_prompt_embeds": pooled}


def _qwen_prompts(pipeline, prompts):
    states, mask = pipeline.encode_prompt(prompts, device="cpu")
    mask = torch.ones(states.shape[:2], dtype=torch.long) if mask is None else mask
    return {"encoder_hidden_states": states, "text_mask": mask}


def _qwen_image21_prompts(pipeline, prompts):
    states, mask, _ = pipeline.encode_prompt(prompts, device="cpu")
    mask = torch.ones(states.shape[:2], dtype=torch.long) if mask is None else mask
    return {"encoder_hidden_states": states, "text_mask": mask}


def _flux3_prompts(pipeline, prompts):
    """Its text step encodes one prompt a call, at its own window: padded as one batch, the window its mask."""
    states = [
        Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(pipeline.text_encoder, pipeline.tokenizer, prompt)[0]
        for prompt in prompts
    ]
    return _padded_states(states)


def _minimax_h3_prompts(pipeline, prompts):
    """Its text step encodes one prompt a call, at its own length: padded as one batch."""
    states = []
    for prompt in prompts:
        ids = pipeline.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        states.append(get_qwen3vl_prompt_embeds(pipeline.text_encoder, pipeline.processor, ids, {}, 50)[0])
    return _padded_states(states)


def _anima_prompts(pipeline, prompts):
    """Its text step's Qwen3 states and T5 ids, through its conditioning step: the conditioner's output."""
    encoded = AnimaTextEncoderStep.encode_prompt(pipeline, prompts, prepare_unconditional_embeds=False, device="cpu")
    states = AnimaTextConditioningStep._condition_prompt_embeds(
        pipeline,
        *(encoded[name] for name in ("qwen_prompt_embeds", "qwen_attention_mask", "t5_input_ids", "t5_attention_mask")),
        "cpu",
        torch.float32,
        torch.float32,
    )
    mask = encoded["t5_attention_mask"]
    return {"encoder_hidden_states": states, "text_mask": torch.nn.functional.pad(mask, (0, 512 - mask.shape[1]))}


def _z_image_omni_prompts(pipeline, prompts, image=None):
    """Each prompt's segments one after the other: one segment without a reference image (Z-Image's states), three
    with one."""
    states, _ = pipeline.encode_prompt(
        list(prompts), device="cpu", do_classifier_free_guidance=False, num_condition_images=int(image is not None)
    )
    return _padded_states([torch.cat(segments) for segments in states])


def _kandinsky5_prompts(pipeline, prompts):
    """The language model's states after the template's start (padding zeroed: the pipeline draws one prompt a call,
    unpadded) and CLIP's pooled output."""
    states, pooled, cumulative = pipeline.encode_prompt(prompts, device="cpu")
    mask = torch.stack([torch.arange(states.shape[1]) < length for length in cumulative.diff()]).long()
    return {"encoder_hidden_states": states * mask[..., None], "text_mask": mask, "pooled_prompt_embeds": pooled}


def _qwen_edit_prompts(pipeline, prompts, image):
    """One prompt at a time (the edit pipelines take one), each with the control: padded as one batch."""
    states = [pipeline.encode_prompt(prompt, image=image, device="cpu")[0][0] for prompt in prompts]
    return _padded_states(states)


def _sd3_prompts(pipeline, prompts):
    states, _, pooled, _ = pipeline.encode_prompt(
        prompts, prompts, prompts, device="cpu", do_classifier_free_guidance=False, max_sequence_length=32
    )
    return {"encoder_hidden_states": states, "pooled_prompt_embeds": pooled}


def _flux2_prompts(pipeline, prompts):
    states, _ = pipeline.encode_prompt(prompts, device="cpu")
    return {"encoder_hidden_states": states}


def _krea2_prompts(pipeline, prompts):
    states, mask = pipeline.encode_prompt(prompts, device="cpu")
    return {"encoder_hidden_states": states, "text_mask": mask.long()}


def _chroma_prompts(pipeline, prompts):
    states, _, mask, *_ = pipeline.encode_prompt(
        prompts, device="cpu", do_classifier_free_guidance=False, max_sequence_length=32
    )
    return {"encoder_hidden_states": states}


def _z_image_prompts(pipeline, prompts):
    """The pipeline's states come one tensor a prompt, at its own length: padded as one batch. (It writes the templated
    prompts into the list it is given: it gets a copy.)"""
    states, _ = pipeline.encode_prompt(list(prompts), device="cpu", do_classifier_free_guidance=False)
    return _padded_states(states)


def _masked_prompts(pipeline, prompts, **arguments):
    """A pipeline that pads every caption (Lumina 2's to 256 tokens, Sana's to 300) and hands the transformer the mask:
    the padding's states, which the transformer never reads, zeros on both sides."""
    states, mask, *_ = pipeline.encode_prompt(prompts, do_classifier_free_guidance=False, device="cpu", **arguments)
    return {"encoder_hidden_states": states * mask[..., None], "text_mask": mask.long()}


def _hunyuan_video_prompts(pipeline, prompts):
    """The language model's states at every position after the template, the padding's zero on both sides; CLIP's
    pooled output."""
    states, pooled, mask = pipeline.encode_prompt(prompts, device="cpu")
    return {"encoder_hidden_states": states * mask[..., None], "text_mask": mask.long(), "pooled_projections": pooled}


def _lumina2_prompts(pipeline, prompts):
    assert pipeline.system_prompt == SYSTEM_PROMPT
    return _masked_prompts(pipeline, prompts)


def _sana_prompts(pipeline, prompts):
    """With the complex human instruction the pipeline's call passes (its `encode_prompt` reads none unless given;
    Sana-Video's is its own)."""
    instruction = inspect.signature(type(pipeline).__call__).parameters["complex_human_instruction"].default
    return _masked_prompts(pipeline, prompts, complex_human_instruction=instruction)


def _wan_prompts(pipeline, prompts):
    """The pipeline pads every caption's states to `max_sequence_length` with zeros."""
    states, _ = pipeline.encode_prompt(prompts, do_classifier_free_guidance=False, device="cpu")
    return {"encoder_hidden_states": states}


def _ltx2_prompts(pipeline, prompts):
    """Gemma 3's stacked states through the pipeline's connectors, as its call runs them: the video stream's caption
    states and their mask."""
    states, mask, _, _ = pipeline.encode_prompt(prompts, do_classifier_free_guidance=False, device="cpu")
    video, _, video_mask = pipeline.connectors(states, mask, padding_side=pipeline.tokenizer.padding_side)
    return {"encoder_hidden_states": video, "text_mask": video_mask}


def _ltx25_prompts(pipeline, prompts):
    """Its text step's Gemma 4 states (the same function as LTX-2's pipeline) through its connectors: the video
    stream's caption states and their mask."""
    length = text_tokens(pipeline.tokenizer)
    states, mask = _get_gemma_prompt_embeds(pipeline, prompts, length, "cpu", pipeline.text_encoder.dtype)
    video, _, video_mask = pipeline.connectors(states, mask, padding_side=pipeline.tokenizer.padding_side)
    return {"encoder_hidden_states": video, "text_mask": video_mask}


def _hidream_prompts(pipeline, prompts):
    t5, _, llama, _, pooled, _ = pipeline.encode_prompt(prompts, device="cpu", do_classifier_free_guidance=False)
    return {
        "encoder_hidden_states_t5": t5,
        "encoder_hidden_states_llama3": llama.transpose(0, 1),
        "pooled_prompt_embeds": pooled,
    }


def _ernie_image_prompts(pipeline, prompts):
    """The pipeline's states come one tensor a prompt, at its own length: padded as one batch."""
    states = pipeline.encode_prompt(prompts, "cpu")
    return _padded_states(states)


def _hunyuan_prompts(pipeline, prompts):
    """HunyuanImage 2.1's and HunyuanVideo 1.5's: the language model's states after the template and ByT5's glyph
    states, each with its mask (the padding of both zeroed: the transformer masks it out)."""
    states, mask, glyphs, glyph_mask = pipeline.encode_prompt(prompts, device="cpu", batch_size=len(prompts))
    return {
        "encoder_hidden_states": states * mask[..., None],
        "text_mask": mask,
        "encoder_hidden_states_2": glyphs * glyph_mask[..., None],
        "text_mask_2": glyph_mask,
    }


def _ideogram4_prompts(pipeline, prompts):
    """The pipeline left-pads every caption to `max_sequence_length` in its packed sequence (`indicator` marks the
    text): its text features left-aligned, each caption's own."""
    features, _, _, indicator = pipeline.encode_prompt(prompts, 1, 1, 64, "cpu")
    mask = indicator[:, :64] == 3  # LLM_TOKEN_INDICATOR
    longest = int(mask.sum(dim=1).max())
    states = torch.zeros(len(prompts), longest, features.shape[-1])
    for i in range(len(prompts)):
        states[i, : int(mask[i].sum())] = features[i, :64][mask[i]]
    return {
        "encoder_hidden_states": states,
        "text_mask": torch.stack([torch.arange(longest) < m.sum() for m in mask]).long(),
    }


def _ace_step_prompts(pipeline, prompts, lyrics=None, seconds=30.0):
    """The condition encoder's sequence at each caption's tokens (the pipeline pads the batch's shorter captions, whose
    padding's states the mask leaves out), and the silence its context reads, for the default 30 s; `lyrics`, one per
    prompt (none: instrumentals)."""
    batch = len(prompts)
    lyrics = lyrics or [""] * batch
    text, text_mask, lyrics, lyric_mask = pipeline.encode_prompt(prompts, lyrics, "cpu", audio_duration=seconds)
    frames = math.ceil(seconds * pipeline.latents_per_second)
    timbre = pipeline.condition_encoder.silence_latent[:, :frames].expand(batch, -1, -1)
    states, mask = pipeline.condition_encoder(text, text_mask, lyrics, lyric_mask, timbre, torch.arange(batch))
    silence, _ = pipeline.prepare_src_latents("cpu", torch.float32, batch, latent_length=frames)
    return {"encoder_hidden_states": states * mask[..., None], "text_mask": mask.long(), "silence": silence}


# Z-Image's pipeline has its language model read every caption padded to 512 tokens, Ideogram 4's left-padded to its
# `max_sequence_length`; difftune reads to the batch's longest (the causal model's states at the caption are the
# same, for a fraction of the work).
READS_FEWER_TOKENS = {"z_image", "z_image_omni", "ideogram4"}
# Whose pipelines read a micro model's kohya file: diffusers' Flux reader assumes FLUX.1's widths for a single
# block's fused linear1 (tests/test_flux.py checks its double blocks).
KOHYA_READ_BY_PIPELINE = {
    "sd",
    "sd_inpaint",
    "sdxl",
    "sdxl_inpaint",
    "qwen_image",
    "z_image",
    "wan",
    "wan_i2v",
    "wan_vace",
    "minimax_h3",
}
PIPELINE_PROMPTS = {
    "ace_step": _ace_step_prompts,
    "sd": _sd_prompts,
    "sd_inpaint": _sd_prompts,
    "sdxl": _sdxl_prompts,
    "sdxl_inpaint": _sdxl_prompts,
    "flux": _flux_prompts,
    "flux_kontext": _flux_prompts,
    "flux_fill": _flux_prompts,
    "qwen_image": _qwen_prompts,
    "qwen_image21": _qwen_image21_prompts,
    "qwen_image_edit": _qwen_edit_prompts,
    "qwen_image_layered": _qwen_prompts,
    "qwen_image_edit_plus": lambda pipeline, prompts, image: _qwen_edit_prompts(
        pipeline, prompts, [FAMILIES["qwen_image_edit_plus"].prompt_image(image)]
    ),  # at its 384^2
    "z_image": _z_image_prompts,
    "z_image_omni": _z_image_omni_prompts,
    "chroma": _chroma_prompts,
    "sd3": _sd3_prompts,
    "flux2": _flux2_prompts,
    "flux2_klein": _flux2_prompts,
    "flux3": _flux3_prompts,
    "anima": _anima_prompts,
    "kandinsky5": _kandinsky5_prompts,
    "kandinsky5_video": _kandinsky5_prompts,
    "krea2": _krea2_prompts,
    "lumina2": _lumina2_prompts,
    "sana": _sana_prompts,
    "sana_video": _sana_prompts,
    "ltx2": _ltx2_prompts,
    "ltx25": _ltx25_prompts,
    "minimax_h3": _minimax_h3_prompts,
    "ideogram4": _ideogram4_prompts,
    "ernie_image": _ernie_image_prompts,
    "hidream": _hidream_prompts,
    "hunyuan_image": _hunyuan_prompts,
    "hunyuan_video": _hunyuan_video_prompts,
    "hunyuan_video_skyreels_i2v": _hunyuan_video_prompts,
    "hunyuan_video15": _hunyuan_prompts,
    "hunyuan_video15_i2v": _hunyuan_prompts,
    "wan": _wan_prompts,
    "wan_i2v": _wan_prompts,
    "wan_vace": _wan_prompts,
}
CONTROL = recolor_pairs(1, seed=4)[0][0]
MASK = Image.new("L", CONTROL.size, 0)  # an inpainting family's samples: white where it draws
MASK.paste(255, (8, 4, 24, 20))


def _sample_controls(family, folder: Path) -> list[str]:
    """The files a family's sample prompt names where its pipeline draws only from images: an edit's control, an
    inpainting family's image and mask."""
    CONTROL.save(folder / "control.png")
    if not isinstance(family.drawing, InpaintDrawing):
        return [str(folder / "control.png")]
    MASK.save(folder / "mask.png")
    return [str(folder / "control.png"), str(folder / "mask.png")]


# The micro FLUX.2 transformer's 4-step render moves little with its conditioning (another prompt: 0.0065), so a
# 4-step adapter's change is smaller than the other families' too; so does the micro ERNIE-Image's over the same
# latents (0.0038); the micro Qwen-Image 2.1 draws 32 px as 2 x 2 latents at its 16x, four tokens (0.020).
MIN_ADAPTER_EFFECT = {
    "flux2": 0.003,
    "flux2_klein": 0.003,
    "ernie_image": 0.003,
    "qwen_image21": 0.01,
}  # what the families whose pipelines draw only edits edit (32 px)


def their_pipeline(family, folder) -> object:
    """The family's own diffusers pipeline of `folder`, in fp32: a modular one (FLUX.3's) read by its blocks' specs and
    loaded by `load_components`, its steps difftune never runs (the prompt upsampler) left out."""
    if isinstance(family.loading, ModularLoading):
        blocks = getattr(diffusers, family.pipeline_class.default_blocks_name)()
        if family.loading.workflow:  # MiniMax-H3's text-to-video
            blocks = blocks.get_workflow(family.loading.workflow)
        for step in family.loading.left_out_steps:
            blocks.sub_blocks.pop(step)
        pipeline = blocks.init_pipeline(str(folder))
        pipeline.load_components(dtype=torch.float32)
        return pipeline
    # What a family never loads (ERNIE-Image's prompt enhancer, Z-Image Omni's SigLIP2) is not in its folders either.
    return family.pipeline_class.from_pretrained(folder, dtype=torch.float32, **family.fixed_pipeline_arguments)


def render(name: str, pipeline, prompt: str = "a purple circle") -> np.ndarray:
    """The latents of a 4-step 32 px image with classifier-free guidance 3, as each family's pipeline is asked for
    one: what the denoiser draws, before a random micro autoencoder's decoder blurs differences away."""
    pipeline.set_progress_bar_config(disable=True)
    # One sampler for all, as difftune samples: a merged folder is saved with the family's default, a base keeps its own
    # (Wan's UniPC names its shift `flow_shift`; the family's training schedule reads it).
    family = FAMILIES[name]
    pipeline.scheduler = family.drawing.sampler("auto").from_config(
        family.objective.training_scheduler(pipeline.scheduler).config
    )
    arguments = {
        "num_inference_steps": 4,
        "height": 32,
        "width": 32,
        "output_type": "latent",
        "generator": torch.Generator().manual_seed(0),
    }
    if name in ("flux", "qwen_image"):
        arguments |= {"true_cfg_scale": 3.0, "negative_prompt": "", "max_sequence_length": 32}
    elif name == "qwen_image21":  # true classifier-free guidance; no text length to set
        arguments |= {"true_cfg_scale": 3.0, "negative_prompt": ""}
    elif name == "flux2_klein":  # classifier-free guidance, with the empty negative prompt it always uses
        arguments |= {"guidance_scale": 3.0}
    elif name in (
        "chroma",
        "sd3",
        "hidream",
    ):  # no guidance embedding: the pipeline's own scale is classifier-free guidance
        arguments |= {"guidance_scale": 3.0, "negative_prompt": "", "max_sequence_length": 32}
    elif name == "sana":  # classifier-free guidance, at the size asked (not its nearest 1024 px bucket)
        arguments |= {"guidance_scale": 3.0, "negative_prompt": "", "use_resolution_binning": False}
    elif name == "ernie_image":  # classifier-free guidance, the prompt enhancer off (the micro base has none)
        arguments |= {"guidance_scale": 3.0, "negative_prompt": "", "use_pe": False}
    elif name in ("z_image", "z_image_omni", "krea2"):  # their own guidance convention: pos + s (pos - neg)
        arguments |= {"guidance_scale": 2.0, "negative_prompt": "", "max_sequence_length": 32}
    elif family.reads_sound:  # a sound's latents (frames, C), guided as the pipeline guides
        arguments = {key: arguments[key] for key in ("num_inference_steps", "output_type", "generator")}
        return pipeline(prompt=prompt, audio_duration=MICRO_SECONDS, guidance_scale=3.0, **arguments).audios[0].numpy()
    elif name.startswith("wan"):  # a one-frame clip: its latents (C, 1, h, w) without the time axis
        image = {"image": CONTROL} if name == "wan_i2v" else {}  # the image it animates
        return (
            pipeline(
                prompt=prompt,
                num_frames=1,
                guidance_scale=3.0,
                negative_prompt="",
                max_sequence_length=32,
                **image,
                **arguments,
            )
            .frames[0][:, 0]
            .numpy()
        )
    elif name in ("flux3", "anima"):  # a modular pipeline: classifier-free guidance by its guider, images by their name
        pipeline.update_components(guider=ClassifierFreeGuidance(guidance_scale=3.0))
        arguments.pop("output_type")
        return pipeline(prompt=prompt, negative_prompt="", **arguments, output="latents")[0].numpy()
    elif name == "minimax_h3":  # the shortest clip it draws (5 s); guidance-distilled: one pass a step
        arguments.pop("output_type")
        return pipeline(prompt=prompt, num_frames=120, **arguments, output="latents")[0].numpy()
    elif name == "ltx2":  # a one-frame clip: its latents (C, 1, h, w) without the time axis, guidance as difftune's
        # reads the tokenizer alone (its caption length)
        guidance = family.drawing.sampling_arguments(
            SimpleNamespace(tokenizers={"tokenizer": pipeline.tokenizer}), 3.0, ""
        )
        return pipeline(prompt=prompt, num_frames=1, **guidance, **arguments).frames[0][:, 0].numpy()
    elif name == "ltx25":  # the shortest clip its decoder draws, its first latent frame; its guiders are components
        guidance = family.drawing.sampling_arguments(
            SimpleNamespace(tokenizers={"tokenizer": pipeline.tokenizer}), 3.0, ""
        )
        pipeline.update_components(guider=guidance.pop("guider"), audio_guider=guidance.pop("audio_guider"))
        clip = {"num_frames": shortest_clip(pipeline), **guidance}
        return pipeline(prompt=prompt, **clip, **arguments, output="videos")[0][:, 0].numpy()
    elif name == "hunyuan_video":  # a one-frame clip; guidance-distilled: the scale is its embedding's input
        return pipeline(prompt=prompt, num_frames=1, guidance_scale=3.0, **arguments).frames[0][:, 0].numpy()
    elif name == "hunyuan_video_skyreels_i2v":  # a one-frame clip of the image; a second pass guides, the embedding 1
        clip = {"num_frames": 1, "image": CONTROL, "true_cfg_scale": 3.0, "negative_prompt": ""}
        return pipeline(prompt=prompt, guidance_scale=1.0, **clip, **arguments).frames[0][:, 0].numpy()
    elif name == "sana_video":  # a one-frame clip (its `frames`), classifier-free guidance, at the size asked
        return (
            pipeline(
                prompt=prompt,
                frames=1,
                guidance_scale=3.0,
                negative_prompt="",
                use_resolution_binning=False,
                **arguments,
            )
            .frames[0][:, 0]
            .numpy()
        )
    elif name == "kandinsky5_video":  # a one-frame clip: its latents (1, h, w, C), channels last
        return (
            pipeline(prompt=prompt, num_frames=1, guidance_scale=3.0, negative_prompt="", **arguments).frames[0].numpy()
        )
    elif name == "kandinsky5":  # its own list of sizes set to the one drawn; the image (here latents) as `image`
        pipeline.resolutions = [(32, 32)]
        return pipeline(prompt=prompt, guidance_scale=3.0, negative_prompt="", **arguments).image[0].numpy()
    elif name.startswith("hunyuan_video15"):  # a one-frame clip, guided by its guider
        pipeline.guider = ClassifierFreeGuidance(guidance_scale=3.0)
        image = {}
        if name == "hunyuan_video15_i2v":  # no size: it draws its image's, the nearest of its target size's
            pipeline.target_size = arguments.pop("height")
            image = {"image": CONTROL.resize((arguments.pop("width"), pipeline.target_size))}
        return pipeline(prompt=prompt, num_frames=1, negative_prompt="", **image, **arguments).frames[0][:, 0].numpy()
    elif name == "hunyuan_image":  # classifier-free guidance by its guider (the micro base keeps none)
        pipeline.guider = ClassifierFreeGuidance(guidance_scale=3.0)
        arguments |= {"negative_prompt": ""}
    elif name == "ideogram4":  # asymmetric guidance: w pos + (1 - w) neg, neg from its unconditional transformer
        arguments |= {"guidance_scale": 3.0, "guidance_schedule": None, "max_sequence_length": 64}
    elif name == "flux_kontext":  # guidance-distilled, as Kontext [dev]: the scale is its guidance embedding's input
        arguments |= {"guidance_scale": 3.0, "max_sequence_length": 32, "max_area": 32 * 32}
    elif family.conditioning.trains_layers:  # the image it splits, at the drawn size as difftune samples it
        # Its latent output fails (diffusers returns an unset name): the last step's latents, from its callback.
        last = {}

        def keep_latents(pipeline, step, timestep, tensors):
            last["latents"] = tensors["latents"]
            return tensors

        with set_for_the_call(layered_pipeline_module, "calculate_dimensions", lambda _, ratio: (32, 32)):
            pipeline(
                prompt=prompt,
                image=CONTROL.convert("RGBA"),
                layers=LAYERED_SAMPLE_LAYERS,
                resolution=640,
                true_cfg_scale=3.0,
                negative_prompt=" ",
                callback_on_step_end=keep_latents,
                num_inference_steps=4,
                generator=torch.Generator().manual_seed(0),
                output_type="np",
            )
        return last["latents"][0].numpy()
    elif isinstance(family.drawing, InpaintDrawing):  # the image it paints into where the mask is white
        length = {"max_sequence_length": 32} if name == "flux_fill" else {"negative_prompt": "", "strength": 1.0}
        arguments |= {"image": CONTROL, "mask_image": MASK, "guidance_scale": 3.0, **length}
    elif family.drawing.needs_controls_to_draw:  # the control at the drawn size, as difftune trains and samples it
        with family.sized_controls(32 * 32):
            return (
                pipeline(prompt=prompt, image=CONTROL, true_cfg_scale=3.0, negative_prompt=" ", **arguments)
                .images[0]
                .numpy()
            )
    else:
        arguments |= {"guidance_scale": 3.0}
    return pipeline(prompt=prompt, **arguments).images[0].numpy()


def test_every_family_module_has_a_micro_model_and_a_pipeline_reference():
    assert set(PIPELINE_PROMPTS) == set(FAMILIES)


def test_the_readme_family_table_is_the_registrys():
    """The README's table and the families page's are the registry's, each linking to the pages from where it is."""
    repo = Path(__file__).parents[1]
    for page, pages in (("README.md", "docs/families/"), ("docs/families/index.md", "")):
        text = (repo / page).read_text(encoding="utf-8")
        table = text.split("<!-- families:start -->")[1].split("<!-- families:end -->")[0].strip()
        assert table == family_table_markdown(repo / "models", pages=pages), "run `python scripts/update_docs.py`"
    documented = (repo / "README.md").read_text(encoding="utf-8").split("<!-- families:start -->")[1]
    # Every family's name links to its page for the real model: its own, or the one it names (an image-to-video
    # family's is its text-to-video family's). Every page is some family's.
    pages = {path.stem for path in (repo / "docs" / "families").glob("*.md")} - {"index"}
    assert pages == {family.page for family in FAMILIES.values()}
    cells = {name: f"| [`{name}`](docs/families/{family.page}.md) |" for name, family in FAMILIES.items()}
    rows = {name: next(row for row in documented.splitlines() if row.startswith(cells[name])) for name in FAMILIES}
    assert all(
        ("textual inversion" in rows[name]) == family.targets.trains_embeddings for name, family in FAMILIES.items()
    )


@pytest.mark.parametrize("name", NAMES)
def test_adapters_a_family_cannot_use_are_refused_before_any_work(name):
    """Text-encoder adapters its pipeline's LoRA loader would drop, textual inversion where it is not built, and
    LoHa/LoKr in a kohya layout that fuses q, k and v: refused by name, and only there."""
    family = FAMILIES[name]

    def problems(**adapter) -> str:
        export = {"format": "kohya"} if adapter.get("kind") in ("loha", "lokr") else {}
        try:
            family.check_config(Config(adapter=adapter, export=export))
        except DifftuneError as err:
            return str(err)
        return ""

    dropped = "adapter.text_encoder: " in problems(kind="lora", text_encoder=True)
    assert dropped == (not family.targets.adapted_text_encoders())
    assert (
        "textual inversion is not built" in problems(kind="embedding", text_encoder=False)
    ) != family.targets.trains_embeddings
    assert ("have no fused form" in problems(kind="loha", text_encoder=False)) == isinstance(family.layout, FusedLayout)
    assert problems(kind="lora", text_encoder=False) == ""


def test_every_family_module_is_registered_and_complete():
    """A family is one folder in difftune/families/: found by its name, registered as its `FAMILY`, accepted as
    `model.family`, and naming everything the rest of difftune asks of it for each of its parts."""
    folders = {p.parent.name for p in (Path(__file__).parents[1] / "difftune" / "families").glob("*/__init__.py")}
    assert set(FAMILIES) == set(FAMILY_NAMES) == folders - {"common"}
    for name, family in FAMILIES.items():
        ModelConfig(family=name)  # accepted by the schema
        # Files name every part an adapter can hold (a text encoder no loader reads may have none).
        assert (
            set(family.targets.adapter_parts())
            <= set(family.layout.kohya_prefixes)
            == set(family.targets.default_targets)
            <= set(family.targets.parts())
        )
        assert len(set(family.layout.kohya_prefixes.values())) == len(family.layout.kohya_prefixes), name
        token_readers = [
            name for name in family.text_encoder_names if name not in family.conditioning.reference_encoder_names
        ]
        assert [encoder for encoder, _ in family.conditioning.encoder_tokenizers()] == token_readers, name
        assert {tokenizer for _, tokenizer in family.conditioning.encoder_tokenizers()} <= set(
            family.tokenizer_names
        ), name
        # Its pipeline is one it reads, or a subclass of one (HunyuanImage's and HunyuanVideo 1.5's add a LoRA
        # loader, saved as their parent).
        assert any(cls.__name__ in family.pipeline_classes for cls in family.pipeline_class.__mro__), name


def test_each_family_reads_itself_through_the_roles_it_inherits():
    """A family's roles are its own copies, bound to it, though a variant inherits its parent's role classes: the edit
    family's refusal of a text-encoder adapter names its own pipeline's LoRA loader, the parent's its own."""
    config = Config(adapter={"text_encoder": True})
    for name, family in FAMILIES.items():
        for role in ("loading", "conditioning", "drawing", "targets"):
            assert getattr(family, role).family is family, (name, role)
    parent, variant = FAMILIES["qwen_image"], FAMILIES["qwen_image_edit"]
    assert type(variant.targets) is type(parent.targets) and variant.targets is not parent.targets
    assert any("QwenImageEditPipeline's LoRA loader" in problem for problem in variant.targets.adapter_problems(config))
    assert not any("QwenImageEditPipeline" in problem for problem in parent.targets.adapter_problems(config))


def _single_file(name: str, base: Path):
    """The micro base's components and its single file's tensors; the test is skipped for a family that writes no
    single file (SD3, Krea 2): nothing to read back."""
    components = load_components(ModelConfig(base=str(base)))
    try:
        return components, FAMILIES[name].layout.to_single_file(components)
    except DifftuneError:
        pytest.skip(f"{name} has no single-file layout")


@pytest.mark.parametrize("name", NAMES)
def test_a_folder_and_a_single_file_are_read_as_the_family(name, micro_base, tmp_path):
    family, base = FAMILIES[name], micro_base(name)
    assert family_of(ModelConfig(base=str(base))) is family
    components, tensors = _single_file(name, base)
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    # The folder it came from names the pipeline where one transformer's keys serve several (Qwen-Image and its edits).
    assert family_of(ModelConfig(base=str(path), single_file_config=str(base))) is family
    again = load_components(ModelConfig(base=str(path), single_file_config=str(base)))
    for (key, value), other in zip(
        components.denoiser.state_dict().items(), again.denoiser.state_dict().values(), strict=True
    ):
        assert torch.equal(value, other), key


@pytest.mark.parametrize("name", [name for name in NAMES if FAMILIES[name].layout.denoiser_file_key])
def test_an_all_in_one_files_denoiser_is_read_and_its_other_parts_left_out(name, micro_base, tmp_path):
    """ComfyUI's checkpoints put the denoiser under `model.diffusion_model.` beside the text encoders and
    autoencoder."""
    base = micro_base(name)
    components, tensors = _single_file(name, base)
    others = {
        "text_encoders.clip_l.transformer.text_model.final_layer_norm.weight": torch.ones(4),
        "first_stage_model.decoder.conv_in.bias": torch.zeros(4),
    }
    save_file(
        {f"model.diffusion_model.{key}": value for key, value in tensors.items()} | others, tmp_path / "all.safetensors"
    )
    again = load_components(ModelConfig(base=str(tmp_path / "all.safetensors"), single_file_config=str(base)))
    for (key, value), other in zip(
        components.denoiser.state_dict().items(), again.denoiser.state_dict().values(), strict=True
    ):
        assert torch.equal(value, other), key


@pytest.mark.parametrize("name", NAMES)
def test_an_fp8_single_file_is_read_as_a_base(name, micro_base, tmp_path):
    """ComfyUI's and kohya's `*_fp8_e4m3fn.safetensors`: every weight cast to e4m3. Read as the fp8 values, which
    `model.weight_dtype = "fp8"` stores again without loss; ComfyUI's scaled fp8 files are refused by name."""
    base = micro_base(name)
    components, tensors = _single_file(name, base)
    path = tmp_path / "model_fp8_e4m3fn.safetensors"
    save_file(
        {key: value.to(torch.float8_e4m3fn) if value.is_floating_point() else value for key, value in tensors.items()},
        path,
    )
    again = load_components(ModelConfig(base=str(path), single_file_config=str(base)))
    for (key, value), other in zip(
        components.denoiser.state_dict().items(), again.denoiser.state_dict().values(), strict=True
    ):
        assert other.dtype == torch.float32 and torch.equal(other, value.to(torch.float8_e4m3fn).float()), key
    linear = next(m for m in again.denoiser.modules() if type(m) is torch.nn.Linear)
    weight = linear.weight.detach().clone()
    storage.store_frozen_layers(linear.requires_grad_(False), torch.float8_e4m3fn)
    assert torch.equal(linear.weight, weight)


def _write_scaled_fp8(
    tensors: dict[str, torch.Tensor], path: Path, products_path: Path, products_dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """`tensors` as ComfyUI's `*_fp8_scaled.safetensors` at `path` (each matrix in e4m3 divided by its float
    `.scale_weight`, a `scaled_fp8` marker), and at `products_path` the weights ComfyUI reads from it (e4m3 times its
    scale, in `products_dtype`); returns the scaled file's tensors."""
    scaled, products = {"scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}, {}
    for key, value in tensors.items():
        if key.endswith(".weight") and value.dim() >= 2:
            scale = value.abs().max().float() / 448  # ComfyUI's scales are any float, not a power of two
            scaled[key], scaled[key.removesuffix(".weight") + ".scale_weight"] = (
                (value / scale).to(torch.float8_e4m3fn),
                scale,
            )
            products[key] = (scaled[key].float() * scale).to(products_dtype)  # comfy's weight * scale_weight
        else:
            scaled[key] = products[key] = value
    save_file(scaled, path)
    save_file(products, products_path)
    return scaled


@pytest.mark.parametrize("name", NAMES)
def test_a_comfyui_scaled_fp8_file_is_read_with_its_scales(name, micro_base, tmp_path):
    """ComfyUI's `*_fp8_scaled.safetensors`: each weight stored in e4m3 divided by its `.scale_weight`, a `scaled_fp8`
    marker key. Read as ComfyUI reads it (the e4m3 values times their scale): the same model as the file holding
    those products. A run that stores the denoiser in fp8 keeps the file's e4m3 bytes where they lie (no copy), each
    computed as the product rounded to the compute dtype. A family whose single files diffusers reads whole
    (all-in-one checkpoints) refuses it by name: diffusers' reader would leave the scales out."""
    base = micro_base(name)
    _, tensors = _single_file(name, base)
    scaled = _write_scaled_fp8(tensors, tmp_path / "model_fp8_scaled.safetensors", tmp_path / "products.safetensors")
    scaled_file = ModelConfig(base=str(tmp_path / "model_fp8_scaled.safetensors"), single_file_config=str(base))
    if not FAMILIES[name].loading.reads_denoiser_files:
        with pytest.raises(
            DifftuneError, match=r"fp8_scaled\.safetensors: a ComfyUI scaled fp8 file .*whole, .*weight_dtype = \"fp8\""
        ):
            load_components(scaled_file)
        return
    read = load_components(scaled_file)
    expected = load_components(ModelConfig(base=str(tmp_path / "products.safetensors"), single_file_config=str(base)))
    pairs = zip(read.denoiser.state_dict().items(), expected.denoiser.state_dict().values(), strict=True)
    for (key, value), other in pairs:
        assert torch.equal(value, other), key
    assert any(key.endswith(".scale_weight") for key in scaled)

    fp8_run = PartDtypes(
        denoiser=AS_STORED, vae=torch.bfloat16, others=torch.bfloat16, stored_fp8_computes_in=torch.bfloat16
    )
    kept = load_components(scaled_file, fp8_run).denoiser
    file_ranges = storage.file_mappings()
    layers = [(name, layer) for name, layer in kept.named_modules() if parametrize.is_parametrized(layer, "weight")]
    assert len(layers) >= 4
    in_file = 0  # layers whose bytes are the file's own
    for layer_name, layer in layers:
        address = layer.parametrizations.weight.original.data_ptr()
        in_file += any(low <= address < high for low, high in file_ranges)
        product = expected.denoiser.get_submodule(layer_name).weight.detach()
        assert layer.weight.dtype == torch.bfloat16 and torch.equal(layer.weight, product.to(torch.bfloat16)), (
            layer_name
        )
    assert in_file >= len(layers) - _copied_layers(FAMILIES[name], [layer_name for layer_name, _ in layers])


def _copied_layers(family, names: list[str]) -> int:
    """How many of a single file's layers (by diffusers name) are read as copies, not the file's bytes: the final
    modulation, whose halves the original layout swaps, and each block layer whose halves it swaps (MiniMax-H3's
    SwiGLU input)."""
    layout = family.layout
    swapped = {
        module
        for _, layers in getattr(layout, "original_blocks", {}).values()
        for layer in getattr(layout, "swapped_block_layers", ())
        for module in layers.get(layer, [])
    }
    return 2 + sum(any(name.endswith(f".{module}") for module in swapped) for name in names)


def test_a_scaled_fp8_file_trains_in_fp8_as_its_products_in_bf16(micro_base, make_config, tmp_path):
    """A run storing the denoiser in fp8 keeps a ComfyUI scaled file's e4m3 weights and scales: it trains as the
    file's products (rounded to bf16) do without storage, loss for loss and adapter for adapter."""
    base = micro_base("flux")
    _, tensors = _single_file("flux", base)
    _write_scaled_fp8(
        tensors, tmp_path / "model_fp8_scaled.safetensors", tmp_path / "products.safetensors", torch.bfloat16
    )
    results = {}
    for name, weight_dtype in (("model_fp8_scaled", "fp8"), ("products", "bf16")):
        settings = _settings(
            "flux",
            base,
            tmp_path / name,
            model__base=str(tmp_path / f"{name}.safetensors"),
            model__single_file_config=str(base),
            model__weight_dtype=weight_dtype,
            train__mixed_precision="bf16",
            train__max_steps=2,
            sample__prompts=[],
            adapter__text_encoder=False,
            cache__latents=True,
            cache__text=True,
            cache__dir=str(tmp_path / "cache"),
        )
        config = make_config(**settings)
        assert loads_encoders_first(config, FAMILIES["flux"])  # a denoiser's file loads after the caches are filled
        results[name] = train(config)
    assert results["model_fp8_scaled"].losses == results["products"].losses
    fp8, bf16 = (load_file(tmp_path / name / "pytorch_lora_weights.safetensors") for name in results)
    assert fp8.keys() == bf16.keys() and all(torch.equal(fp8[key], bf16[key]) for key in fp8)


def _write_gguf(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A GGUF file as city96's converter writes one: weights whose rows hold whole Q8_0 blocks quantized, vectors in
    f32, the rest in f16."""
    writer = gguf.GGUFWriter(str(path), arch="difftune-test")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in tensors.items():
        data = value.float().numpy()
        if value.dim() >= 2 and value.shape[-1] % 32 == 0:
            writer.add_tensor(key, gguf.quants.quantize(data, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(key, data.astype(np.float32 if value.dim() <= 1 else np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_values(path: Path) -> dict[str, torch.Tensor]:
    """A GGUF file's weights as its layers compute with them: gguf's own dequantization, each product of an fp16
    block scale and an int8 rounded to fp16, as diffusers' dequantization computes it."""
    values = {}
    for tensor in gguf.GGUFReader(path).tensors:
        value = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        values[tensor.name] = torch.from_numpy(
            np.array(value.astype(np.float16) if tensor.tensor_type == Q8_0 else value)
        ).float()
    return values


# Families whose published widths diffusers' GGUF reader writes into its converter (FLUX.1's 3072, Lumina 2's 2304):
# their micro files are checked against gguf's own dequantization instead.
READ_AT_PUBLISHED_WIDTHS_ONLY = {
    "flux",
    "flux_kontext",
    "flux_fill",
    "chroma",
    "lumina2",
    "hunyuan_video",
    "hunyuan_video_skyreels_i2v",
}
# Families whose transformer class diffusers' single-file reader does not take (`FromOriginalModelMixin`'s list):
# checked against gguf's own dequantization alone.
NO_DIFFUSERS_SINGLE_FILE_READER = {
    "ace_step",
    "kandinsky5",
    "kandinsky5_video",
    "hunyuan_video15",
    "hunyuan_video15_i2v",
    "hunyuan_image",
}


@pytest.mark.parametrize("name", NAMES)
def test_a_gguf_file_is_read_as_diffusers_and_gguf_read_it(name, micro_base, tmp_path):
    """city96's GGUF quantizations as a base: each linear layer keeps its Q8_0 blocks where the file lies (mapped,
    no copy) and computes with them dequantized, as diffusers' GGUF reader loads the file (byte for byte, where it
    reads these widths) and as gguf's own dequantization gives; other quantized tensors dequantized. A family whose
    single files hold the whole pipeline refuses it by name."""
    family, base = FAMILIES[name], micro_base(name)
    components, tensors = _single_file(name, base)
    path = tmp_path / "model-Q8_0.gguf"
    _write_gguf(tensors, path)
    config = ModelConfig(base=str(path), single_file_config=str(base))
    if not family.loading.reads_denoiser_files:
        with pytest.raises(
            DifftuneError, match=r"Q8_0\.gguf: a GGUF file of a family whose single files hold the whole"
        ):
            load_components(config)
        return
    ours = load_components(config).denoiser
    layers = {name: layer for name, layer in ours.named_modules() if isinstance(layer, GGUFLinear)}
    assert len(layers) >= 10
    file_ranges = storage.file_mappings()
    in_file = sum(any(low <= layer.weight.data_ptr() < high for low, high in file_ranges) for layer in layers.values())
    assert in_file >= len(layers) - _copied_layers(family, list(layers))

    dequantized = family.layout.diffusers_names(_gguf_values(path))
    for key, value in ours.state_dict().items():
        value = dequantize_gguf_tensor(value) if isinstance(value, GGUFParameter) else value
        assert torch.equal(value.float(), dequantized[key]), key
    if name in READ_AT_PUBLISHED_WIDTHS_ONLY | NO_DIFFUSERS_SINGLE_FILE_READER:
        return
    theirs = family.denoiser_class.from_single_file(
        str(path),
        config=str(base),
        subfolder=family.denoiser_part(family.options(config)),
        quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32),
        torch_dtype=torch.float32,
    )
    their_layers = {name for name, layer in theirs.named_modules() if isinstance(layer, GGUFLinear)}
    assert their_layers == set(layers)
    theirs = theirs.state_dict()
    for key, value in ours.state_dict().items():
        if isinstance(value, GGUFParameter):
            assert torch.equal(value, theirs[key]) and value.quant_type == theirs[key].quant_type, key
        else:  # where diffusers hands a layer that is not linear its blocks, their values
            assert torch.equal(value, dequantize_gguf_tensor(theirs[key]).to(value.dtype)), key


def test_a_gguf_base_trains_as_its_dequantized_weights(micro_base, make_config, tmp_path):
    """A LoRA on a GGUF base trains as on a file of the weights its blocks hold, loss for loss."""
    base = micro_base("flux")
    _, tensors = _single_file("flux", base)
    _write_gguf(tensors, tmp_path / "model-Q8_0.gguf")
    save_file(_gguf_values(tmp_path / "model-Q8_0.gguf"), tmp_path / "dequantized.safetensors")
    results = {}
    for name in ("model-Q8_0.gguf", "dequantized.safetensors"):
        settings = _settings(
            "flux",
            base,
            tmp_path / f"out-{name}",
            model__base=str(tmp_path / name),
            model__single_file_config=str(base),
            train__max_steps=2,
            sample__prompts=[],
            adapter__text_encoder=False,
            cache__latents=True,
            cache__text=True,
            cache__dir=str(tmp_path / "cache"),
        )
        config = make_config(**settings)
        assert loads_encoders_first(config, FAMILIES["flux"])
        results[name] = train(config)
    torch.testing.assert_close(
        results["model-Q8_0.gguf"].losses, results["dequantized.safetensors"].losses, rtol=1e-5, atol=0
    )
    gguf_adapter, plain = (load_file(tmp_path / f"out-{name}" / "pytorch_lora_weights.safetensors") for name in results)
    assert gguf_adapter.keys() == plain.keys()
    for key, value in gguf_adapter.items():
        torch.testing.assert_close(value, plain[key], rtol=1e-4, atol=1e-6, msg=key)


def test_a_gguf_base_is_planned_as_its_blocks_and_what_would_rewrite_them_is_refused(micro_base, make_config, tmp_path):
    base = micro_base("flux")
    _, tensors = _single_file("flux", base)
    _write_gguf(tensors, tmp_path / "model-Q8_0.gguf")
    settings = _settings(
        "flux",
        base,
        tmp_path / "out",
        model__base=str(tmp_path / "model-Q8_0.gguf"),
        model__single_file_config=str(base),
    )
    planned = plan_memory(make_config(**settings), "cpu")
    held = sum(int(tensor.n_bytes) for tensor in gguf.GGUFReader(tmp_path / "model-Q8_0.gguf").tensors)
    assert planned.device["frozen denoiser weights"] == held
    assert held < 0.4 * sum(value.numel() * 4 for value in tensors.values())  # Q8_0 blocks, not fp32
    for setting, value in (
        ("adapter__kind", "dora"),
        ("model__weight_dtype", "fp8"),
        ("model__offload_blocks", 1),
        ("adapter__init", "pissa"),
    ):
        with pytest.raises(
            DifftuneError,
            match=r"model-Q8_0\.gguf: a GGUF base keeps its weights in their quantized "
            r"blocks.*would store, offload, rewrite or train those weights",
        ):
            make_config(**settings, **{setting: value})


@pytest.mark.parametrize("name", NAMES)
def test_the_autoencoder_is_read_as_the_pipeline_reads_it(name, micro_base):
    components = load_components(ModelConfig(base=str(micro_base(name))))
    pipeline = components.pipeline()
    # FLUX.2's latents are read patched 2x2: a patched latent pixel is twice the autoencoder's own factor, which
    # ERNIE-Image's pipeline counts in its `vae_scale_factor` already.
    patched = 2 if isinstance(components.vae, PATCHED_AUTOENCODERS) and name != "ernie_image" else 1
    # The video pipelines (Wan's, LTX-2's) name their spatial factor apart from the temporal one; a sound pipeline
    # counts latent frames a second.
    spatial = (
        getattr(pipeline, "vae_scale_factor_spatial", None)
        or getattr(pipeline, "vae_spatial_compression_ratio", None)
        or getattr(pipeline, "vae_scale_factor", None)
        or pipeline.sample_rate / pipeline.latents_per_second
    )
    assert downsampling(components.vae) == spatial * patched
    assert latent_channels(components.vae) == FAMILIES[name].latent_channels(components.denoiser)


@pytest.mark.parametrize("name", NAMES)
def test_prompts_are_encoded_as_the_family_pipeline_encodes_them(name, micro_base):
    family = FAMILIES[name]
    components = load_components(ModelConfig(base=str(micro_base(name))))
    prompts = ["a red circle", "a blue square with a longer caption"]
    controls = [[CONTROL]] * len(prompts) if family.conditioning.prompts_see_controls else None
    with torch.no_grad():
        expected = PIPELINE_PROMPTS[name](components.pipeline(), prompts, *([CONTROL] if controls else []))
        ours = family.conditioning.encode_prompts(
            components, family.conditioning.tokenize(components.tokenizers, prompts, controls)
        )
    for key, value in expected.items():
        # Padded to the family's fixed text length where the pipeline pads to the batch's longest: the rest is padding.
        got = ours[key][:, : value.shape[1]]
        if controls or name in READS_FEWER_TOKENS:  # other matrix shapes: products round otherwise
            torch.testing.assert_close(got, value.to(got.dtype), rtol=0, atol=1e-5)
        else:
            assert torch.equal(got, value.to(got.dtype)), key
        assert not ours[key][:, value.shape[1] :].any(), key


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", ["lora", "dora", "none"])  # none: a full fine-tune
def test_one_training_step_of_each_kind_changes_the_model(name, kind, micro_base, make_config, tmp_path):
    settings = _settings(
        name, micro_base(name), tmp_path / kind, adapter__kind=kind, train__max_steps=1, sample__prompts=[]
    )
    result = train(make_config(**settings))
    assert len(result.losses) == 1 and np.isfinite(result.losses[0])
    base = load_components(ModelConfig(base=str(micro_base(name)))).denoiser.state_dict()
    trained = result.components.denoiser
    if kind == "none":
        changed = [key for key, value in trained.state_dict().items() if not torch.equal(value, base[key])]
    else:
        changed = [n for n, p in trained.named_parameters() if "lora_B" in n and p.abs().sum() > 0]
    assert changed


@pytest.mark.parametrize("name", NAMES)
def test_cached_latents_and_text_train_as_encoding_each_step(name, micro_base, make_config, tmp_path):
    settings = _settings(name, micro_base(name), tmp_path, train__max_steps=3, adapter__text_encoder=False)
    plain = train(make_config(**settings | {"train__output_dir": str(tmp_path / "plain")}))
    cached = train(
        make_config(
            **settings
            | {
                "train__output_dir": str(tmp_path / "cached"),
                "cache__latents": True,
                "cache__text": True,
                "cache__dir": str(tmp_path / "cache"),
            }
        )
    )
    assert all(encoder is None for encoder in cached.components.text_encoders.values())  # released
    assert cached.losses == pytest.approx(plain.losses, rel=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_offloaded_blocks_train_as_kept_ones(name, micro_base, make_config, tmp_path):
    """`model.offload_blocks`: the family names its denoiser's blocks, and training with half of them (at least one)
    in host memory is training with all of them in place, bit for bit. The captions are of one length: FLUX.3 and
    Kandinsky 5 denoise a batch's captions of different lengths in several calls a step, and with a block offloaded
    their adapters then differ in the last bits (Kandinsky 5's by 4e-7; likely the order autograd sums the calls'
    gradients in, not pinned down)."""
    blocks = FAMILIES[name].offloadable_blocks(load_components(ModelConfig(base=str(micro_base(name)))).denoiser)
    assert blocks
    data = write_training_folder(
        name, tmp_path / "one-length", [(image, "a red circle") for image, _ in shape_images(8, seed=3)]
    )
    settings = _settings(name, micro_base(name), tmp_path, train__max_steps=2, sample__prompts=[], data__path=str(data))
    in_place = train(make_config(**settings | {"train__output_dir": str(tmp_path / "in-place")}))
    offloaded = train(
        make_config(
            **settings
            | {"train__output_dir": str(tmp_path / "offloaded"), "model__offload_blocks": max(1, len(blocks) // 2)}
        )
    )
    assert offloaded.losses == in_place.losses
    expected = load_file(in_place.trained_path)
    assert all(torch.equal(value, expected[key]) for key, value in load_file(offloaded.trained_path).items())


@pytest.mark.parametrize("name", NAMES)
def test_a_stopped_run_resumes_exactly(name, micro_base, make_config, tmp_path):
    """Stopped at step 2, resumed to 4: the same losses and weights as an uninterrupted run, bit for bit (adapter
    dropout on, so the global RNG state must come back too)."""
    settings = _settings(
        name,
        micro_base(name),
        tmp_path,
        train__max_steps=4,
        checkpoint__every_steps=2,
        adapter__dropout=0.1,
        sample__prompts=[],
    )
    train(make_config(**settings | {"train__output_dir": str(tmp_path / "whole")}))
    parts = str(tmp_path / "parts")
    train(make_config(**settings | {"train__output_dir": parts, "train__max_steps": 2}))
    train(make_config(**settings | {"train__output_dir": parts}), resume="auto")
    losses = [{row["step"]: row["loss"] for row in read_metrics(tmp_path / run)} for run in ("whole", "parts")]
    assert losses[0] == losses[1] and list(losses[1]) == [1, 2, 3, 4]
    whole, resumed = (load_file(tmp_path / run / "pytorch_lora_weights.safetensors") for run in ("whole", "parts"))
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[key], resumed[key]) for key in whole)
    assert [p.name for p in complete_checkpoints(tmp_path / "parts")] == ["step-000002", "step-000004"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_the_family_pipeline_renders_the_adapter_as_our_merged_model(name, kind, micro_base, make_config, tmp_path):
    """Trained on every part the family's LoRA loader reads: its pipeline's own `load_lora_weights` renders what the
    base merged by difftune renders; the parity check agrees for both layouts; `difftune sample` redraws the
    in-training sample. A LoRA's kohya layout loads in the pipeline too, as the same change (diffusers drops a
    kohya file's DoRA magnitudes, saying so)."""
    family, base = FAMILIES[name], micro_base(name)
    controls = _sample_controls(family, tmp_path)
    edit = (
        family.drawing.needs_controls_to_draw
    )  # its samples edit the control, with a blank negative prompt as its pipeline's
    settings = _settings(
        name,
        base,
        tmp_path / "run",
        adapter__kind=kind,
        train__max_steps=4,
        optim__learning_rate=2e-2,
        sample__prompts=[{"prompt": "a purple circle", "controls": controls} if edit else "a purple circle"],
        sample__steps=4,
        sample__guidance_scale=3.0,
        sample__negative_prompt=" " if edit else "",
    )
    result = train(make_config(**settings))
    assert {key.split(".")[0] for key in load_file(result.trained_path)} == set(family.targets.adapter_parts())
    parity = json.loads((result.trained_path.parent / "parity.json").read_text())
    assert all(layout["max_pixel_difference"] <= 2 for layout in parity["layouts"].values()), parity

    theirs = their_pipeline(family, base)
    theirs.load_lora_weights(str(result.trained_path.parent), weight_name=result.trained_path.name)
    export.merge_into_folder(str(base), [(result.trained_path, 1.0)], tmp_path / "merged")
    merged = their_pipeline(family, tmp_path / "merged")
    untouched = their_pipeline(family, base)
    ours = render(name, merged)
    agreement = np.abs(ours - render(name, theirs)).max()
    assert agreement < 2e-3
    if kind == "lora" and name in KOHYA_READ_BY_PIPELINE:
        kohya = export.convert_adapter(result.trained_path, tmp_path / "kohya.safetensors", "kohya")
        theirs_kohya = their_pipeline(family, base)
        theirs_kohya.load_lora_weights(str(kohya))
        assert np.abs(ours - render(name, theirs_kohya)).max() < 2e-3
    effect = np.abs(ours - render(name, untouched)).max()  # the adapter changes the image, far beyond the agreement
    assert effect > MIN_ADAPTER_EFFECT.get(name, 0.05) and effect > 20 * agreement, (effect, agreement)

    edit_arguments = [*(f"--control={path}" for path in controls), "--negative-prompt", " "] if edit else []
    samples = result.trained_path.parent / "samples"
    assert (
        main(
            [
                "sample",
                "--base",
                str(base),
                "--adapter",
                str(result.trained_path),
                "--prompt",
                "a purple circle",
                "--steps",
                "4",
                "--guidance-scale",
                "3.0",
                "--resolution",
                "32",
                "--out",
                str(tmp_path / "cli"),
                *edit_arguments,
            ]
        )
        == 0
    )
    if family.reads_sound:  # 16-bit levels
        drawn, in_training = (
            read_sound_file(folder / "000.flac").samples * 32768 for folder in (tmp_path / "cli", samples)
        )
    else:
        drawn, in_training = (
            np.asarray(Image.open(folder / "000.png"), dtype=np.int16) for folder in (tmp_path / "cli", samples)
        )
    assert np.abs(drawn - in_training).max() <= 2


@pytest.mark.parametrize("name", NAMES)
def test_the_kohya_layout_round_trips_bit_for_bit(name, micro_base, make_config, tmp_path):
    settings = _settings(
        name, micro_base(name), tmp_path / "run", adapter__kind="dora", train__max_steps=2, sample__prompts=[]
    )
    trained = train(make_config(**settings)).trained_path
    kohya = export.convert_adapter(trained, tmp_path / "kohya.safetensors", "kohya")
    back = export.convert_adapter(kohya, tmp_path / "back.safetensors", "diffusers")
    prefixes = tuple(FAMILIES[name].layout.kohya_prefixes.values())
    assert all(key.startswith(prefixes) for key in load_file(kohya))
    original, again = load_file(trained), load_file(back)
    assert original.keys() == again.keys()
    assert all(torch.equal(original[key], again[key]) for key in original)


@pytest.mark.parametrize("name", [name for name in NAMES if isinstance(FAMILIES[name].layout, FusedLayout)])
def test_a_lycoris_run_on_a_fused_layout_family_ends_with_the_layout_it_can_write(
    name, micro_base, make_config, tmp_path
):
    """LoHa in the diffusers layout trains and saves on a family whose kohya layout fuses q, k and v: the end-of-run
    parity check draws the file it wrote and says why the kohya layout was not checked (it crashed the run's end
    before), and converting the file to kohya is refused by name."""
    prompt = (
        {"prompt": "a purple circle", "controls": _sample_controls(FAMILIES[name], tmp_path)}
        if FAMILIES[name].drawing.needs_controls_to_draw
        else None
    )
    settings = _settings(
        name,
        micro_base(name),
        tmp_path / "run",
        adapter__kind="loha",
        train__max_steps=2,
        sample__prompts=[prompt or "a purple circle"],
        sample__steps=2,
    )
    trained = train(make_config(**settings)).trained_path
    parity = json.loads((trained.parent / "parity.json").read_text())
    assert set(parity["layouts"]) == {"diffusers"} and parity["layouts"]["diffusers"]["max_pixel_difference"] <= 2
    assert "separate LoHa/LoKr factors have no fused form" in parity["not_checked"]["kohya"]
    with pytest.raises(DifftuneError, match="no fused form; write the diffusers layout"):
        export.convert_adapter(trained, tmp_path / "kohya.safetensors", "kohya")


@pytest.mark.parametrize("name", NAMES)
def test_every_run_writes_a_file_comfyui_applies_as_our_merge(name, micro_base, make_config, tmp_path):
    """Beside `pytorch_lora_weights.safetensors` every adapter run writes the kohya / ComfyUI layout (ComfyUI mapped
    none of a Wan diffusers-layout file's keys). ComfyUI's key maps, over the original layout diffusers' single-file
    reader reads (`comfyui_lora.py`), reach every key of it, and its formula gives each weight difftune's merge of the
    run's diffusers-layout file; alpha differs from the rank, so a scale lost on the way would show."""
    family, base, out = FAMILIES[name], micro_base(name), tmp_path / "run"
    text = family.targets.adapted_text_encoders()
    settings = _settings(
        name,
        base,
        out,
        adapter__kind="lora",
        adapter__rank=4,
        adapter__alpha=2.0,
        adapter__text_encoder=bool(text),
        train__max_steps=2,
        optim__learning_rate=2e-2,
        sample__prompts=[],
    )
    result = train(make_config(**settings))
    comfy_file = export.layout_path(out, "kohya")
    assert result.trained_path == out / "pytorch_lora_weights.safetensors" and comfy_file == out / "run.safetensors"
    lora = load_file(comfy_file)
    assert all(key.startswith(tuple(family.layout.kohya_prefixes.values())) for key in lora)
    export.merge_into_folder(str(base), [(result.trained_path, 1.0)], tmp_path / "merged")
    merged = load_components(ModelConfig(base=str(tmp_path / "merged")))
    if not comfyui_applies_as(lora, load_components(ModelConfig(base=str(base))), merged):
        pytest.skip(
            f"{name} has no single-file layout that ComfyUI holds it in, to hold ComfyUI's names (its kohya layout "
            "round-trips: above)"
        )


@pytest.mark.parametrize("name", NAMES)
def test_a_diffusers_layout_file_means_the_same_to_a_reader_that_ignores_its_metadata(
    name, micro_base, make_config, tmp_path
):
    """Rank 8, alpha 4: the scale (0.5) used to live only in the file's metadata, and ComfyUI applied such a Qwen-Image
    LoRA at 2x. Now the tensors alone (`lora_B @ lora_A`, what a reader without the metadata applies) are the trained
    change, module for module, and the family's own pipeline (`load_lora_weights`, which reads the metadata) applies
    that same change."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    family, base = FAMILIES[name], micro_base(name)
    settings = _settings(
        name,
        base,
        tmp_path / "run",
        adapter__kind="lora",
        adapter__rank=8,
        adapter__alpha=4.0,
        train__max_steps=2,
        optim__learning_rate=2e-2,
        sample__prompts=[],
    )
    result = train(make_config(**settings))
    blind = load_file(result.trained_path)
    with safe_open(result.trained_path, framework="pt") as handle:
        assert json.loads(handle.metadata()[export.FOLDED_ALPHA_KEY])[family.denoiser_name]["lora_alpha"] == 4.0

    def changes(denoiser) -> dict[str, torch.Tensor]:
        return {
            name: module.get_delta_weight("default")
            for name, module in denoiser.named_modules()
            if isinstance(module, BaseTunerLayer) and "default" in getattr(module, "lora_A", {})
        }

    trained = changes(result.components.denoiser)
    assert trained
    theirs = their_pipeline(family, base)
    theirs.load_lora_weights(
        str(result.trained_path.parent), weight_name=result.trained_path.name, adapter_name="default"
    )
    loaded = changes(getattr(theirs, family.denoiser_name))
    assert loaded.keys() == trained.keys()
    for module, change in trained.items():
        key = f"{family.denoiser_name}.{module}"
        from_tensors = blind[f"{key}.lora_B.weight"].flatten(1) @ blind[f"{key}.lora_A.weight"].flatten(1)
        torch.testing.assert_close(from_tensors.reshape(change.shape), change, rtol=1e-5, atol=1e-7, msg=module)
        torch.testing.assert_close(loaded[module], change, rtol=1e-5, atol=1e-7, msg=module)
