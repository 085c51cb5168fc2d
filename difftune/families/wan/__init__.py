"""Wan 2.1 and 2.2 (`WanPipeline`): a video DiT (`WanTransformer3DModel`: self-attention over the clip's patches,
cross-attention to UMT5's states) over Wan's causal video autoencoder, trained by flow matching (flow.py), on clips
(dataset.py cuts them into windows of frames) and images, each a one-frame clip, as musubi-tuner and diffusion-pipe let
Wan train on stills.

- Latents: Wan's autoencoder (`AutoencoderKLWan`, Qwen-Image's kind: autoencoders.py), normalised per channel: a
  clip's (B, C, t, h, w), an image's as a one-frame clip; the transformer patches them 1x2x2 itself.
- Text, exactly as `WanPipeline.encode_prompt`: the caption cleaned as the pipeline cleans it (`prompt_clean`), UMT5's
  last states at its tokens, zero past them, 512 positions (the pipeline's `max_sequence_length`): the transformer
  reads every position, the zeros too, so the cache keeps the caption's tokens and pads the zeros back.
- The prediction is the flow velocity (noise minus image), read as `flow_prediction` by the pipeline's UniPC sampler
  (tested against it); its time is the noise level x 1000. Noise levels: the pipeline's scheduler shifts every size by
  one `flow_shift` (3.0 for 480p checkpoints, 5.0 for 720p), which training draws with
  (`loss.flow_shift_by_resolution`) through an Euler flow scheduler of that shift, which also samples.
- Guidance: classifier-free, with the pipeline's own `guidance_scale` and negative prompt.
- Wan 2.2 A14B: two experts, `transformer` for the noise levels at or above the pipeline's `boundary_ratio` (0.875 for
  T2V, 0.9 for I2V) and `transformer_2` below. A run trains one (`model.family_options.expert`), as musubi-tuner does:
  its noise levels are drawn from the expert's range (the drawn distribution cut to it), the other expert waits in
  host memory to draw samples with it, and the file is a Wan LoRA of that expert (`load_into_transformer_2=True` puts
  a low-noise one in diffusers; ComfyUI's two LoRA loaders, one per expert). Or both (`expert = "both"`): one
  denoiser of the two (wan_experts.py), each sample on the expert its level picks, a file per expert, each the file
  a run of that expert alone writes. Wan 2.2 TI2V-5B: its autoencoder patches
  2x2 itself (16x in all) and its transformer reads a time per latent token (`expand_timesteps`), as its pipeline
  passes.
- Files: diffusers' layout (`transformer.`, which `WanPipeline.load_lora_weights` reads: transformer adapters alone)
  with musubi-tuner's default targets (every block's self- and cross-attention and MLP); the kohya layout names the
  original modules (`lora_unet_blocks_0_self_attn_q`), musubi-tuner's files, which ComfyUI maps and diffusers reads
  (`_convert_musubi_wan_lora_to_diffusers`, tested); the original model's `diffusion_model.` files (ComfyUI's, other
  trainers') are read by the same names. A single file is the transformer alone in the original layout, read through
  diffusers' reader and written as its inverse.
"""

from __future__ import annotations

import re
from typing import Literal

import torch
from accelerate import PartialState
from diffusers import WanPipeline, WanTransformer3DModel
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from pydantic import Field

from difftune.config import Config, ModelConfig
from difftune.errors import DifftuneError
from difftune.families.common.conditioning import Conditioning, valid_token_states
from difftune.families.common.drawing import ClipDrawing
from difftune.families.common.flow import FlowDrawing, FlowMatchingFamily, FlowOptions, SamplerShiftFlowMatching
from difftune.families.common.layouts import RenamedLayout
from difftune.families.common.loading import Loading, config_folder
from difftune.families.common.targets import AdapterFile, AdapterTargets
from difftune.families.common.wan_experts import EXPERTS, WanExperts
from difftune.models.components import SINGLE_FILE_SUFFIXES, Components
from difftune.models.dtypes import PartDtypes

TEXT_TOKENS = 512  # WanPipeline's default `max_sequence_length`: every caption's states are padded to it
TRANSFORMER_TARGETS = [
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.to_out.0",
    "attn2.to_q",
    "attn2.to_k",
    "attn2.to_v",
    "attn2.to_out.0",
    "ffn.net.0.proj",
    "ffn.net.2",
]
# diffusers' module in a block -> the original model's (Wan-AI's, ComfyUI's, musubi-tuner's), as diffusers' readers of
# those files map them back (`_convert_non_diffusers_wan_lora_to_diffusers`, `_convert_musubi_wan_lora_to_diffusers`).
ORIGINAL_IN_BLOCK = {
    "attn1.to_q": "self_attn.q",
    "attn1.to_k": "self_attn.k",
    "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q",
    "attn2.to_k": "cross_attn.k",
    "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o",
    "attn2.add_k_proj": "cross_attn.k_img",
    "attn2.add_v_proj": "cross_attn.v_img",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}
ORIGINAL_NAMES = {
    "condition_embedder.time_proj": "time_projection.1",
    "proj_out": "head.head",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
}
BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
VACE_FILE_KEY = "vace_blocks.0.after_proj.bias"  # what diffusers' reader tells a Wan VACE file by (wan_vace)
# For single files: diffusers' weight names -> the original model's, in this order, the inverse of diffusers' reader
# (`convert_wan_transformer_to_diffusers`); a block's norm2 and norm3 trade names, the modulations are
# `scale_shift_table`.
ORIGINAL_WEIGHT_RENAMES = [
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
    ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
    ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
    ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
    (".attn1.", ".self_attn."),
    (".attn2.", ".cross_attn."),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    (".add_k_proj.", ".k_img."),
    (".add_v_proj.", ".v_img."),
    (".norm_added_k.", ".norm_k_img."),
    (".ffn.net.0.proj.", ".ffn.0."),
    (".ffn.net.2.", ".ffn.2."),
    (".norm2.", ".norm_swapped."),
    (".norm3.", ".norm2."),
    (".norm_swapped.", ".norm3."),
    ("proj_out.", "head.head."),
    (".scale_shift_table", ".modulation"),
]


EXPERT_NAMES = ("high_noise", "low_noise")  # `expert`'s values for `transformer` and `transformer_2`


def _has_two_experts(index: dict) -> bool:
    """Whether a pipeline's model_index names a second transformer (Wan 2.2 A14B's low-noise expert)."""
    return (index.get("transformer_2") or [None])[0] is not None


class WanOptions(FlowOptions):
    expert: Literal["auto", "high_noise", "low_noise", "both"] = Field(
        "auto",
        description="Wan 2.2 A14B bases (two experts: `transformer` for noise levels at or above the pipeline's "
        "`boundary_ratio`, `transformer_2` below): the one this run trains, its noise levels drawn from its range "
        "only and the other expert drawing the samples with it (musubi-tuner's way), or `both`: each sample trains "
        "the expert its noise level picks, one adapter and one file per expert, one expert on the device at a time "
        "(wan_experts.py). `auto`: the one transformer of a Wan 2.1 base, the high-noise expert of a Wan 2.2 one.",
    )


def original_weight_name(key: str) -> str:
    if key == "scale_shift_table":  # the output head's
        return "head.modulation"
    for diffusers_name, original in ORIGINAL_WEIGHT_RENAMES:
        key = key.replace(diffusers_name, original)
    return key


class ExpertFlowMatching(SamplerShiftFlowMatching):
    """Wan's flow matching: the pipeline's one shift, and a Wan 2.2 expert trained on its side of the boundary."""

    def trains_noise_level(self, components: Components, sigma: float) -> bool:
        """An expert trains its side of the boundary, as the pipeline picks it: `transformer` at time >= boundary x
        1000; both experts, every level."""
        boundary = components.pipeline_options.get("boundary_ratio")
        if boundary is None or components.family_options.expert == "both":
            return True
        return (sigma < boundary) == (components.family.denoiser_part(components.family_options) == "transformer_2")

    def same_denoiser(self, components: Components, sigma: float, other: float) -> bool:
        """Both experts trained: a batch's levels on one side of the boundary, so that a step runs one expert."""
        if components.family_options.expert != "both":
            return True
        boundary = components.pipeline_options["boundary_ratio"]
        return (sigma < boundary) == (other < boundary)


class WanLayout(RenamedLayout):
    """Wan's files in other tools' layouts."""

    kohya_prefixes = {"transformer": "lora_unet_"}

    kohya_text_model_parts = ()

    kohya_model_version = "wan"

    kohya_layout_name = "Wan"

    single_file_layout = "transformer alone (original layout)"

    denoiser_file_key = "head.modulation"  # what diffusers' reader detects Wan files by

    other_models_file_keys = (VACE_FILE_KEY,)

    def original_name(self, module: str) -> str | None:
        if match := BLOCK.match(module):
            member = ORIGINAL_IN_BLOCK.get(match.group(2))
            return f"blocks.{match.group(1)}.{member}" if member else None
        return ORIGINAL_NAMES.get(module)

    def diffusers_names(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return convert_wan_transformer_to_diffusers(weights) if self.denoiser_file_key in weights else weights

    def to_single_file(self, components: Components) -> dict[str, torch.Tensor]:
        return {
            original_weight_name(key): value.contiguous() for key, value in components.denoiser.state_dict().items()
        }


class WanTargets(AdapterTargets):
    default_targets = {"transformer": TRANSFORMER_TARGETS}
    lora_text_encoders = ()  # WanPipeline's LoRA loader reads the transformer's adapters alone
    recorded_options = ("expert",)  # a file of each expert goes onto it (export.base_for_adapters)

    def lora_loading_arguments(self, options: WanOptions) -> dict:
        return {"load_into_transformer_2": True} if options.expert == "low_noise" else {}

    def combined_option(self, name: str, values: set) -> object | None:
        return "both" if name == "expert" and values == {"high_noise", "low_noise"} else None

    def adapter_file_suffixes(self, config: Config) -> tuple[str, ...]:
        both = self.family.options(config.model).expert == "both"
        return tuple(f"_{expert}" for expert in EXPERT_NAMES) if both else super().adapter_file_suffixes(config)

    def adapter_files(self, tensors: dict, lora_configs: dict, config: Config) -> list[AdapterFile]:
        """Both experts trained: a file per expert, each as a run of that expert alone writes it (its adapters under
        `transformer.`, its recorded config naming the expert), named `_high_noise` and `_low_noise` as ai-toolkit's
        are; diffusers loads the second with `load_into_transformer_2=True`, ComfyUI with a loader per expert."""
        if self.family.options(config.model).expert != "both":
            return super().adapter_files(tensors, lora_configs, config)
        files = []
        for part, expert in zip(EXPERTS, EXPERT_NAMES, strict=True):
            prefix = f"transformer.{part}."
            options = {**config.model.family_options, "expert": expert}
            recorded = config.model_copy(update={"model": config.model.model_copy(update={"family_options": options})})
            own = {
                f"transformer.{key.removeprefix(prefix)}": value
                for key, value in tensors.items()
                if key.startswith(prefix)
            }
            files.append(AdapterFile(f"_{expert}", own, lora_configs, recorded))
        return files


class WanLoading(Loading):
    def drawing_part_names_of(self, config: ModelConfig) -> tuple[str, ...]:
        """A Wan 2.2 A14B base's other expert (none for a one-transformer base, or where both train)."""
        if self.family.options(config).expert == "both" or not _has_two_experts(
            self.family.pipeline_class.load_config(config_folder(config), revision=config.revision or None)
        ):
            return ()
        return (
            "transformer"
            if self.family.denoiser_part(self.family.options(config)) == "transformer_2"
            else "transformer_2",
        )

    def components_of(self, pipeline, options: WanOptions) -> Components:
        """The expert this run trains as the denoiser, the other one a drawing part (`Components.drawing_parts`);
        both experts as one denoiser (`WanExperts`)."""
        # From the base's model_index (the plan's pipeline is one): a run's end loads its encoders again without the
        # trained expert, which leaves the pipeline's own record of it empty.
        name = pipeline.config.get("_name_or_path")
        experts = _has_two_experts(self.family.pipeline_class.load_config(name) if name else pipeline.config)
        if not experts and options.expert != "auto":
            raise DifftuneError(
                f'model.family_options.expert = "{options.expert}": this base has one transformer '
                '(Wan 2.1, Wan 2.2 TI2V-5B); leave it at "auto"'
            )
        components = super().components_of(pipeline, options)
        if options.expert == "both" and PartialState().num_processes > 1:
            raise DifftuneError(
                'model.family_options.expert = "both" trains on one process: its experts take turns on the one '
                "device, which DDP and FSDP cannot wrap; launch one process, or train one expert a run on each GPU"
            )
        if options.expert == "both":
            if pipeline.transformer is not None:  # None: loaded without its denoiser (`load_denoiser` brings it)
                boundary = pipeline.config["boundary_ratio"]
                components.denoiser = WanExperts(pipeline.transformer, pipeline.transformer_2, boundary)
        elif experts:
            other = "transformer" if self.family.denoiser_part(options) == "transformer_2" else "transformer_2"
            components.drawing_parts[other] = getattr(pipeline, other)
        return components

    def _loading_arguments(self, config: ModelConfig, options: WanOptions, dtypes: PartDtypes) -> dict:
        arguments = super()._loading_arguments(config, options, dtypes)  # the first expert's
        if options.expert == "both":  # the second loads as the first does
            if dtypes.denoiser is None:
                arguments["transformer_2"] = None
            else:
                arguments["dtype"]["transformer_2"] = self._denoiser_dtype(config, "transformer_2", dtypes)
        return arguments

    def load_denoiser(self, config: ModelConfig, dtypes: PartDtypes) -> torch.nn.Module:
        if self.family.options(config).expert != "both":
            return super().load_denoiser(config, dtypes)
        experts = [self.load_denoiser_part(config, part, dtypes) for part in EXPERTS]
        boundary = self.family.pipeline_class.load_config(config.base, revision=config.revision or None)[
            "boundary_ratio"
        ]
        return WanExperts(*experts, boundary)

    def empty_denoiser(self, config: ModelConfig) -> torch.nn.Module:
        if self.family.options(config).expert != "both":
            return super().empty_denoiser(config)
        index = self.family.pipeline_class.load_config(config_folder(config), revision=config.revision or None)
        return WanExperts(*(self.empty_denoiser_part(config, part) for part in EXPERTS), index["boundary_ratio"])

    # Single files: the transformer alone in the original layout (Wan-AI's, ComfyUI's
    # `diffusion_models/wan2.1_t2v_1.3B_fp16.safetensors`), read through diffusers' reader and written as its inverse;
    # the other parts come from `model.single_file_config`.
    single_file_pipeline = Loading.pipeline_around_denoiser_file


class WanDrawing(ClipDrawing, FlowDrawing):
    def denoiser_pipeline_parts(self, components: Components) -> dict[str, torch.nn.Module]:
        if isinstance(components.denoiser, WanExperts):
            return components.denoiser.experts()
        return super().denoiser_pipeline_parts(components)

    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """The pipeline's `guidance_scale` is classifier-free guidance (neg + w (pos - neg)) above 1."""
        return {
            "max_sequence_length": TEXT_TOKENS,
            "guidance_scale": guidance_scale,
            "negative_prompt": negative_prompt or None,
        }


class WanConditioning(Conditioning):
    padded_text_tokens = TEXT_TOKENS

    def tokenize(self, tokenizers: dict, captions: list[str], controls: list | None = None) -> dict[str, torch.Tensor]:
        ids = tokenizers["tokenizer"](
            [prompt_clean(caption) for caption in captions],
            padding="max_length",
            max_length=TEXT_TOKENS,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        return {"text_encoder": ids.input_ids}

    def encode_prompts(self, components: Components, token_ids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = token_ids["text_encoder"]
        mask = ids != components.tokenizers["tokenizer"].pad_token_id
        states = components.text_encoders["text_encoder"](ids, mask.long()).last_hidden_state
        return valid_token_states(states, mask, 0, TEXT_TOKENS)


class Wan(FlowMatchingFamily):
    name = "wan"
    layout = WanLayout()
    loading = WanLoading()
    conditioning = WanConditioning()
    drawing = WanDrawing()
    targets = WanTargets()
    description = "Wan 2.1 / 2.2"
    pipeline_class = WanPipeline
    pipeline_classes = ("WanPipeline",)
    denoiser_class = WanTransformer3DModel
    denoiser_name = "transformer"
    block_lists = ("blocks",)
    reads_clips = True
    options_model = WanOptions
    objective = ExpertFlowMatching()
    pipeline_options = ("boundary_ratio", "expand_timesteps")

    # Wan 2.2's experts.

    def unsupported_settings(self, config: Config) -> list[str]:
        problems = super().unsupported_settings(config)
        if self.options(config.model).expert != "both":
            return problems
        if config.model.base.endswith(SINGLE_FILE_SUFFIXES):
            problems.append(
                'model.family_options.expert = "both": a single file holds one expert; give the Wan 2.2 A14B '
                "pipeline folder or hub id, or train the file's expert alone"
            )
        if config.model.quantize != "none":
            problems.append(
                f'model.quantize = "{config.model.quantize}" with both experts: quantized layers cannot move between '
                'the device and host memory as the experts take turns; store them in fp8 (model.weight_dtype = "fp8") '
                "or train one expert a run"
            )
        return problems

    def denoiser_part(self, options: WanOptions) -> str:
        return "transformer_2" if options.expert == "low_noise" else "transformer"

    def monitored_blocks(self, denoiser: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """Both experts: each one's blocks, named with its part (`transformer_2.blocks.0`)."""
        if not isinstance(denoiser, WanExperts):
            return super().monitored_blocks(denoiser)
        blocks = super().monitored_blocks
        return {
            f"{part}.{name}": block
            for part, expert in denoiser.experts().items()
            for name, block in blocks(expert).items()
        }

    def offloadable_blocks(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Both experts: an expert's blocks (`model.offload_blocks` counts those of each)."""
        return super().offloadable_blocks(denoiser.transformer if isinstance(denoiser, WanExperts) else denoiser)

    def blocks_to_offload(self, denoiser: torch.nn.Module, count: int) -> list[torch.nn.Module]:
        """Both experts: the same blocks of each, so either on the device holds what one expert alone would."""
        if not isinstance(denoiser, WanExperts):
            return super().blocks_to_offload(denoiser, count)
        offloaded = super().blocks_to_offload
        return [block for expert in denoiser.experts().values() for block in offloaded(expert, count)]

    # Prompts and the transformer.

    def latent_channels(self, denoiser: torch.nn.Module) -> int:
        return denoiser.config.out_channels  # it patches them itself (an image-to-video one reads more channels in)

    def denoise(self, components, noisy, timesteps, conditioning, geometry):
        """An image's latents (B, C, h, w) as one-frame clips; a clip's (B, C, T, h, w) as they are; an image-to-video
        base's CLIP image states (`image_embeds`, Wan 2.1's) beside the text."""
        states, image_states = conditioning["encoder_hidden_states"], conditioning.get("image_embeds")
        clip = noisy if noisy.dim() == 5 else noisy[:, :, None]
        if components.pipeline_options.get("expand_timesteps"):  # TI2V-5B: a time per latent token, as its pipeline
            p_t, p_h, p_w = components.denoiser.config.patch_size
            tokens = clip.shape[2] // p_t * (clip.shape[3] // p_h) * (clip.shape[4] // p_w)
            timesteps = timesteps[:, None].expand(-1, tokens)
        control = conditioning.get("control_hidden_states")  # a VACE transformer's control latents (wan_vace)
        prediction = components.denoiser(
            hidden_states=clip.to(states.dtype),
            timestep=timesteps.to(states.dtype),
            encoder_hidden_states=states,
            encoder_hidden_states_image=image_states.to(states.dtype) if image_states is not None else None,
            **({} if control is None else {"control_hidden_states": control.to(states.dtype)}),
            return_dict=False,
        )[0]
        return prediction if noisy.dim() == 5 else prediction[:, :, 0]

    # Sampling.

    def max_sequence_length(self, components: Components) -> int:
        return TEXT_TOKENS


FAMILY = Wan()
