"""The typed config schema: the single source for TOML files, CLI overrides, --help and the docs' config reference.

A job is one `Config`. Files are TOML (read with `tomllib`); overrides are `section.key=value`.
Every field carries its description here, and nowhere else. Unknown keys and bad values fail
before any work, with one message naming the key and what is allowed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import tomli_w
import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from difftune.adapter_kinds import KINDS, AdapterKind, ControlNet, FullFineTune, LoRA, PeftAdapter, TokenEmbedding
from difftune.errors import DifftuneError
from difftune.files import is_url

# Which fields are paths. In a config file, a relative path is relative to that file; on the command line (and
# in defaults), to the working directory; the resolved config holds absolute paths. A `model` path that does not
# exist there is left as it is: a Hugging Face hub id.
PATH_LOCAL = {"path": "local"}
PATH_MODEL = {"path": "model"}
Switch = Literal["auto", "on", "off"]  # `auto`: the setting decides from the device or the rest of the config


def switch_from_bool(cls, value: Any) -> Any:
    """Files written before a switch had `auto` say true/false."""
    return (
        {True: "on", False: "off", "true": "on", "false": "off"}.get(value, value)
        if isinstance(value, (bool, str))
        else value
    )


class Section(BaseModel):
    # strict: a TOML string "100" for an integer is a mistake worth reporting, not coercing. No setting means anything
    # at infinity or NaN (TOML writes them `inf`, `nan`): `max_grad_norm = inf` trained unclipped where 0 says so, a
    # dataset's `loss_weight = inf` made every step non-finite and skipped, and the run exited 0 untrained.
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, allow_inf_nan=False)


UNITS = {"GB": 10**9, "GIB": 2**30, "MB": 10**6, "MIB": 2**20}


def parse_size(text: str) -> int:
    """ "12GB", "24 GiB", "512MB" -> bytes."""
    number = text.strip().upper().replace(" ", "")
    for unit, size in UNITS.items():
        if number.endswith(unit):
            try:
                return int(float(number[: -len(unit)]) * size)
            except ValueError:
                break
    raise DifftuneError(f"{text!r}: a size is a number and a unit, e.g. 12GB, 24GiB or 512MB")


MAX_SIDE = 16384  # pixels: a side past this is a typo (2147483648 overflowed after the model had loaded)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # `owner/name`, what a base not on this machine must look like
# Past this a learning rate is a typo (1e30 trained NaNs): adaptive optimizers that take a scale instead (Prodigy) use
# 1.
MAX_LEARNING_RATE = 10.0

# The model families: one folder each in difftune/families/, named as the family (families/__init__.py loads them),
# beside `common/`, the pieces families share. Read from the folders here, because the families import this schema.
FAMILY_NAMES = tuple(
    sorted(
        folder.name
        for folder in (Path(__file__).parent / "families").iterdir()
        if (folder / "__init__.py").is_file() and folder.name != "common"
    )
)


def wrong_family(named: str, base: str, what: str, reader: str) -> DifftuneError:
    """`model.family` names one family for a base that another reads: it would half-load and fail later."""
    return DifftuneError(
        f'model.family = "{named}": model.base {base} is {what} of the {reader} family; '
        f'set model.family = "auto" or "{reader}"'
    )


class ModelConfig(Section):
    base: str = Field(
        "models/tiny-sd",
        json_schema_extra=PATH_MODEL,
        description="Base model: a local diffusers folder, a Hugging Face hub id (needs network), "
        "a single-file .safetensors checkpoint, or a GGUF quantization of a denoiser (`.gguf`, LoRA only).",
    )
    family: Literal[("auto", *FAMILY_NAMES)] = Field(
        "auto",
        description="Model family: `auto` reads it from the base (a pipeline folder's model_index.json, a single "
        "file's keys), or a family's name, its module's in difftune/families/ (the Model families table says "
        "which bases each reads).",
    )
    revision: str = Field("", description="Hub revision (branch, tag or commit) of `base`; empty for the default.")
    variant: str = Field(
        "", description="Weight variant to load from a diffusers folder, e.g. `fp16`; empty for the default."
    )
    single_file_config: str = Field(
        "",
        json_schema_extra=PATH_MODEL,
        description="For a single-file `base`: a diffusers folder or hub id whose configs describe its "
        "architecture. Offline, pass a local folder here. FLUX.1, FLUX.2, Chroma, SD3, Qwen-Image and Z-Image single "
        "files hold the transformer alone (as ComfyUI, BFL and Stability ship them): the text encoders and "
        "autoencoder come from this folder.",
    )
    allow_pickled_checkpoint: bool = Field(
        False,
        description="Allow a pickle-based `.ckpt`/`.pt`/`.bin` single-file base. It is still read with "
        "`torch.load(weights_only=True)` (tensors only, no code), so one holding other objects fails: convert it.",
    )
    vae: str = Field(
        "",
        json_schema_extra=PATH_MODEL,
        description="Autoencoder that turns images into latents: empty for the base model's own, or a folder/hub "
        "id of another `AutoencoderKL`, of TAESD (`AutoencoderTiny`) or of Wan's `AutoencoderKLQwenImage`.",
    )
    quantize: Literal["none", "int8", "nf4"] = Field(
        "none",
        description="QLoRA: keep the frozen denoiser's linear layers quantized while the adapters on them train in "
        "fp32 (convolutions stay as they are). `int8`: weight-only int8 through torchao (the `torchao` extra); "
        "`nf4`: 4-bit NormalFloat with double quantization through bitsandbytes, as QLoRA (the `bnb` extra). Needs "
        "an adapter; the saved adapter loads on the unquantized base.",
    )
    family_options: dict[str, bool | int | float | str] = Field(
        {},
        description="Settings of the base's family, checked by the family (each family's are listed below the "
        "reference): e.g. `model.family_options = { guidance = 3.5 }` for a guidance-distilled Flux. A setting the "
        "family does not have is refused by name.",
    )
    weight_dtype: Literal["auto", "fp32", "fp16", "bf16", "fp8"] = Field(
        "auto",
        description="Dtype of the frozen weights. `auto` follows `train.mixed_precision`. `fp16`/`bf16` with "
        "mixed precision `no` keeps the denoiser's frozen layers in 16 bits but computes in fp32: half their memory "
        "without 16-bit arithmetic (slow on CPUs without AVX512-BF16/AMX), for two weight casts per step. `fp8` keeps "
        "the denoiser's frozen linear and convolution weights in fp8 (e4m3, each tensor scaled by a power of two) "
        "and computes in the mixed precision's dtype (fp32 with `no`): a quarter of fp32's memory, half of bf16's, "
        "as kohya's and musubi-tuner's `--fp8_base`; needs an adapter, and the adapter loads on the original base. "
        "Trained parameters are always fp32.",
    )
    text_encoder_dtype: Literal["auto", "fp8"] = Field(
        "auto",
        description="Dtype of the text encoders' frozen weights. `auto`: the run's compute dtype (as `weight_dtype` "
        "`auto`). `fp8` keeps their linear layers' weights in fp8 (e4m3, each tensor scaled by a power of two) and "
        "computes in the mixed precision's dtype, as `weight_dtype = \"fp8\"` keeps the denoiser's: about half "
        "their bf16 memory where they encode the captions (Qwen2.5-VL 7B's language model: 7.1 instead of 13.2 "
        "GiB), as musubi-tuner's `--fp8_vl` / `--fp8_llm`. Their states then carry fp8's rounding, in training and "
        "in the run's samples alike (the adapter file does not depend on it).",
    )
    offload_blocks: int = Field(
        0,
        ge=0,
        description="Keep the frozen weights of this many of the denoiser's blocks in host memory (pinned on CUDA) "
        "and copy each layer's to the device as it runs, in forward and in backward: the device holds the other "
        "blocks and a block or two in flight, as kohya's and musubi-tuner's `--blocks_to_swap`. On CUDA the next "
        "block's copy runs on its own stream while the current block computes. The offloaded blocks are spread "
        "evenly over the denoiser's (`difftune plan` says how many fit a budget). Exact: the same losses as without. "
        "Needs an adapter; combines with `weight_dtype` (fp8 halves the bytes copied).",
    )
    training_adapter: str = Field(
        "",
        json_schema_extra=PATH_MODEL,
        description="An adapter file (any layout difftune reads) merged into the base for training only, never into "
        'what the run saves: the de-distilling "training adapter" of a step-distilled base, as ai-toolkit\'s '
        "`assistant_lora_path` and musubi-tuner's `--base_weights` (`ostris/zimage_turbo_training_adapter` "
        "for Z-Image Turbo, `ostris/FLUX.1-schnell-training-adapter` for FLUX.1 [schnell]). The "
        "adapter trained over it then applies to the distilled base alone and keeps its few-step "
        "sampling. Samples during and after the run take its change off again (ai-toolkit's previews "
        "invert it): they show the saved adapter on the distilled base. A local file, or "
        "`owner/repo/file.safetensors` on the hub. Needs an adapter (a full fine-tune would save it merged in).",
    )
    offload_budget: str = Field(
        "",
        description="Instead of a count: the device memory the run may use, e.g. `12GB` or `16GiB`. Before loading, "
        "the memory plan (`difftune plan`) picks the fewest blocks to offload whose predicted peak fits it (none "
        "when the job fits whole); the run prints the count and its resolved config records it. Empty: "
        "`offload_blocks` decides.",
    )

    @field_validator("offload_budget")
    @classmethod
    def _budget_is_a_size(cls, value: str) -> str:
        if value:
            try:
                parse_size(value)
            except DifftuneError as error:
                raise ValueError(str(error)) from None
        return value


def one_offload_setting(config: Config) -> None:
    """`model.offload_blocks` and `model.offload_budget` both say how many blocks to offload."""
    if config.model.offload_budget and config.model.offload_blocks:
        raise ValueError(
            f"model.offload_blocks = {config.model.offload_blocks} and model.offload_budget = "
            f'"{config.model.offload_budget}" both say how many blocks to offload: set one'
        )


def gguf_base_trains_a_lora(config: Config) -> None:
    """A GGUF base keeps its own quantized weights (denoiser_files.py): a LoRA trains on them, as QLoRA does;
    what would store, offload, rewrite or train those weights is refused by name."""
    if not config.model.base.endswith(".gguf"):
        return
    clashes = {
        f'adapter.kind = "{config.adapter.kind}"': type(config.adapter.kind_type) is not LoRA,  # nor DoRA
        f'adapter.init = "{config.adapter.init}"': config.adapter.rewrites_base,
        f'model.weight_dtype = "{config.model.weight_dtype}"': config.model.weight_dtype != "auto",
        f'model.quantize = "{config.model.quantize}"': config.model.quantize != "none",
        "model.offload_blocks / model.offload_budget": bool(config.model.offload_blocks or config.model.offload_budget),
    }
    named = [name for name, clash in clashes.items() if clash]
    if named:
        raise ValueError(
            f"model.base {config.model.base}: a GGUF base keeps its weights in their quantized blocks, and a LoRA "
            f'(adapter.kind = "lora", init = "gaussian") trains on them; {", ".join(named)} would store, offload, '
            "rewrite or train those weights: leave it at its default, or train on the model's .safetensors file"
        )


def frozen_weights_kept_apart_once(config: Config) -> None:
    """Frozen weights kept in another dtype or in host memory: one such setting, and not with what would store
    or train them otherwise."""
    storage = config.frozen_weights_kept_apart
    if storage:
        if config.train.mixed_precision == "fp8":
            raise ValueError(
                f'{storage}, and train.mixed_precision = "fp8" casts bf16 weights to FP8 per matmul with fresh '
                "scales: use one or the other"
            )
        if config.model.quantize != "none":
            raise ValueError(f"{storage}, and model.quantize stores them quantized: choose one")
        if config.train.compile:
            raise ValueError(f"{storage}, which train.compile does not support yet; turn one off")


def not_empty(value: str, info) -> str:
    """An empty path resolves to the working directory: a scan of it (data.path took 51 s), or a run's files written
    among the user's own (train.output_dir)."""
    if not str(value).strip():
        raise ValueError("is empty; name a folder (an empty path would mean the working directory)")
    return value


class DataConfig(Section):
    path: str = Field(
        "examples/purple",
        json_schema_extra=PATH_LOCAL,
        description="Image folder: images with same-stem caption files, or a `metadata.jsonl` with "
        "`file_name` and `text`. Subfolders named `N_name` are repeated N times per epoch (kohya). Or stored records, "
        "on local disk or at a URL (`s3://bucket/train-*.tar`; the `storage` extra): webdataset tar shards or parquet "
        "files (a file, a glob or a folder of them; a hub dataset's parquet at `hf://datasets/...`), or a folder "
        "`datasets`' `save_to_disk` wrote.",
    )
    _path_not_empty = field_validator("path")(not_empty)
    image_column: str = Field(
        "",
        description="Parquet and saved datasets: the image column (bytes, or the datasets library's Image "
        "feature); empty: the first of image, img, jpg, png, webp.",
    )
    caption_column: str = Field(
        "",
        description="Parquet and saved datasets: the caption column; empty: the first of text, caption, txt, "
        "prompt (none: records are uncaptioned, as `missing_caption` says).",
    )
    resolution: int = Field(
        512,
        ge=8,
        le=MAX_SIDE,
        description="Training size in pixels: images are resized (shorter side) and cropped to a square.",
    )
    repeats: int = Field(
        1,
        ge=1,
        description="Each image is listed this many times per epoch (kohya's `num_repeats`), times its `N_name` "
        "folder's N.",
    )
    loss_weight: float = Field(
        1.0, gt=0, description="Loss weight of these images (with `datasets`: a regularization set at less than 1)."
    )
    crop: Literal["center", "random"] = Field("center", description="Where to crop after resizing.")
    random_flip: bool = Field(False, description="Flip images horizontally with probability 0.5.")
    caption_extension: str = Field(".txt", description="Extension of caption files next to the images.")
    missing_caption: Literal["error", "empty", "folder"] = Field(
        "error",
        description="An image with no caption: `error` stops before training and names it; `empty` trains it "
        "with an empty caption; `folder` captions it with its `N_name` folder's name (kohya's DreamBooth folders: "
        "`10_sks dog` gives `sks dog`).",
    )
    caption_dropout: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Probability of replacing a caption with an empty one (teaches classifier-free guidance).",
    )
    caption_prefix: str = Field(
        "", description="Text put before every caption as it is (e.g. `sks, `), after tag shuffling."
    )
    caption_suffix: str = Field("", description="Text put after every caption as it is, after tag shuffling.")
    tag_separator: str = Field(
        ",", min_length=1, description="What separates a caption's tags, for shuffling and tag dropout."
    )
    shuffle_tags: bool = Field(
        False, description="Shuffle each caption's tags (after the first `keep_tokens`) every time it is drawn."
    )
    keep_tokens: int = Field(
        0, ge=0, description="Leading tags that shuffling and tag dropout leave in place (a trigger word)."
    )
    tag_dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Probability of leaving out each tag after the first `keep_tokens`, each time a caption is drawn.",
    )
    caption_variants: int = Field(
        0,
        ge=0,
        description="With `shuffle_tags` or `tag_dropout`: draw this many fixed variants of each caption, and pick one "
        "each time, so the text cache can hold them (kohya cannot cache shuffled captions). 0: a fresh draw every "
        'time, which needs the text encoded every step (`cache.text = "auto"` turns the cache off).',
    )
    num_workers: int = Field(2, ge=0, description="Data loader worker processes; 0 loads in the training process.")
    buckets: bool = Field(
        False,
        description="Aspect-ratio buckets (kohya): each image is trained at the bucket size closest to its aspect "
        "ratio, with about resolution^2 pixels; each batch comes from one bucket.",
    )
    bucket_step: int = Field(64, ge=8, le=MAX_SIDE, description="Bucket sides are multiples of this.")
    bucket_min_side: int = Field(256, ge=8, le=MAX_SIDE, description="Shortest bucket side.")
    bucket_max_side: int = Field(1024, ge=8, le=MAX_SIDE, description="Longest bucket side.")
    min_image_size: int = Field(
        16, ge=1, description="Images whose shorter side is smaller than this are skipped and reported."
    )
    max_image_pixels: int = Field(
        89_478_485,
        ge=1,
        description="Images with more pixels are skipped as possible decompression bombs (PIL's default limit).",
    )
    masks: Literal["off", "alpha", "folder", "record"] = Field(
        "off",
        description="Masked loss: weight each pixel's loss by a mask that follows the image through resize, crop, flip "
        "and buckets (white trains, black does not; gray in between). `alpha`: the image's own "
        "transparency; `folder`: a same-stem grayscale image in `mask_path` (kohya's conditioning "
        "folder); `record`: in tar shards, the record's `mask.*` member (`0001.mask.png` beside "
        "`0001.jpg`). An image without a mask trains whole. Validation loss stays unmasked.",
    )
    mask_path: str = Field(
        "", json_schema_extra=PATH_LOCAL, description='`masks = "folder"`: the folder of mask images.'
    )
    control_path: str = Field(
        "",
        json_schema_extra=PATH_LOCAL,
        description="Edit bases (FLUX.1 Kontext, Qwen-Image-Edit): the folder of control (source) images, each named "
        "as its target image's stem (`cat.png`), or numbered for several (`cat_0.png`, `cat_1.png`); "
        "empty: a `control` folder inside each image folder. A `metadata.jsonl` lists them per line "
        "as `control_files` instead. Targets without controls train as text-to-image in the same run.",
    )
    unmasked_weight: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Loss weight of what a mask leaves out (OneTrainer's); 0 ignores it, 1 ignores the mask.",
    )
    alpha_background: tuple[int, int, int] = Field(
        (255, 255, 255), strict=False, description="RGB color that transparent pixels are composited onto."
    )
    keep_alpha: bool = Field(
        False,
        description="Train the images' transparency: RGBA images stay RGBA (opaque images get alpha 255) for an "
        "autoencoder that reads RGBA (Qwen-Image 2.1's, Qwen-Image-Layered's), instead of being composited onto "
        "`alpha_background`. Always on for Qwen-Image-Layered, whose layers are transparent.",
    )
    target_frames: list[int] = Field(
        [17],
        min_length=1,
        description="Clips (`.mp4`, `.mov`, `.mkv`, `.webm`, `.avi` beside the images, for bases that read them: Wan): "
        "the frame counts of the windows cut from each clip, each rounded down to what the autoencoder "
        "takes (Wan: 4k + 1), as musubi-tuner's dataset config names them. A clip shorter than "
        "every window is skipped and reported. Images in the same folder train as one-frame clips.",
    )
    frame_extraction: Literal["head", "chunk", "slide", "uniform", "full"] = Field(
        "head",
        description="Where a clip's windows sit: `head` one at the start per length; `chunk` back to back; `slide` "
        "every `frame_stride` frames; `uniform` `frame_samples` of them spread evenly; `full` the whole clip (at most "
        "`max_frames`) as one window.",
    )
    frame_stride: int = Field(1, ge=1, description='`frame_extraction = "slide"`: frames between window starts.')
    frame_samples: int = Field(1, ge=1, description='`frame_extraction = "uniform"`: windows per clip and length.')
    max_frames: int = Field(129, ge=1, description='`frame_extraction = "full"`: the longest window.')
    datasets: list[DatasetConfig] = Field(
        [],
        description="Several datasets in one run (`[[data.datasets]]` tables, musubi-tuner's `[[datasets]]`): each "
        "names its `path` and sets what it reads differently (its `resolution` or a list of them, `repeats`, "
        "`loss_weight`, captions, masks, buckets, frames); what it leaves unset is this section's. `path` here is "
        "then not read. Empty: the one dataset at `path`.",
    )

    @field_validator("resolution", "bucket_step", "bucket_min_side", "bucket_max_side")
    @classmethod
    def _multiple_of_8(cls, value: int) -> int:
        if value % 8:
            raise ValueError(f"must be a multiple of 8 (the VAE's downsampling), got {value}")
        return value

    @field_validator("target_frames")
    @classmethod
    def _frames_positive(cls, value: list[int]) -> list[int]:
        if any(frames < 1 for frames in value):
            raise ValueError(f"each window needs at least 1 frame, got {value}")
        return value

    @property
    def varies_captions(self) -> bool:
        """Whether a caption's text changes from draw to draw (besides caption dropout)."""
        return self.shuffle_tags or self.tag_dropout > 0

    @model_validator(mode="after")
    def _mask_folder_given(self) -> DataConfig:
        if self.masks == "folder" and not self.mask_path:
            raise ValueError('data.masks = "folder" needs data.mask_path, the folder of same-stem mask images')
        return self

    @model_validator(mode="after")
    def _buckets_around_resolution(self) -> DataConfig:
        if self.buckets and not self.bucket_min_side <= self.resolution <= self.bucket_max_side:
            raise ValueError(
                f"data.buckets: resolution {self.resolution} must lie within bucket_min_side {self.bucket_min_side} "
                f"and bucket_max_side {self.bucket_max_side}"
            )
        return self

    @model_validator(mode="after")
    def _each_dataset_valid(self) -> DataConfig:
        self.each_dataset()  # a dataset's settings over this section's are checked as one section is
        return self

    def each_dataset(self) -> list[DataConfig]:
        """The settings each dataset is read with, as one `[data]` section each: this one alone, or each of
        `datasets` over this one's run-wide settings, once per resolution it lists (each of its images trains at
        each, ai-toolkit's `resolution: [512, 768, 1024]`). An example's `dataset` indexes this list."""
        if not self.datasets:
            return [self]
        shared = self.model_dump(exclude={"datasets"})
        parts = []
        for number, entry in enumerate(self.datasets):
            own = entry.model_dump(exclude_none=True, exclude={"resolution"})
            for resolution in entry.resolutions(self.resolution):
                try:
                    parts.append(DataConfig.model_validate(shared | own | {"resolution": resolution}))
                except ValidationError as err:
                    problems = "; ".join(
                        f"{'.'.join(map(str, e['loc'])) or 'its settings'}: {e['msg'].removeprefix('Value error, ')}"
                        for e in err.errors()
                    )
                    raise ValueError(f"datasets[{number}] (resolution {resolution}): {problems}") from None
        return parts

    def largest_resolution(self) -> int:
        """The largest training resolution of any dataset: what a step's memory is planned for."""
        return max(data.resolution for data in self.each_dataset())

    def dataset_keys(self) -> list[str]:
        """How messages name each of `each_dataset`'s datasets: the setting its folder comes from."""
        if not self.datasets:
            return ["data.path"]
        return [
            f"data.datasets[{number}].path"
            for number, entry in enumerate(self.datasets)
            for _ in entry.resolutions(self.resolution)
        ]


# `[data]` settings that stay the run's with several datasets: one loader, one batch's tensors (their channels, the
# mask's weight in the step) and the limits every file is held to.
RUN_WIDE_DATA_FIELDS = (
    "num_workers",
    "min_image_size",
    "max_image_pixels",
    "unmasked_weight",
    "alpha_background",
    "keep_alpha",
)


class _DatasetEntry(Section):
    path: str = Field(
        json_schema_extra=PATH_LOCAL, description="This dataset's folder or stored records (as `data.path`)."
    )
    _path_not_empty = field_validator("path")(not_empty)
    resolution: int | list[int] | None = Field(
        None,
        description="Its training size, or a list of sizes: each image trains at each (ai-toolkit's several "
        "resolutions; with `buckets`, each size's buckets); unset: `data.resolution`.",
    )

    def resolutions(self, default: int) -> list[int]:
        if self.resolution is None:
            return [default]
        return [self.resolution] if isinstance(self.resolution, int) else list(dict.fromkeys(self.resolution))


# One dataset of `data.datasets`: its path, its resolution(s), and any other `[data]` setting but the run-wide ones,
# unset (None) where it takes `[data]`'s. Built from DataConfig's fields, so a new data setting is per dataset as
# well, with its one description.
DatasetConfig = create_model(
    "DatasetConfig",
    __base__=_DatasetEntry,
    __doc__="One of several datasets (`[[data.datasets]]`): what it sets replaces `[data]`'s for its images.",
    **{
        name: (
            field.annotation | None,
            Field(None, description=field.description, json_schema_extra=field.json_schema_extra),
        )
        for name, field in DataConfig.model_fields.items()
        if name not in {"path", "resolution", "datasets", *RUN_WIDE_DATA_FIELDS}
    },
)
DataConfig.model_rebuild()


class AdapterConfig(Section):
    kind: Literal[tuple(KINDS)] = Field(  # adapter_kinds.py: what each kind is and allows
        "lora",
        description="`lora` or `dora` train an adapter through peft; `loha` and `lokr` are LyCORIS's Hadamard- and "
        "Kronecker-product adapters, through peft (saved in the LyCORIS keys ComfyUI and A1111 read "
        'with `export.format = "kohya"`; diffusers\' LoRA loader reads neither, so their diffusers '
        "layout is peft's, for peft and difftune); `none` trains all denoiser weights; `embedding` "
        "learns new token embeddings and nothing else (textual inversion; see the `embedding_*` keys); "
        "`controlnet` trains a ControlNet beside the frozen base on the control images of the data (SD 1.x/2.x, "
        "SDXL, SD3/3.5, Flux.1, Qwen-Image; the docs' Control guide).",
    )
    rank: int = Field(16, ge=1, description="Adapter rank.")
    alpha: float | None = Field(None, gt=0, description="Adapter alpha (scale = alpha / rank); defaults to the rank.")
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input (LoHa, LoKr: peft's rank dropout)."
    )
    rank_stabilized: bool = Field(
        False,
        description="rsLoRA (Kalajdzievski 2023): scale the adapter by alpha / sqrt(rank) instead of alpha / rank, so "
        "higher ranks keep learning; saved files say so (diffusers/peft), or carry the equivalent alpha (kohya).",
    )
    init: Literal["gaussian", "pissa", "olora"] = Field(
        "gaussian",
        description="How a LoRA starts: `gaussian` (B = 0, as diffusers' scripts), `pissa` (the base weight's "
        "principal singular vectors, taken out of the base; Meng et al. 2024) or `olora` (its QR factors; Buyukakyuz "
        "2024). Both train faster early on; the saved file is the change from the start, a plain LoRA of twice "
        "the rank that loads on the untouched base anywhere. Linear layers only; not with DoRA or `model.quantize`.",
    )
    target_modules: list[str] = Field(
        [],
        description="Denoiser (UNet or transformer) modules that get an adapter (names or name suffixes); empty: the "
        "family's default (SD, SDXL: the attention projections to_q, to_k, to_v, to_out.0; Flux: every block's "
        "attention and MLP projections, as diffusers' Flux script, plus the single blocks' proj_mlp).",
    )
    control_input: bool = Field(
        False,
        description="A control LoRA: the denoiser also reads each pair's control image (the edit pairs' layout), its "
        "latents joined to the noisy latents' channels, the input layer widened with zeros and adapted too "
        "(Flux.1: `FluxControlPipeline`'s Canny and Depth LoRAs, diffusers' train_control_lora_flux.py). LoRA or "
        "DoRA; the file is a diffusers-layout LoRA that widens the base as it loads.",
    )
    text_encoder: bool = Field(
        False,
        description="Also train the text encoders (both of SDXL's; Flux's CLIP, not T5, as FluxPipeline's LoRA loader "
        "reads): an adapter on each, or all their weights when `kind = none`.",
    )
    text_encoder_targets: dict[str, list[str]] = Field(
        {},
        description="Text-encoder modules that get an adapter when `text_encoder = true`, by the encoder's part name "
        '(`{ text_encoder = ["q_proj", "v_proj"], text_encoder_2 = [...] }`, as diffusers names a family\'s '
        "encoders); an encoder left out gets the family's default (CLIP's q_proj, k_proj, v_proj, out_proj).",
    )

    embedding_token: str = Field(
        "<concept>",
        description="`kind = embedding`: the new token (it must not be a word the tokenizer knows). With more than one "
        "vector it stands for `<token> <token>_1 ...`, as diffusers' loader expands it.",
    )
    embedding_vectors: int = Field(
        1, ge=1, description="`kind = embedding`: vectors (tokens) the concept is learned in."
    )
    embedding_init_word: str = Field(
        "",
        description="`kind = embedding`: a word whose embedding starts each vector (the mean of its tokens'); empty: "
        "random, with the vocabulary's mean and covariance.",
    )
    embedding_caption_word: str = Field(
        "",
        description="`kind = embedding`: this word in the captions is replaced by the token (so a folder captioned "
        "`a purple circle` trains the token for purple); empty: the captions hold the token themselves.",
    )

    @property
    def kind_type(self) -> AdapterKind:
        """What `kind` names: its facts, its config problems, and the type the adapters package acts on."""
        return KINDS[self.kind]

    @property
    def rewrites_base(self) -> bool:
        """An init that takes its starting factors out of the base weights (PiSSA, OLoRA; adapters/trained.py)."""
        return self.init != "gaussian"

    @property
    def is_adapter(self) -> bool:
        """Whether it trains a small adapter through peft (LoRA, DoRA, LoHa or LoKr) on frozen weights."""
        return isinstance(self.kind_type, PeftAdapter)

    @property
    def trains_all_weights(self) -> bool:
        """A full fine-tune: its trained parts are whole modules, saved whole."""
        return isinstance(self.kind_type, FullFineTune)

    @property
    def trains_controlnet(self) -> bool:
        """A ControlNet beside the frozen base, read from the data's control images."""
        return isinstance(self.kind_type, ControlNet)

    @property
    def trains_whole_parts(self) -> bool:
        """Its trained parts train every weight (a full fine-tune's, a ControlNet), kept in fp32."""
        return self.kind_type.trains_whole_parts

    @property
    def learns_tokens(self) -> bool:
        """Textual inversion: new tokens' embeddings, and no model weight changed."""
        return isinstance(self.kind_type, TokenEmbedding)

    @property
    def trains_text_encoders(self) -> bool:
        """Whether the text encoders' outputs change in training: adapted, or learning an embedding."""
        return self.text_encoder or self.learns_tokens

    @model_validator(mode="after")
    def _alpha_defaults_to_rank(self) -> AdapterConfig:
        if self.alpha is None:
            self.alpha = float(self.rank)
        return self


def adapter_fits_the_other_sections(config: Config) -> None:
    """What the adapter kind allows of the rest of the config (its own `problems`: its init, its scale, the
    model's quantization, the prior, validation and export settings), and what a training adapter needs."""
    if config.model.training_adapter and not config.adapter.is_adapter:
        raise ValueError(
            "model.training_adapter needs an adapter (adapter.kind lora, dora, loha or lokr): a full "
            "fine-tune or an embedding would be saved for the base with the training adapter merged in"
        )
    problem = next(config.adapter.kind_type.problems(config), None)
    if problem:
        raise ValueError(problem)
    if config.adapter.control_input:
        refused = {
            f'adapter.kind = "{config.adapter.kind}" (a control LoRA is a LoRA or DoRA, as diffusers loads it)': not (
                config.adapter.kind_type.scaled_product
            ),
            'export.format = "kohya" (its widened input layer has no kohya layout)': config.export.format == "kohya",
            f'preference.method = "{config.preference.method}"': config.preference.method != "off",
            "[slider]": config.slider.enabled,
            "[prior]": config.prior.enabled,
            "validation.path": bool(config.validation.path),
        }
        named = [setting for setting, is_set in refused.items() if is_set]
        if named:
            raise ValueError("adapter.control_input cannot train with " + "; ".join(named))


class LossConfig(Section):
    prediction_type: Literal["auto", "epsilon", "v_prediction"] = Field(
        "auto",
        description="What the UNet predicts; `auto` takes it from the model's scheduler config. Flow-matching families "
        "(Flux) always predict the velocity noise - x0 and take `auto` only.",
    )
    weighting: Literal["auto", "min_snr", "soft_min_snr", "debiased", "uniform", "sigma_sqrt", "cosmap"] = Field(
        "auto",
        description="Per-timestep loss weight. `auto`: the family's usual, Min-SNR-gamma (Hang et al. 2023) for the "
        "UNet families, none for flow matching. `soft_min_snr`: its smooth form, SNR*gamma/(SNR+gamma) "
        "(Crowson et al. 2024); `debiased`: debiased estimation, 1/sqrt(SNR) (Yu et al. 2024, kohya's "
        "`debiased_estimation_loss`); these three are for the UNet families. `uniform` is none; `sigma_sqrt` "
        "and `cosmap` (Esser et al. 2024, as diffusers' SD3/Flux scripts) are for flow matching.",
    )
    snr_gamma: float = Field(5.0, gt=0, description="Gamma of Min-SNR and soft-min-SNR weighting.")
    type: Literal["l2", "l1", "huber", "smooth_l1"] = Field(
        "l2",
        description="The error each latent pixel's prediction is scored by (kohya's `loss_type`): `l2` squared, `l1` "
        "absolute, `huber` the pseudo-Huber 2c(sqrt(e^2 + c^2) - c) (quadratic under c, linear over it: outliers "
        "pull less), `smooth_l1` the same over c. c follows `huber_schedule`. Weightings and masks apply as to `l2`.",
    )
    huber_schedule: Literal["snr", "exponential", "constant"] = Field(
        "snr",
        description="`huber` / `smooth_l1`: c per sample, as kohya's `huber_schedule`: `snr` (1 - huber_c) / (1 + "
        "noise-to-signal)^2 + huber_c (1 on clean latents, huber_c on noise; flow matching's noise-to-signal is "
        "sigma / (1 - sigma)), `exponential` huber_c ** (timestep / steps), `constant` huber_c.",
    )
    huber_c: float = Field(
        0.1, gt=0, le=1, description="`huber` / `smooth_l1`: the threshold c, or its schedule's end."
    )
    timestep_sampling: Literal["uniform", "logit_normal", "mode"] = Field(
        "uniform",
        description="How training draws each sample's point on the noise schedule: uniformly, logit-normal (more "
        "weight mid-schedule, SD3's choice), or SD3's `mode` density. For the UNet families it picks the timestep.",
    )
    logit_mean: float = Field(0.0, description='`timestep_sampling = "logit_normal"`: mean of the normal.')
    logit_std: float = Field(
        1.0, gt=0, description='`timestep_sampling = "logit_normal"`: standard deviation of the normal.'
    )
    mode_scale: float = Field(1.29, description='`timestep_sampling = "mode"`: its scale (SD3\'s 1.29).')
    flow_shift: float = Field(
        1.0,
        gt=0,
        description="Flow-matching families: shift the drawn noise levels toward noise, sigma <- s*sigma / (1 + "
        "(s-1)*sigma) (SD3's shift; kohya's `discrete_flow_shift`, e.g. 3.0); 1 is none.",
    )
    flow_shift_by_resolution: bool = Field(
        False,
        description="Flow-matching families: shift by the image's size instead, as the base's scheduler does when "
        "sampling (Flux.1, Qwen-Image: exp(mu), mu linear in the latent token count from `base_shift` to `max_shift`; "
        "a scheduler without dynamic shifting, Z-Image's: its one `shift`); overrides `flow_shift`.",
    )
    noise_offset: float = Field(
        0.0,
        ge=0,
        description="Add this times a per-channel constant to the noise (darker darks, brighter brights); 0 is off.",
    )
    input_perturbation: float = Field(
        0.0, ge=0, description="Perturb the noise the UNet sees (not its target) by this times fresh noise; 0 is off."
    )
    zero_terminal_snr: bool = Field(
        False,
        description="Rescale the noise schedule so its last step is pure noise (Lin et al. 2023); needs v-prediction. "
        "UNet families only: flow matching reaches pure noise already.",
    )


def zero_terminal_snr_needs_v_prediction(config: Config) -> None:
    """At zero SNR only a velocity can be predicted."""
    if config.loss.zero_terminal_snr and config.loss.prediction_type != "v_prediction":
        raise ValueError(
            'loss.zero_terminal_snr = true needs loss.prediction_type = "v_prediction" (at zero SNR the noise '
            "cannot be predicted from a pure-noise input)"
        )


class OptimConfig(Section):
    optimizer: Literal[
        "adamw",
        "adamw_8bit",
        "lion",
        "adafactor",
        "adamw_cpu_offload",
        "galore_adamw",
        "prodigy",
        "adamw_schedule_free",
    ] = Field(
        "adamw",
        description="AdamW (fused), AdamW 8-bit (the `bnb` extra), Lion, Adafactor (fixed learning rate, no relative "
        "steps), AdamW with its state offloaded to the CPU (torchao; CUDA only; the `torchao` extra), GaLore "
        "AdamW (low-rank moments of each weight matrix; full fine-tunes only; the `galore` extra), Prodigy "
        "(finds its own step size: set `learning_rate = 1`, its multiplier; the `prodigy` extra) or "
        "schedule-free AdamW (no schedule: `lr_schedule` stays `constant` and `warmup_steps` is its own "
        "warmup; its averaged weights are what is validated, sampled and saved; the `schedulefree` extra).",
    )
    learning_rate: float = Field(
        1e-4, gt=0, le=MAX_LEARNING_RATE, description="Peak learning rate of the denoiser's (UNet's) parameters."
    )
    text_encoder_learning_rate: float | None = Field(
        None,
        gt=0,
        le=MAX_LEARNING_RATE,
        description="Peak learning rate of the text encoders' parameters; defaults to `learning_rate`.",
    )
    betas: tuple[float, float] = Field(
        (0.9, 0.999), strict=False, description="Betas of AdamW and Lion (Lion: 0.9, 0.99 is usual)."
    )
    weight_decay: float = Field(1e-2, ge=0, description="Decoupled weight decay.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float = Field(1.0, ge=0, description="Clip the global gradient norm to this; 0 disables clipping.")
    lr_schedule: Literal["constant", "linear", "cosine", "cosine_with_restarts"] = Field(
        "constant", description="Learning-rate shape after warmup (linear and cosine decay to 0 at `train.max_steps`)."
    )
    lr_cycles: int = Field(1, ge=1, description="Number of cosine cycles for `cosine_with_restarts`.")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup from 0.")
    scale_lr: Literal["none", "linear", "sqrt"] = Field(
        "none",
        description="Scale the learning rates by the global batch (batch_size x processes x accumulation steps): "
        "`linear` multiplies them by it, `sqrt` by its square root, so `learning_rate` is the rate for one image per "
        "step; `none` uses them as given. The scaled rates are printed and logged as `lr`.",
    )

    loraplus_ratio: float = Field(
        0.0,
        ge=0,
        description="LoRA+ (Hayou et al. 2024): train each adapter's B (up) matrices, and DoRA's magnitudes, at this "
        "many times the learning rate (the paper: 16); 0 is off.",
    )
    prodigy_d_coef: float = Field(1.0, gt=0, description="`prodigy`: multiplier of its estimated step size D.")
    galore_rank: int = Field(128, ge=1, description="`galore_adamw`: rank of each weight matrix's gradient projection.")
    galore_update_proj_gap: int = Field(
        200, ge=1, description="`galore_adamw`: optimizer steps between refreshes of the projections (an SVD each)."
    )
    galore_scale: float = Field(0.25, gt=0, description="`galore_adamw`: scale of the projected update.")

    @model_validator(mode="after")
    def _text_encoder_lr_defaults(self) -> OptimConfig:
        if self.text_encoder_learning_rate is None:
            self.text_encoder_learning_rate = self.learning_rate
        return self

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError(f"each beta must be in [0, 1), got {list(value)}")
        return value


def optimizer_fits_the_run(config: Config) -> None:
    """What each optimizer allows of the adapter, the schedule and the EMA."""
    if config.optim.optimizer == "prodigy" and (
        config.optim.text_encoder_learning_rate != config.optim.learning_rate or config.optim.loraplus_ratio
    ):
        raise ValueError(
            'optim.optimizer = "prodigy" estimates one step size for all parameters and refuses groups at other '
            "rates: leave optim.text_encoder_learning_rate unset "
            "(or equal to learning_rate) and loraplus_ratio at 0"
        )
    if config.optim.optimizer == "adamw_schedule_free":
        if config.optim.lr_schedule != "constant":
            raise ValueError(
                f'optim.optimizer = "adamw_schedule_free" replaces the schedule (its averaging does what decay '
                'does): set optim.lr_schedule = "constant", not '
                f'"{config.optim.lr_schedule}" (warmup_steps still apply)'
            )
        if config.ema.enabled:
            raise ValueError(
                'ema.enabled with optim.optimizer = "adamw_schedule_free": its saved weights are an average '
                "already; turn the EMA off"
            )
    if config.optim.optimizer == "galore_adamw" and not config.adapter.trains_all_weights:
        raise ValueError(
            'optim.optimizer = "galore_adamw" is for full fine-tunes (adapter.kind = "none"): an adapter\'s '
            "matrices are low-rank already, so projecting their gradients saves nothing"
        )


class TrainConfig(Section):
    output_dir: str = Field(
        "output/run",
        json_schema_extra=PATH_LOCAL,
        description="Where the adapter, resolved config, metrics and samples are written.",
    )
    _output_dir_not_empty = field_validator("output_dir")(not_empty)
    overwrite: bool = Field(False, description="Allow writing into an output_dir that already holds a finished run.")
    max_steps: int = Field(1000, ge=1, description="Optimizer steps to train.")
    batch_size: int = Field(1, ge=1, description="Images per process per micro-step.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-steps per optimizer step.")
    global_batch_size: int = Field(
        0,
        ge=0,
        description="Images per optimizer step over all processes; when set, the accumulation steps are derived as "
        "global_batch_size / (batch_size x processes), which must be a whole number. 0: use "
        "gradient_accumulation_steps.",
    )
    mixed_precision: Literal["no", "fp16", "bf16", "fp8"] = Field(
        "no",
        description="Autocast precision (fp16 needs CUDA). `fp8`: linear layers compute in FP8 through torchao (via "
        "accelerate), the rest in bf16; needs a GPU with FP8 tensor cores "
        "(compute capability 8.9+, e.g. H100) and the `torchao` extra.",
    )
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed for the data order, augmentations, timesteps and noise.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward: less memory, slower.")
    channels_last: Switch = Field(
        "auto",
        description="Channels-last memory format for the denoiser; `auto`: on with CUDA (faster convolutions "
        "there), off elsewhere (on CPU it measured no faster and held 2.1 GB more at SD1.5 size).",
    )
    attention: Literal["sdpa", "sdpa_cudnn", "xformers"] = Field(
        "sdpa",
        description="Attention kernel: PyTorch SDPA with its cuDNN kernel left out on CUDA (it gave NaN gradients on "
        "the tiny Flux job in bf16 on an H100, docs/benchmarks.md), `sdpa_cudnn` SDPA with every kernel torch picks "
        "(diffusers' scripts' setting), or xformers (needs the `xformers` extra).",
    )
    check_memory: bool = Field(
        True,
        description="Before loading any weight, predict the run's peak device memory and host RAM in each phase "
        "(`difftune plan`): refuse a run whose host peak exceeds the RAM available, naming the phase and the settings "
        "that fit; warn when the device peak exceeds the GPU's memory.",
    )
    compile: bool = Field(
        False,
        description="torch.compile the denoiser in place (checkpoints keep their keys): a UNet whole, a transformer "
        "block by block (regional compilation: one graph per kind of block, compiled in seconds): slow first steps, "
        "faster after. CUDA only: on CPU, torch 2.13's inductor gave the UNet wrong LoRA gradients.",
    )
    tf32: Switch = Field(
        "auto",
        description="TF32 matmuls and convolutions (Ampere and newer GPUs); `auto`: on with CUDA. Has no effect off "
        "CUDA.",
    )
    cudnn_benchmark: Switch = Field(
        "auto",
        description="Let cuDNN pick the fastest convolution kernels for fixed shapes; `auto`: on with CUDA. Has no "
        "effect off CUDA.",
    )

    _switches_from_bool = field_validator("channels_last", "tf32", "cudnn_benchmark", mode="before")(switch_from_bool)


def global_batch_derives_the_accumulation(config: Config) -> None:
    """`train.global_batch_size` sets the accumulation steps from the batch size."""
    if config.train.global_batch_size:
        if config.train.gradient_accumulation_steps != 1:
            raise ValueError(
                "train.global_batch_size derives the accumulation steps: leave train.gradient_accumulation_steps "
                "at 1, or set global_batch_size = 0"
            )
        if config.train.global_batch_size % config.train.batch_size:
            raise ValueError(
                f"train.global_batch_size {config.train.global_batch_size} is not a multiple of train.batch_size "
                f"{config.train.batch_size}"
            )


class EmaConfig(Section):
    enabled: bool = Field(
        False, description="Keep an exponential moving average of the trained parameters and save it too."
    )
    decay: float = Field(0.999, gt=0, lt=1, description="EMA decay (the largest, with warmup).")
    warmup: bool = Field(
        True, description="Ramp the decay up as 1 - (1 + step)^-power (diffusers' EMA warmup); off: constant `decay`."
    )
    power: float = Field(
        2 / 3, gt=0, description="Exponent of the warmup ramp (2/3 suits runs of ~100k steps, 3/4 shorter)."
    )
    every_steps: int = Field(
        1, ge=1, description="Update the EMA every N optimizer steps (each update applies one decay)."
    )
    offload_to_cpu: bool = Field(
        False, description="Keep the EMA weights on the CPU between updates (saves GPU memory)."
    )


class GuardConfig(Section):
    enabled: bool = Field(
        True,
        description="Skip an optimizer step whose loss or gradient norm is NaN/inf, or a spike: parameters, optimizer "
        "state and EMA stay as they were; each skip is logged to skipped_steps.jsonl with its images.",
    )
    spike_factor: float = Field(
        10.0,
        ge=0,
        description="Also skip a step whose loss or gradient norm exceeds this times its running mean; 0 is off.",
    )
    spike_warmup_steps: int = Field(20, ge=1, description="Accepted steps of history before spikes are judged.")
    max_consecutive_skips: int = Field(
        5, ge=1, description="Diverged after this many skipped steps in a row: stop, or with `rollback` go back."
    )
    max_loss: float = Field(0.0, ge=0, description="Also diverged when a step's loss exceeds this; 0 is off.")
    rollback: bool = Field(
        False,
        description="On divergence, reload the last complete checkpoint and go on past the offending batches, "
        "instead of stopping (needs checkpoint.every_steps).",
    )
    max_rollbacks: int = Field(3, ge=1, description="Stop after this many rollbacks.")
    activation_spike_factor: float = Field(
        10.0,
        ge=0,
        description="With `log.activations_every_steps`: warn when a block's largest output exceeds this times its "
        "running mean, often the first sign of a coming divergence; 0 is off.",
    )


def rollback_needs_checkpoints(config: Config) -> None:
    """A rollback goes back to a checkpoint."""
    if config.guard.rollback and not config.checkpoint.every_steps:
        raise ValueError("guard.rollback needs checkpoint.every_steps > 0 (checkpoints to roll back to)")


class PriorConfig(Section):
    class_path: str = Field(
        "",
        json_schema_extra=PATH_LOCAL,
        description="DreamBooth prior preservation: a folder of class images (same layouts as `data.path`; uncaptioned "
        "ones take `class_prompt`), trained beside the instance images at `loss_weight`, "
        "as many per epoch as there are instance images (cycled or cut). Empty "
        "with `num_class_images` > 0: drawn into the cache folder and reused.",
    )
    class_prompt: str = Field(
        "",
        description="What the class images show, e.g. `a photo of a dog`: their caption, and the prompt drawn ones "
        "come from.",
    )
    num_class_images: int = Field(
        0,
        ge=0,
        description="When the class folder holds fewer images, draw the rest with the untouched base before training "
        "(resumable: each is written as it is finished). 0 draws "
        "none; with no `class_path` either, prior preservation is off.",
    )
    loss_weight: float = Field(
        1.0, ge=0, description="Loss weight of the class images (diffusers' and kohya's `prior_loss_weight`)."
    )
    negative_prompt: str = Field("", description="Negative prompt of the drawn class images.")
    steps: int = Field(30, ge=1, description="Denoising steps of each drawn class image.")
    guidance_scale: float = Field(7.5, ge=1.0, description="Guidance scale of the drawn class images.")
    seed: int = Field(
        0, ge=0, le=2**32 - 1, description="Seed of the drawn class images; image i's is a function of it and i."
    )
    batch_size: int = Field(4, ge=1, description="Class images drawn per pipeline call.")

    @property
    def enabled(self) -> bool:
        return bool(self.class_path or self.num_class_images)

    @model_validator(mode="after")
    def _prompt_to_draw_from(self) -> PriorConfig:
        if self.num_class_images and not self.class_prompt:
            raise ValueError(
                "prior.num_class_images needs prior.class_prompt, the prompt the class images are drawn from"
            )
        return self


class PreferenceConfig(Section):
    method: Literal["off", "dpo"] = Field(
        "off",
        description="Preference tuning. `dpo`: Diffusion-DPO (Wallace et al.; diffusers' `diffusion_dpo` example, its "
        "flow-matching form for flow families as SimpleTuner's): each image of the data is the preferred (chosen) "
        "one for its caption, and the pair's control image (`data.control_path`, or a `control` folder beside the "
        "images, by stem: the edit pairs' layout) the rejected one. The adapter learns to lower its loss on the chosen "
        "image more than the frozen base does, and on the rejected one less; the reference is the base itself with "
        "every adapter off (the text encoders' too), never a second copy in memory. Needs a LoRA-like adapter.",
    )
    beta: float = Field(
        2500.0,
        gt=0,
        description="`dpo`: how strongly the preference is enforced against staying near the base (diffusers' "
        "`beta_dpo`: 2500 for SD 1.5, 5000 for SDXL).",
    )
    chosen_weight: float = Field(
        0.0,
        ge=0,
        description="`dpo`: the weight of the objective's own loss on the chosen image, added to the preference loss "
        "(DPO with an SFT term, as RPO): it holds the model to drawing the chosen images where the preference alone "
        "can be met by raising the loss of both (the tiny job forgot 0.25 of the seen prompts without it, 0.00-0.03 "
        "at 5).",
    )


def switchable_adapter_problems(config: Config) -> list[str]:
    """What keeps a run from taking the base as its reference by switching its adapter off (Diffusion-DPO's and the
    reward runs' reference): a full fine-tune, an embedding or a ControlNet cannot be switched off."""
    if isinstance(config.adapter.kind_type, PeftAdapter):
        return []
    return [f'adapter.kind = "{config.adapter.kind}" (use lora, dora, loha or lokr: an adapter to switch off)']


def preference_fits_the_run(config: Config) -> None:
    """Diffusion-DPO's reference is the base with every adapter off (the text encoders' too): adapters that can be
    switched off."""
    if config.preference.method == "off":
        return
    problems = switchable_adapter_problems(config)
    if config.prior.enabled:
        problems.append("[prior] (class images have no rejected image)")
    if problems:
        raise ValueError(f'preference.method = "{config.preference.method}" cannot train with ' + "; ".join(problems))


class SliderConfig(Section):
    positive: str = Field(
        "",
        description="Concept slider (ai-toolkit's, after Gandikota et al.): the prompt the LoRA's positive scale "
        "moves towards (e.g. `a large dog`), against `negative`; both set turn the mode on. The data's images are "
        "only noised inputs (their captions are not read); at scale +1 the LoRA learns to predict, for `target`, the "
        "base's prediction plus `guidance` x (positive - negative), at -1 the base's minus it, so the signed scale "
        "moves one attribute.",
    )
    negative: str = Field("", description="The prompt the LoRA's negative scale moves towards (e.g. `a small dog`).")
    target: str = Field(
        "", description="The prompt the slider acts on (e.g. `a dog`); empty: every image, unconditionally."
    )
    guidance: float = Field(
        3.0, gt=0, description="How far scale 1 moves along positive - negative (ai-toolkit's guidance_strength)."
    )

    @property
    def enabled(self) -> bool:
        return bool(self.positive or self.negative)

    @model_validator(mode="after")
    def _both_ends(self) -> SliderConfig:
        if self.enabled and not (self.positive and self.negative):
            raise ValueError("slider: set both slider.positive and slider.negative (the two ends the scale moves to)")
        return self


def slider_fits_the_run(config: Config) -> None:
    """A slider's negative scale is its LoRA's change reversed, and its targets are the frozen base's predictions."""
    if not config.slider.enabled:
        return
    problems = []
    kind = config.adapter.kind_type
    if not isinstance(kind, LoRA) or kind.magnitudes:  # DoRA's magnitudes do not reverse with the scale
        problems.append(f'adapter.kind = "{config.adapter.kind}" (a slider is a LoRA, whose change reverses at -1)')
    if config.adapter.text_encoder:
        problems.append("adapter.text_encoder = true (the denoiser's LoRA alone slides)")
    if config.train.gradient_checkpointing:  # its backward would recompute the -1 pass at +1
        problems.append("train.gradient_checkpointing (the backward recomputes both scales' passes at one scale)")
    if config.preference.method != "off":
        problems.append(f'preference.method = "{config.preference.method}"')
    if config.prior.enabled:
        problems.append("[prior]")
    if problems:
        raise ValueError("slider cannot train with " + "; ".join(problems))


class RewardConfig(Section):
    method: Literal["off", "grpo", "draft", "refl"] = Field(
        "off",
        description="Reward fine-tuning: no images, a scorer. `grpo`: Flow-GRPO (Liu et al. 2025; DDPO's form for the "
        "epsilon and v families): each step draws `group_size` images of each of `train.batch_size` prompts with the "
        "family's sampler made stochastic, scores them, and raises the log-probability of the steps that led to the "
        "images scored above their prompt's group mean (a clipped ratio, as PPO's), with a KL term to the base (the "
        "adapter off). `draft`: DRaFT-K (Clark et al. 2024): gradients from a differentiable scorer through the last "
        "`draft_last_steps` steps of a deterministic sample. `refl`: ReFL (Xu et al. 2023, ImageReward): the sample "
        "stops at a random one of its last `refl_last_steps` steps, and the scorer's gradient flows through the image "
        "that step predicts in one jump. Needs a LoRA-like adapter on the denoiser alone.",
    )
    scorer: str = Field(
        "",
        description="`module:function` called as function(images, prompts, **scorer_options) -> scores: images a "
        "(B, 3, H, W) tensor in [0, 1], prompts B strings, scores B numbers, higher better (a tensor with gradients "
        "for `draft` and `refl`). Shipped: `difftune.rewards:clip_score` (a local CLIP model, `scorer_options.model`), "
        "`difftune.toy.judge:shapes_reward` (the tiny shapes bases' judge).",
    )
    scorer_options: dict[str, str | float | int | bool] = Field(
        {}, description='Keyword arguments for the scorer (e.g. `{ model = "/models/clip" }`).'
    )
    prompts: list[str] = Field(
        [],
        description="The prompts drawn and scored: the run's data (`train.batch_size` of them a step, each process).",
    )
    group_size: int = Field(
        8, ge=2, description="`grpo`: images drawn per prompt; each is scored against its group's mean and spread."
    )
    steps: int = Field(
        10, ge=2, description="Denoising steps of the images drawn while training (Flow-GRPO: fewer than at drawing)."
    )
    guidance_scale: float = Field(
        1.0, ge=1, description="Classifier-free guidance of the images drawn while training (1: none)."
    )
    noise_level: float = Field(
        0.7,
        ge=0,
        description="The noise of the sampler that draws the images while training (Flow-GRPO's a; DDIM's eta for "
        "the epsilon and v families, 1 being DDPM's ancestral sampler). `grpo` explores by it; `draft` at 0 draws "
        "deterministically, as the DRaFT paper, and above 0 trains on the states a stochastic sampler passes.",
    )
    trained_steps: int = Field(
        0, ge=0, description="`grpo`: denoising steps trained per image each step, drawn at random; 0: all of them."
    )
    updates_per_round: int = Field(
        1,
        ge=1,
        description="`grpo`: optimizer steps on each round of drawn images; after the first the policy has moved, "
        "and `clip_range` bounds its ratio.",
    )
    clip_range: float = Field(1e-4, gt=0, description="`grpo`: the policy ratio's clip (Flow-GRPO's 1e-4).")
    kl_weight: float = Field(
        0.04,
        ge=0,
        description="The KL term's weight, the base (the adapter off) its reference. `grpo`: each trained step's KL "
        "divergence from the base's step. `draft`, `refl`: the squared distance of each step's prediction from the "
        "base's.",
    )
    draft_last_steps: int = Field(
        1, ge=1, description="`draft`: the last steps gradients flow through (DRaFT-K's K; DRaFT-LV is K = 1)."
    )
    refl_last_steps: int = Field(
        1,
        ge=1,
        description="`refl`: the steps the sample may stop at, the last ones (ReFL's range: 10 of 40 in its paper); "
        "1 jumps from the last step alone.",
    )

    @property
    def enabled(self) -> bool:
        return self.method != "off"

    @model_validator(mode="after")
    def _scorer_and_prompts(self) -> RewardConfig:
        if not self.enabled:
            return self
        if ":" not in self.scorer:
            raise ValueError(
                f"reward.scorer = {self.scorer!r}: name the scoring function as module:function "
                '(e.g. "difftune.rewards:clip_score")'
            )
        if not self.prompts:
            raise ValueError("reward.prompts: list the prompts to draw and score (reward training reads no images)")
        if self.method == "grpo" and self.noise_level == 0:
            raise ValueError("reward.noise_level 0: GRPO explores by the sampler's noise; set it above 0 (e.g. 0.7)")
        if self.method == "draft" and self.draft_last_steps > self.steps:
            raise ValueError(f"reward.draft_last_steps {self.draft_last_steps}: at most reward.steps ({self.steps})")
        if self.method == "refl" and self.refl_last_steps > self.steps:
            raise ValueError(f"reward.refl_last_steps {self.refl_last_steps}: at most reward.steps ({self.steps})")
        return self


def reward_fits_the_run(config: Config) -> None:
    """The reward run's reference is the base with the adapter off (as Diffusion-DPO's), and it draws its own images."""
    if not config.reward.enabled:
        return
    problems = switchable_adapter_problems(config)
    if config.adapter.text_encoder:
        problems.append("adapter.text_encoder = true (the prompts are encoded once; the denoiser's adapter is tuned)")
    for setting, is_set in {
        f'preference.method = "{config.preference.method}"': config.preference.method != "off",
        "[slider]": config.slider.enabled,
        "[prior]": config.prior.enabled,
        "validation.path": bool(config.validation.path),
        "train.gradient_accumulation_steps > 1": config.train.gradient_accumulation_steps > 1,
    }.items():
        if is_set:
            problems.append(setting)
    if problems:
        raise ValueError(f'reward.method = "{config.reward.method}" cannot train with ' + "; ".join(problems))
    # Nothing to cache: no images are read, and the prompts are encoded as each round draws them
    config.cache.latents = config.cache.text = "off"


class ValidationConfig(Section):
    path: str = Field(
        "",
        json_schema_extra=PATH_LOCAL,
        description="Held-out image folder (same layouts as `data.path`); empty disables validation loss.",
    )
    every_steps: int = Field(
        100, ge=1, description="Compute the validation loss every N optimizer steps, and at the end."
    )
    timesteps: list[int] = Field(
        [100, 300, 500, 700, 900],
        min_length=1,
        description="Fixed timesteps at which each held-out image is scored (with fixed noise): comparable across "
        "runs.",
    )
    seed: int = Field(0, ge=0, description="Seed of the validation noise.")
    keep_best: bool = Field(
        True,
        description="Keep the result of the lowest validation loss so far as `<result>_best` (the adapter file, or "
        "`model_best/`), written whenever it improves; best.json and the end of the log name its step.",
    )
    min_delta: float = Field(
        0.0, ge=0, description="A validation loss counts as an improvement when lower than the best by more than this."
    )
    early_stop_patience: int = Field(
        0,
        ge=0,
        description="Stop after this many validations in a row without an improvement; the end-of-run files are "
        "written as usual and `_best` holds the best. 0 is off.",
    )
    eval_concept: str = Field(
        "",
        description="For the bundled shapes bases (models/tiny-*): also judge samples at each validation as `difftune "
        "eval` does, for this held-out color (a tone base's: pitch; logged as `eval_concept`, `eval_seen` and their "
        "mean `eval_score`), and keep the best-scoring result as `<result>_best_eval`. Empty is off.",
    )
    eval_samples_per_prompt: int = Field(2, ge=1, description="`eval_concept`: samples per prompt (fixed seeds).")


def watched_metrics_need_held_out_data(config: Config) -> None:
    """Early stopping and the judged score need `validation.path`."""
    watching = {
        "validation.early_stop_patience": config.validation.early_stop_patience,
        "validation.eval_concept": config.validation.eval_concept,
    }
    unwatched = [name for name, value in watching.items() if value and not config.validation.path]
    if unwatched:
        raise ValueError(f"{', '.join(unwatched)} needs validation.path (the held-out images each validation scores)")


class PromptWithControls(Section):
    """A sample prompt for an edit base: the instruction and the control images it edits."""

    prompt: str = Field(description="The instruction, e.g. `make it purple`.")
    controls: list[str] = Field(min_length=1, description="Control image files, in the order the base reads them.")
    mask: str | None = Field(
        None,
        description="An inpainting mask, white where the base draws: the prompt paints into its first control image, "
        "through the family's inpaint pipeline (an inpainting base's; Z-Image's and FLUX.2 [klein]'s, which draw with "
        "the text-to-image base and its adapters; [klein]'s further controls are its references).",
    )


class SampleConfig(Section):
    prompts: list[str | PromptWithControls] = Field(
        [],
        description="Prompts to sample at the end of training; empty skips sampling. For an edit base an entry may "
        'carry its control images: `{prompt = "make it purple", controls = ["source.png"]}` (in the form, one '
        "such JSON object a line); a ControlNet run's entries each carry the one control image it draws from (on an "
        'inpainting base, after the image and its mask); an entry with `mask = "mask.png"` paints into its first '
        "control image where the mask is white (inpainting bases, Z-Image, FLUX.2 [klein]).",
    )
    negative_prompt: str = Field("", description="Negative prompt for every sample.")
    steps: int = Field(30, ge=1, description="Denoising steps per image.")
    guidance_scale: float = Field(
        7.5,
        ge=1.0,
        description="Classifier-free guidance scale (1 disables it). A guidance-distilled Flux base takes it as its "
        "guidance embedding (FLUX.1-dev: about 3.5) and runs one pass.",
    )
    scheduler: Literal["auto", "ddim", "euler", "euler_a", "dpmpp_2m"] = Field(
        "auto",
        description="Sampling scheduler; `auto`: the family's usual (DDIM for the UNet families, flow-matching Euler "
        "for Flux, the only one Flux takes).",
    )
    seed: int = Field(0, ge=0, description="Seed of the first image; image i uses seed + i.")
    resolution: int | None = Field(
        None,
        ge=8,
        le=MAX_SIDE,
        description="Sample size in pixels; defaults to `data.resolution` (several datasets: the largest of theirs).",
    )
    images_per_prompt: int = Field(1, ge=1, description="Images per prompt, each with the next seed.")
    frames: int = Field(
        1,
        ge=1,
        description="Video bases (Wan): frames per sample, 4k + 1 (Wan 2.1 draws 81 at 16 fps); each sample is written "
        "as an MP4 with its prompt in the metadata (an animated WebP where PyAV is not installed), its first frame in "
        "the grid. 1: images.",
    )
    fps: int = Field(16, ge=1, le=120, description="Frame rate of sample clips (`frames` > 1); Wan 2.1's is 16.")
    every_steps: int = Field(
        0, ge=0, description="Also sample (a preview grid) every N optimizer steps; 0 only at the end."
    )
    before: bool = Field(
        False,
        description="Also sample the prompts with the untouched base before training (`samples/before/`), for a "
        "before/after comparison.",
    )
    decoder: str = Field(
        "",
        json_schema_extra=PATH_MODEL,
        description="Autoencoder that decodes samples: empty for the model's own; a folder/hub id of TAESD "
        "(`AutoencoderTiny`) for fast previews.",
    )
    parity: bool = Field(
        True,
        description="After the final save, reload the saved result into a fresh pipeline (each adapter layout), draw "
        "the first prompt's first image (a clip: every frame) again and record its largest "
        "pixel difference from the in-training sample in parity.json; warn above 2/255.",
    )


def sample_size_defaults_to_the_data(config: Config) -> None:
    """`sample.resolution` unset: the training resolution."""
    if config.sample.resolution is None:
        config.sample.resolution = config.data.largest_resolution()


# `[sample]` fields that mean something only inside a training run: `difftune sample` and the UI's Sample tab
# leave them out.
TRAINING_ONLY_SAMPLE_FIELDS = ("every_steps", "before", "parity")


class CacheConfig(Section):
    latents: Switch = Field(
        "auto",
        description="Encode each image once and reuse it: the VAE posterior (mean and std) is cached, so runs "
        'train exactly as uncached ones, and the VAE leaves memory while training. Needs `data.crop = "center"`; '
        "flips are cached too. `auto`: on where the settings allow it.",
    )
    text: Switch = Field(
        "auto",
        description="Encode each caption once and reuse it; the text encoders leave memory while training. "
        "Needs the text encoders frozen (`adapter.text_encoder = false`). `auto`: on where the settings allow it.",
    )
    dir: str = Field(
        "",
        json_schema_extra=PATH_LOCAL,
        description="Cache folder, shared by runs and processes; empty: $XDG_CACHE_HOME/difftune or ~/.cache/difftune. "
        "A URL keeps it on object storage (`s3://bucket/difftune-cache`; the storage extra), one cache for machines "
        "without a shared file system.",
    )
    memory_mb: int = Field(
        1024,
        ge=0,
        description="Keep cache entries in RAM once read, up to this many MB per data-loader process, so "
        "later epochs skip the file reads; 0: read from disk every time.",
    )

    _switches_from_bool = field_validator("latents", "text", mode="before")(switch_from_bool)


def caches_resolved_and_possible(config: Config) -> None:
    """`auto` caches resolved (so the run's resolved config says what was cached); a cache refused where what it
    would hold changes every step."""
    datasets = config.data.each_dataset()
    random_crops = any(data.crop != "center" for data in datasets)
    if config.cache.latents == "auto":
        config.cache.latents = "off" if random_crops else "on"
    text_trained = config.adapter.trains_text_encoders
    fresh_captions = any(data.varies_captions and not data.caption_variants for data in datasets)
    if config.cache.text == "auto":
        config.cache.text = "off" if text_trained or fresh_captions else "on"
    if config.cache.text == "on" and fresh_captions:
        raise ValueError(
            "cache.text with data.shuffle_tags or data.tag_dropout (here or in a dataset) needs "
            'data.caption_variants > 0 (fixed variants per caption to cache), or cache.text = "off" (a fresh draw '
            "every step)"
        )
    if config.cache.latents == "on" and random_crops:
        raise ValueError('cache.latents needs data.crop = "center", in every dataset (a cached image has one crop)')
    if config.cache.text == "on" and text_trained:
        raise ValueError(
            'cache.text needs adapter.text_encoder = false and adapter.kind other than "embedding" (a trained '
            "encoder's outputs change)"
        )


class CheckpointConfig(Section):
    every_steps: int = Field(
        0, ge=0, description="Save a resumable checkpoint every N optimizer steps (and at the end); 0: only at the end."
    )
    keep_last: int = Field(
        3, ge=1, description="Checkpoints kept; older ones are deleted once a newer one is complete."
    )


class ExportConfig(Section):
    format: Literal["diffusers", "kohya"] = Field(
        "diffusers",
        description="The primary adapter file's layout (the run's result, its `_ema` / `_avg` variants): `diffusers` "
        "(pytorch_lora_weights.safetensors, for diffusers/peft) or `kohya` (<output_dir name>.safetensors, for "
        "ComfyUI, A1111, kohya). Every adapter run writes the "
        "other layout beside it too, where it can hold the adapter.",
    )
    every_steps: int = Field(
        0, ge=0, description="Also save the adapter every N steps under snapshots/; 0 only at the end."
    )
    average_last: int = Field(
        0,
        ge=0,
        description="At the end, average the last K saved adapters (snapshots and final) into an `_avg` file; 0 is "
        "off.",
    )
    average_weights: Literal["uniform", "linear", "exponential"] = Field(
        "uniform",
        description="Weights of `average_last`: equal, growing linearly, or doubling with each newer adapter.",
    )
    push_to_hub: str = Field(
        "",
        description="A Hugging Face model repository (`your-name/my-lora`) to upload the run's output folder to "
        "when it ends: the result files, the model card (README.md) and the samples, never checkpoints "
        "(`difftune push` does the same later, and uploads those with --with-checkpoints). Needs a login "
        "(`hf auth login` or HF_TOKEN); a failed upload is reported and leaves the local files as they are. Empty: no "
        "upload.",
    )
    hub_private: bool = Field(False, description="`push_to_hub`: make the repository private if the upload makes it.")


def averaging_needs_snapshots(config: Config) -> None:
    """`export.average_last` averages saved snapshots, two or more."""
    if config.export.average_last == 1:
        raise ValueError("export.average_last = 1 averages one adapter with itself; set 0 (off), or 2 or more")
    if config.export.average_last > 1 and not config.export.every_steps:
        raise ValueError("export.average_last needs export.every_steps > 0 (snapshots to average)")


class LogConfig(Section):
    tensorboard: bool = Field(True, description="Also log to TensorBoard (under output_dir/logs) when it is installed.")
    wandb: bool = Field(
        False,
        description="Also log to Weights & Biases (project `difftune`, the run named after output_dir), through "
        "accelerate's tracker: the same scalars as metrics.jsonl, the sample grids as images, the config. Needs "
        "`pip install wandb` and `wandb login`; `WANDB_MODE=offline` keeps the run under output_dir/logs/wandb "
        "(`wandb sync` uploads it later).",
    )
    progress_bar: bool = Field(True, description="Show a progress bar with loss, learning rate and speed.")
    quiet: bool = Field(
        False,
        description="Print warnings, errors and the run's last lines only: no line as each long step (loading, "
        "caching, samples, parity) starts and ends, and no bars. `difftune train --quiet` sets it.",
    )
    activations_every_steps: int = Field(
        0,
        ge=0,
        description="Every N optimizer steps, record the RMS and largest absolute value of each denoiser block's "
        "outputs (attention and resnet blocks too) as `act_rms/<block>` and `act_max/<block>`; 0 is off. Hooks are "
        "attached on those steps only, so other steps run at full speed.",
    )


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    ema: EmaConfig = Field(default_factory=EmaConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    prior: PriorConfig = Field(default_factory=PriorConfig)
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)
    slider: SliderConfig = Field(default_factory=SliderConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    sample: SampleConfig = Field(default_factory=SampleConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    log: LogConfig = Field(default_factory=LogConfig)

    @model_validator(mode="after")
    def _cross_section_rules(self) -> Config:
        """The rules across sections, each named beside the section it checks (`CROSS_SECTION_RULES`)."""
        for rule in CROSS_SECTION_RULES:
            rule(self)
        return self

    @property
    def frozen_weights_kept_apart(self) -> str:
        """Which settings keep the denoiser's frozen weights apart from the tensors its layers compute with (in
        another dtype, or in host memory: storage.py), as a phrase for messages; empty if none does."""
        kept = []
        if self.model.weight_dtype == "fp8":
            kept.append('model.weight_dtype = "fp8" keeps the denoiser\'s frozen weights in fp8')
        elif self.stores_frozen_weights:
            kept.append(
                f'model.weight_dtype = "{self.model.weight_dtype}" with train.mixed_precision = "no" keeps '
                "the denoiser's frozen weights in 16 bits"
            )
        if self.model.offload_blocks:
            kept.append(f"model.offload_blocks = {self.model.offload_blocks} keeps frozen weights in host memory")
        elif self.model.offload_budget:
            kept.append(f'model.offload_budget = "{self.model.offload_budget}" may keep frozen weights in host memory')
        return " and ".join(kept)

    @property
    def stores_frozen_weights(self) -> bool:
        """The denoiser's frozen layers are stored in `model.weight_dtype` and computed in another dtype
        (storage.py): fp8 computed in the mixed precision's dtype, or 16 bits computed in fp32."""
        return self.model.weight_dtype == "fp8" or (
            self.model.weight_dtype in ("fp16", "bf16") and self.train.mixed_precision == "no"
        )

    def to_toml(self) -> str:
        return tomli_w.dumps(self.model_dump(mode="json", exclude_none=True))


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read a TOML file (or start from defaults), apply `section.key=value` overrides, validate. Paths in the
    file are taken relative to the file, the rest relative to the working directory; all come back absolute."""
    source = str(path) if path else "defaults"
    data: dict[str, Any] = {}
    if path:
        data = _read_config_file(Path(path))
        if not data:
            raise DifftuneError(
                f"config file {path} sets nothing: a job names at least its base and its data (model.base, data.path); "
                "`difftune config` prints every key with its default"
            )
        resolve_path_values(data, Path(path).resolve().parent)
    for override in overrides:
        key, value = _parse_override(override)
        section, name, *entry = key.split(".")
        if entry:
            data.setdefault(section, {}).setdefault(name, {})[entry[0]] = value
        else:
            data.setdefault(section, {})[name] = value
    try:
        config = Config.model_validate(upgrade_moved_keys(data))
    except ValidationError as err:
        raise DifftuneError(describe_errors(source, err)) from None
    return absolute_paths(config, Path.cwd())


def _read_config_file(path: Path) -> dict[str, Any]:
    """A config file's TOML: UTF-8 (with or without the BOM Windows editors write), or UTF-16 with its BOM (Notepad's
    "Unicode"); anything else is refused naming the file, as is a folder or a file that is not valid TOML."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DifftuneError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise DifftuneError(f"config file {path} is a folder; pass a .toml file (configs/ holds examples)") from None
    encoding = "utf-16" if raw.startswith((b"\xff\xfe", b"\xfe\xff")) else "utf-8-sig"
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as err:
        raise DifftuneError(
            f"config file {path}: not text (byte {err.start} is no "
            f"{'UTF-16' if encoding == 'utf-16' else 'UTF-8'} character); save it as UTF-8 TOML"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise DifftuneError(f"{path}: not valid TOML: {err}") from None


def write_settings(path: str | Path, values: dict[str, Any]) -> Config:
    """Set `section.key` values in a TOML job file, keeping its comments and layout (tomlkit), then check that it
    still loads; the file is left as it was if it would not."""
    import tomlkit

    path = Path(path)
    original = path.read_text(encoding="utf-8")
    document = tomlkit.parse(original)
    for key, value in values.items():
        section, name = key.split(".")
        _field(section, name, where=f"write_settings({path})")
        document.setdefault(section, tomlkit.table())[name] = value
    path.write_text(tomlkit.dumps(document), encoding="utf-8")
    try:
        return load_config(path)
    except DifftuneError:
        path.write_text(original, encoding="utf-8")
        raise


def absolute_paths(config: Config, base_dir: Path) -> Config:
    """A copy whose relative paths are made absolute against `base_dir` (what a job file written elsewhere needs)."""
    data = config.model_dump(mode="json")
    resolve_path_values(data, base_dir)
    return Config.model_validate(data)


def resolve_path_values(data: dict, base_dir: Path, tables: dict[str, type[BaseModel]] | None = None) -> None:
    """Rewrite, in place, the relative path values of raw config data against `base_dir` (see PATH_LOCAL); `tables`:
    which model each table of `data` is (by default, the sections')."""
    tables = tables or {section: field.annotation for section, field in Config.model_fields.items()}
    for section, model in tables.items():
        values = data.get(section)
        if not isinstance(values, dict):
            continue
        for name, field in model.model_fields.items():
            kind = (field.json_schema_extra or {}).get("path")
            value = values.get(name)
            if not kind or not isinstance(value, str) or not value or Path(value).is_absolute() or is_url(value):
                continue
            candidate = _resolved(value, base_dir)
            if kind == "local" or candidate.exists():
                values[name] = str(candidate)
    for entry in (data.get("data") or {}).get("datasets") or []:  # each dataset's folders
        if isinstance(entry, dict):
            resolve_path_values({"data": entry}, base_dir, {"data": DatasetConfig})
    # an edit prompt's control images and inpainting mask (PromptWithControls)
    for entry in (data.get("sample") or {}).get("prompts") or []:
        if isinstance(entry, dict) and isinstance(entry.get("controls"), list):
            entry["controls"] = [str(_resolved(c, base_dir)) if isinstance(c, str) else c for c in entry["controls"]]
        if isinstance(entry, dict) and isinstance(entry.get("mask"), str):
            entry["mask"] = str(_resolved(entry["mask"], base_dir))


def _resolved(value: str, base_dir: Path) -> Path:
    return (base_dir / Path(value).expanduser()).resolve()


def _parse_override(override: str) -> tuple[str, Any]:
    """`adapter.rank=8` -> ("adapter.rank", 8): the value is read as the field's type expects. A table field takes
    one entry at a time: `model.family_options.guidance=3.5`."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or key.count(".") not in (1, 2):
        raise DifftuneError(f"override {override!r} must look like section.key=value, e.g. train.max_steps=100")
    key = MOVED_KEYS.get(key, (key,))[0]
    section, name, *entry = key.split(".")
    field = _field(section, name, where=f"override {override!r}")
    if entry and get_origin(field.annotation) is not dict:
        raise DifftuneError(f"override {override!r}: {section}.{name} is not a table; use {section}.{name}=value")
    if _is_text(field.annotation):  # as typed; a quoted one (`'train.output_dir=""'`) is the TOML string it spells
        quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'"
        return key, tomllib.loads(f"v = {text}")["v"] if quoted else text
    try:
        return key, tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        # A bare word (a text entry of a table, or a mistake for a typed field that validation reports).
        return key, text


# Keys that moved into the tables of family-owned settings (0.x): where each is now, and its old default, which
# every run and adapter file written before then records.
MOVED_KEYS = {
    "model.guidance": ("model.family_options.guidance", 1.0),
    "model.text_padding_mask": ("model.family_options.text_padding_mask", False),
    "adapter.text_encoder_target_modules": ("adapter.text_encoder_targets.text_encoder", []),
    "adapter.text_encoder_2_target_modules": ("adapter.text_encoder_targets.text_encoder_2", []),
}


def upgrade_moved_keys(data: dict) -> dict:
    """A config's sections (parsed TOML) with each moved key in its new place; at its old default it is dropped
    (a family without the setting would refuse it). Old config files, checkpoints and adapter metadata read so."""
    for old, (new, default) in MOVED_KEYS.items():
        section, name = old.split(".")
        if name not in data.get(section, {}):
            continue
        value = data[section].pop(name)
        if value != default:
            new_section, table, entry = new.split(".")
            data.setdefault(new_section, {}).setdefault(table, {}).setdefault(entry, value)
    return data


def _field(section: str, name: str, where: str):
    sections = Config.model_fields
    if section not in sections:
        raise DifftuneError(f"{where}: unknown section {section!r}; allowed: {', '.join(sections)}")
    fields = sections[section].annotation.model_fields
    if name not in fields:
        raise DifftuneError(f"{where}: unknown key {section}.{name}; allowed in [{section}]: {', '.join(fields)}")
    return fields[name]


def _is_text(annotation: Any) -> bool:
    if annotation is str:
        return True
    args = getattr(annotation, "__args__", ())
    return getattr(annotation, "__origin__", None) is Literal and all(isinstance(a, str) for a in args)


def describe_errors(source: str, err: ValidationError, section: str | None = None) -> str:
    """One line per problem, each naming its `section.key`; `section` when `err` came from one section's model."""
    lines = [f"{source}: invalid config"]
    for error in err.errors():
        loc = ([section] if section else []) + [str(part) for part in error["loc"]]
        key = ".".join(loc)
        if error["type"] == "extra_forbidden":
            if len(loc) == 1:
                allowed = f"allowed sections: {', '.join(Config.model_fields)}"
            else:
                table = ".".join(part for part in loc[:-1] if not part.isdigit())
                allowed = f"allowed in [{table}]: {', '.join(_model_at(loc[:-1]).model_fields)}"
            lines.append(f"  {key}: unknown key; {allowed}")
        elif not key:  # a check across sections: its message names the keys; its input would be the whole config
            lines.append(f"  {error['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {key}: {error['msg'].removeprefix('Value error, ')} (got {error.get('input')!r})")
    return "\n".join(lines)


def _model_at(loc: list[str]) -> type[BaseModel]:
    """The model of the table at a config location (`data.datasets.0`: `DatasetConfig`)."""
    model = Config
    for part in loc:
        if not part.isdigit():
            annotation = model.model_fields[part].annotation
            model = get_args(annotation)[0] if get_origin(annotation) is list else annotation
    return model


def reference_markdown(family_options: dict[str, type[BaseModel]] | None = None) -> str:
    """The config reference tables (docs/reference/config.md), generated from the schema (a test keeps it in sync); with
    `family_options` (family name -> its options model), a table of `model.family_options` per family."""
    lines = []
    for section, section_field in Config.model_fields.items():
        lines += [f"### [{section}]", "", *_field_table(section_field.annotation)]
        if section == "data":
            lines += [
                "### [[data.datasets]]",
                "",
                *_field_table(_DatasetEntry),
                f"Besides these, any `[data]` key but {', '.join(f'`{name}`' for name in RUN_WIDE_DATA_FIELDS)} "
                "(the run's): unset, it is `[data]`'s.",
                "",
            ]
    for family, options in (family_options or {}).items():
        if options.model_fields:
            lines += [f"### `model.family_options` of `{family}` bases", "", *_field_table(options)]
    return "\n".join(lines)


def _field_table(model: type[BaseModel]) -> list[str]:
    lines = ["| key | default | description |", "| --- | --- | --- |"]
    for name, field in model.model_fields.items():
        default = field.default
        if field.is_required():
            shown = "(required)"
        elif default is None:
            shown = "(see description)"
        else:
            shown = "{}" if default == {} else tomli_w.dumps({"v": default})[4:].strip()
        choices = ""
        if getattr(field.annotation, "__origin__", None) is Literal:
            choices = " One of: " + ", ".join(f"`{a}`" for a in field.annotation.__args__) + "."
        lines.append(f"| `{name}` | `{shown}` | {field.description}{choices} |")
    return [*lines, ""]


# Run in this order by `Config`'s validation; each raises a ValueError naming the settings that clash.
CROSS_SECTION_RULES = (
    sample_size_defaults_to_the_data,
    zero_terminal_snr_needs_v_prediction,
    caches_resolved_and_possible,
    adapter_fits_the_other_sections,
    watched_metrics_need_held_out_data,
    global_batch_derives_the_accumulation,
    optimizer_fits_the_run,
    rollback_needs_checkpoints,
    averaging_needs_snapshots,
    one_offload_setting,
    gguf_base_trains_a_lora,
    frozen_weights_kept_apart_once,
    preference_fits_the_run,
    slider_fits_the_run,
    reward_fits_the_run,
)
