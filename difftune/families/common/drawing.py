"""Sampling: one function that training (previews, end-of-run samples) and later tools share. A prompt with control
images (an edit base's) draws its edit of them, and its grid cell shows the controls before the result. A video base
with `sample.frames` > 1 draws clips, written as MP4 (H.264, through PyAV) or, where PyAV is not installed, as
animated WebP (Pillow's), each with its prompt and settings in its metadata as a PNG has them in its text chunks. A
sound base draws sounds, written as FLAC with their tags, its grid cells their spectrograms."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
)
from PIL import Image, ImageDraw, ImageFont
from PIL.PngImagePlugin import PngInfo

from difftune.config import DataConfig, PromptWithControls, SampleConfig
from difftune.data.clips import Sound, SoundingClip, read_frames, write_clip
from difftune.data.dataset import BadImage, open_image
from difftune.data.sound_files import read_sound_file, spectrogram_picture, write_sound
from difftune.data.sources import is_clip, is_sound
from difftune.errors import DifftuneError
from difftune.families.common.loading import FamilyOptions
from difftune.families.common.role import Role
from difftune.models.autoencoders import load_vae
from difftune.models.components import Components, eval_mode, prompts_read_by_turns
from difftune.progress import bar

SAMPLERS = {
    "ddim": DDIMScheduler,
    "euler": EulerDiscreteScheduler,
    "euler_a": EulerAncestralDiscreteScheduler,
    "dpmpp_2m": DPMSolverMultistepScheduler,
}


class Drawing(Role):
    """A family's drawing, a role it holds (`family.drawing`): its samplers, its pipeline assembled over the (adapted)
    parts, and images or clips drawn through it (what `generate_images` below calls)."""

    default_sampler = "ddim"  # what `sample.scheduler = "auto"` means
    samplers = SAMPLERS  # sampler name -> scheduler class, built over the model's own schedule config
    needs_controls_to_draw = False  # its pipeline draws only edits (a sample prompt without controls is refused)
    control_names: tuple[str, ...] = ()  # what a sample grid calls its controls (none: "control", numbered if several)
    # The pipeline that paints into a sample prompt's first control where its `mask` is white, over the same parts,
    # where the family has one that needs no inpainting base (Z-Image's, FLUX.2 [klein]'s: they blend the base's own
    # drawing into the image, so a run's adapter draws there as it is).
    inpaint_pipeline_class: type | None = None

    def sampler(self, name: str) -> type:
        """The scheduler class of sampler `name` (`auto`: the family's default)."""
        name = self.default_sampler if name == "auto" else name
        if name not in self.samplers:
            raise DifftuneError(
                f'sample.scheduler = "{name}": not a sampler for {self.family.description}; use auto or '
                f"{', '.join(self.samplers)}"
            )
        return self.samplers[name]

    def denoiser_pipeline_parts(self, components: Components) -> dict[str, torch.nn.Module]:
        """The denoiser as the pipeline holds it, by part name: one part, or the parts a denoiser made of several
        holds (Wan 2.2's two experts trained together)."""
        return {self.family.denoiser_part(components.family_options): components.denoiser}

    def assemble_pipeline(self, components: Components, scheduler=None):
        """A text-to-image pipeline over the (possibly adapted) components; the family's ControlNet pipeline where
        they hold a ControlNet."""
        with_controlnet = components.controlnet is not None
        pipeline_class = (
            self.family.controlnet.pipeline_class
            if with_controlnet
            else self.family.input_control.pipeline_class
            if self.reads_input_control(components)
            else self.family.pipeline_class
        )
        return pipeline_class(
            **self.denoiser_pipeline_parts(components),
            **({"controlnet": components.controlnet} if with_controlnet else {}),
            vae=components.vae,
            **components.text_encoders,
            **components.tokenizers,
            **components.drawing_parts,
            **components.pixel_encoders,
            scheduler=scheduler or components.noise_scheduler,
            **self.family.fixed_pipeline_arguments,
            **components.pipeline_options,
        )

    def reads_input_control(self, components: Components) -> bool:
        """Whether the denoiser reads control images as input channels (a control LoRA's widened one)."""
        return self.family.input_control is not None and self.family.input_control.reads_control(components.denoiser)

    def draws_from_control(self, components: Components) -> bool:
        """Whether the components draw from a control image: a ControlNet beside them, or a control LoRA's widened
        denoiser."""
        return components.controlnet is not None or self.reads_input_control(components)

    def sample_prompt_problems(self, prompts: list, controlled: bool = False) -> list[str]:
        """The `sample.prompts` entries this family cannot draw, each named: with other control images than it reads
        (`prompt_control_problems`), or than one where a ControlNet or a control LoRA draws them (`controlled`)."""
        if controlled:
            return one_image_each(prompts, "a ControlNet or control LoRA draws from one control image", "control.png")
        return self.prompt_control_problems(prompts)

    def prompt_control_problems(self, prompts: list) -> list[str]:
        """The `sample.prompts` entries with more control images than this family reads (or none, where its pipeline
        draws only edits), each named."""
        problems = []
        most = self.family.max_controls
        for entry in prompts:
            controls = [] if isinstance(entry, str) else entry.controls
            text = entry if isinstance(entry, str) else entry.prompt
            if not isinstance(entry, str) and entry.mask:
                problems += self.mask_problems(text, len(controls) - 1)
            elif len(controls) > most:
                problems.append(
                    f"sample.prompts: {text!r} has {len(controls)} control images; these bases read "
                    f"{'none (they edit no image)' if not most else f'at most {most}'}"
                )
            elif self.needs_controls_to_draw and not controls:
                problems.append(
                    f"sample.prompts: {text!r} has no control image; {self.family.description} pipelines draw only "
                    f'edits: write it as {{prompt = {text!r}, controls = ["image.png"]}}'
                )
        return problems

    def mask_problems(self, text: str, references: int) -> list[str]:
        """What is wrong with a sample prompt that paints into its first control where its mask is white, beside
        `references` more controls."""
        if self.inpaint_pipeline_class is None:
            return [
                f"sample.prompts: {text!r} has a mask; {self.family.description} bases paint into no image (Z-Image's, "
                "FLUX.2 [klein]'s and the inpainting families' do)"
            ]
        most = self.family.max_controls
        if references > most:
            return [
                f"sample.prompts: {text!r} has {references} references beside the image it paints into; "
                f"{self.family.description} inpainting reads {f'at most {most}' if most else 'none'}"
            ]
        return []

    def draw(
        self,
        pipeline,
        options: FamilyOptions,
        prompt: str | list[str],
        controls: list,
        height: int | None,
        width: int | None,
        **arguments,
    ) -> list:
        """The images the family's `pipeline` draws for `prompt` at `height` x `width` (None: the pipeline's default
        size) from an edit prompt's control images (PIL; none for a text-to-image prompt, at most `max_controls`:
        callers check `prompt_control_problems` first), under the base's `options`; `arguments`: the rest of the call
        (steps, guidance, generators)."""
        if getattr(pipeline, "controlnet", None) is not None:  # its control image last, after the pipeline's own
            images = {
                **self.image_arguments(controls[:-1], height, width),
                self.family.controlnet.image_argument: controls[-1],
            }
        elif isinstance(pipeline, getattr(self.family.input_control, "pipeline_class", ())):
            images = {self.family.input_control.image_argument: controls[0]}
        else:
            images = self.image_arguments(controls, height, width)
        return pipeline(
            prompt=prompt,
            height=height,
            width=width,  # by name: an edit pipeline's first argument is the image
            **images,
            **arguments,
        ).images

    def inpaint(self, pipeline, options, prompt, controls: list, mask: Image.Image, height, width, **arguments) -> list:
        """`draw`'s images for a sample prompt with a mask: the family's inpaint pipeline over the same parts
        (`from_pipe`) paints into `controls[0]` where `mask` is white; the other controls are its references (FLUX.2
        [klein]'s `image_reference`; `mask_problems` leaves none to a family without)."""
        painter = self.inpaint_pipeline_class.from_pipe(pipeline)
        painter.set_progress_bar_config(disable=True)
        references = {"image_reference": controls[1:]} if controls[1:] else {}
        return painter(
            prompt=prompt, image=controls[0], mask_image=mask, height=height, width=width, **references, **arguments
        ).images

    def draw_clips(
        self,
        pipeline,
        prompt: str | list[str],
        controls: list,
        height: int | None,
        width: int | None,
        frames: int,
        **arguments,
    ) -> list[list]:
        """A video family's clips (each a list of PIL frames) of `frames` frames for `prompt` (from `controls`: an
        image-to-video base's first frame), as `draw` draws images; refused by an image family (callers check
        `reads_clips` first)."""
        raise DifftuneError(f"{self.family.description} bases draw images, not clips")

    def draw_sounds(self, pipeline, options: FamilyOptions, prompt: str | list[str], **arguments) -> list[Sound]:
        """A sound family's sounds for `prompt`, as `draw` draws images (under the base's `options`: how long they
        are); refused by a picture family (callers check `reads_sound` first)."""
        raise DifftuneError(f"{self.family.description} bases draw pictures, not sounds")

    def image_arguments(self, controls: list, height: int | None, width: int | None) -> dict:
        """`draw`'s arguments for the controls and size: none for a text-to-image family."""
        return {}

    def sampling_arguments(self, components: Components, guidance_scale: float, negative_prompt: str) -> dict:
        """The pipeline call's guidance arguments (and anything else the family's pipelines need)."""
        return {"guidance_scale": guidance_scale, "negative_prompt": negative_prompt or None}


class ClipDrawing(Drawing):
    """A video family's drawing (Wan's, Kandinsky 5 video's): clips through its pipeline's
    `num_frames`, and images as one-frame clips."""

    def draw(self, pipeline, options, prompt, controls, height, width, **arguments) -> list:
        """Each prompt's one-frame clip, as an image."""
        return [clip[0] for clip in self.draw_clips(pipeline, prompt, controls, height, width, 1, **arguments)]

    frames_argument = "num_frames"  # the pipeline call's name for the clip's frame count (Sana-Video's: `frames`)

    def draw_clips(self, pipeline, prompt, controls, height, width, frames, **arguments) -> list[list]:
        return pipeline(
            prompt=prompt, height=height, width=width, output_type="pil", **{self.frames_argument: frames}, **arguments
        ).frames


class ImageToVideoDrawing(ClipDrawing):
    """An image-to-video family's drawing (Wan's, HunyuanVideo 1.5's): each sample
    prompt names the one image its clip animates (`{prompt = "...", controls = ["first_frame.png"]}`), given to the
    pipeline as its `image`."""

    needs_controls_to_draw = True

    def draw_clips(self, pipeline, prompt, controls, height, width, frames, **arguments) -> list[list]:
        return super().draw_clips(pipeline, prompt, controls, height, width, frames, image=controls[0], **arguments)

    def prompt_control_problems(self, prompts: list) -> list[str]:
        """Every sample prompt names the one image it animates."""
        return one_image_each(prompts, f"{self.family.description} pipelines animate one", "first_frame.png")


class ReferenceSizedDrawing(Drawing):
    """An edit family's drawing whose pipeline keeps references at their own size (FLUX.3's, FLUX.2's, Z-Image Omni's):
    samples drawn at a set size give it references at the size training read them at (`ReferenceSizedConditioning`'s
    `control_size`: the target's area, their aspect kept)."""

    def image_arguments(self, controls: list, height: int | None, width: int | None) -> dict:
        if height:
            size = self.family.conditioning.control_size
            controls = [control.resize(size((width, height), control.size)) for control in controls]
        return {"image": controls} if controls else {}


def one_call_each(prompt: str | list[str], arguments: dict) -> list[tuple[str, dict]]:
    """For a pipeline that draws one prompt a call (a modular pipeline, VACE's, MiniMax-H3's): each prompt with the
    call's `arguments` and its own generator (a list holds one a prompt; one generator, or none, serves every call)."""
    prompts = [prompt] if isinstance(prompt, str) else prompt
    generators = arguments.get("generator")
    generators = generators if isinstance(generators, list) else [generators] * len(prompts)
    return [(text, arguments | {"generator": generator}) for text, generator in zip(prompts, generators, strict=True)]


def one_image_each(prompts: list, pipelines_do: str, example: str) -> list[str]:
    """The `sample.prompts` entries that name other than one image (for a family whose pipeline draws from exactly one:
    `pipelines_do` says what they do with it, `example` names such a file), each named."""
    return images_each(prompts, pipelines_do, (example,))


def images_each(prompts: list, pipelines_do: str, examples: tuple[str, ...]) -> list[str]:
    """The `sample.prompts` entries that name other than as many images as `examples` names, in their order (for a
    family whose pipeline draws from exactly those: `pipelines_do` says what they do with them), each named."""
    problems = []
    for entry in prompts:
        controls = [] if isinstance(entry, str) else entry.controls
        text = entry if isinstance(entry, str) else entry.prompt
        if len(controls) != len(examples):
            named = ", ".join(f'"{example}"' for example in examples)
            problems.append(
                f"sample.prompts: {text!r} has {len(controls)} images; {pipelines_do}: write it as "
                f"{{prompt = {text!r}, controls = [{named}]}}"
            )
    return problems


def sampling_scheduler(name: str, components: Components):
    """The named sampler (`auto`: the family's default) over the model's own noise schedule."""
    return components.family.drawing.sampler(name).from_config(components.noise_scheduler.config)


@dataclass
class Sample:
    image: Image.Image
    entry: str | PromptWithControls  # the `sample.prompts` entry it was drawn for
    seed: int
    controls: list[Image.Image] = field(
        default_factory=list
    )  # an edit's control images, at the image's size (for the grid)
    clip: list[Image.Image] = field(default_factory=list)  # a video base's frames (`image` is the first)
    drawn_as: str = "edited"  # what the grid calls it beside its controls: an edit, or a ControlNet's drawing
    control_names: tuple[str, ...] = ()  # what the grid calls its controls (its family drawing's `control_names`)
    sound: Sound | None = None  # a sound base's (`image` is its spectrogram)

    @property
    def prompt(self) -> str:
        return self.entry if isinstance(self.entry, str) else self.entry.prompt


@torch.no_grad()
def generate_images(
    components: Components, config: SampleConfig, device: torch.device, shown_as: str = ""
) -> list[Sample]:
    """`images_per_prompt` images per prompt; image k (counting across prompts) uses seed `config.seed + k`,
    so any image can be re-made alone. No `resolution`: the model's native size. `shown_as`: the bar's words over
    the images drawn (on a terminal), none if empty."""
    family = components.family
    problems = family.drawing.sample_prompt_problems(config.prompts, family.drawing.draws_from_control(components))
    if config.frames > 1 and not family.reads_clips:
        problems.append(f"sample.frames = {config.frames}: {family.description} bases draw images; set it to 1")
    if problems:
        raise DifftuneError("; ".join(problems))
    decoder = load_vae(config.decoder).to(device, components.vae.dtype) if config.decoder else components.vae
    pipeline = replace(components, vae=decoder).pipeline(sampling_scheduler(config.scheduler, components))
    pipeline.set_progress_bar_config(disable=True)
    guidance = components.family.drawing.sampling_arguments(components, config.guidance_scale, config.negative_prompt)
    # The text encoders (in host memory where the captions are cached) come to the device as they read the prompts.
    with eval_mode(*components.parts().values()), prompts_read_by_turns(components, device):
        return _sample_all(pipeline, config, guidance, components, shown_as)


def _sample_all(pipeline, config: SampleConfig, guidance: dict, components: Components, shown_as: str) -> list[Sample]:
    samples = []
    drawn = bar(None, shown_as, quiet=not shown_as, total=len(config.prompts) * config.images_per_prompt)
    for entry in config.prompts:
        prompt, controls = (
            (entry, []) if isinstance(entry, str) else (entry.prompt, [_open_control(c) for c in entry.controls])
        )
        mask = _open_control(entry.mask) if not isinstance(entry, str) and entry.mask else None
        for _ in range(config.images_per_prompt):
            seed = config.seed + len(samples)
            arguments = {
                "num_inference_steps": config.steps,
                "generator": torch.Generator("cpu").manual_seed(seed),
                **guidance,
            }
            # Torch's global generators seeded with the sample's seed, and put back after: SD3's ControlNet pipeline
            # draws its control image's latents from them, not from `generator`.
            devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                samples.append(_sample(pipeline, config, components, entry, prompt, controls, mask, seed, arguments))
            drawn.update()
    drawn.close()
    return samples


def _sample(
    pipeline, config: SampleConfig, components: Components, entry, prompt, controls, mask, seed, arguments
) -> Sample:
    """One image, a clip with `sample.frames` > 1, or a sound base's sound."""
    if components.family.reads_sound:
        [sound] = components.family.drawing.draw_sounds(pipeline, components.family_options, prompt, **arguments)
        return Sample(spectrogram_picture(sound), entry, seed, sound=sound)
    if config.frames > 1:
        [clip] = components.family.drawing.draw_clips(
            pipeline, prompt, controls, config.resolution, config.resolution, config.frames, **arguments
        )
        return Sample(clip[0], entry, seed, [c.resize(clip[0].size) for c in controls], clip)
    drawing = components.family.drawing
    size, options = config.resolution, components.family_options
    names = drawing.control_names
    if mask is None:
        [image] = drawing.draw(pipeline, options, prompt, controls, size, size, **arguments)
    else:  # shown as the inpainting families' are: the image, its mask, then the rest
        [image] = drawing.inpaint(pipeline, options, prompt, controls, mask, size, size, **arguments)
        controls = mask_second(controls, mask)
        if drawing.inpaint_pipeline_class is not None:  # FLUX.2 [klein]'s references (else a ControlNet's control)
            names = ("image", "mask", *["reference"] * (len(controls) - 2))
    drawn_as = "edited" if components.family.max_controls else "drawn"  # a ControlNet's or control LoRA's: drawn
    controls = [at_height(c, image.height) for c in controls]
    return Sample(image, entry, seed, controls, drawn_as=drawn_as, control_names=names)


def mask_second(controls: list, mask) -> list:
    """A sample prompt's controls with its mask after the image it paints into (first), as an inpainting base's
    pipeline and its sample grid take them."""
    return [controls[0], mask, *controls[1:]]


def _open_control(path: str) -> Image.Image:
    try:
        return open_image(Path(path), DataConfig())
    except BadImage as err:
        raise DifftuneError(f"sample.prompts: control image {path}: {err}") from None


def save_images(
    samples: list[Sample], config: SampleConfig, out_dir: Path, before_dir: Path | None = None
) -> list[Path]:
    """Each image as a PNG with its prompt and settings in the text chunk (a clip as `save_clip` writes it, a sound
    as FLAC with them as its tags), plus
    `grid.png`: a cell per image (a clip's first frame), after its controls (an edit's) and, where `before_dir` holds
    the base's sample of the same number, after that; a cell of several panels names each above it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, sample in enumerate(samples):
        tags = sample_tags(sample, config)
        if sample.sound is not None:
            paths.append(write_sound(out_dir / f"{i:03d}.flac", sample.sound, tags))
            continue
        if sample.clip:
            paths.append(save_clip(sample.clip, out_dir / f"{i:03d}", config.fps, tags))
            continue
        info = PngInfo()
        for name, text in tags.items():
            info.add_text(name, text)
        path = out_dir / f"{i:03d}.png"
        sample.image.save(path, pnginfo=info)
        paths.append(path)
    cells = []
    for number, sample in enumerate(samples):
        before = _before(before_dir, number)
        panels = [
            *_control_panels(sample.controls, sample.control_names),
            *([("before", before)] if before else []),
            ("after" if before else sample.drawn_as, sample.image),
        ]
        cells.append(labelled_row(panels) if len(panels) > 1 else sample.image)
    make_grid(cells).save(out_dir / "grid.png")
    return paths


def _control_panels(controls: list[Image.Image], names: tuple[str, ...] = ()) -> list[tuple[str, Image.Image]]:
    """Each control named: by `names` in order (an inpainting base's image and mask), the rest (all where no names)
    "control", numbered if several (a ControlNet's after an inpainting base's image and mask)."""
    named = list(zip(names, controls, strict=False))  # names for the first controls
    rest = controls[len(named) :]
    if len(rest) == 1:
        return [*named, ("control", rest[0])]
    return [*named, *((f"control {number}", control) for number, control in enumerate(rest, 1))]


def _before(before_dir: Path | None, number: int) -> Image.Image | None:
    """The base's sample `number` in `before_dir` (an image, a clip's first frame or a sound's spectrogram), if it is
    there."""
    found = sorted(before_dir.glob(f"{number:03d}.*")) if before_dir else []
    if not found:
        return None
    if is_sound(found[0]):
        return spectrogram_picture(read_sound_file(found[0]))
    if is_clip(found[0]):
        return read_frames(found[0], 0, 1)[0]
    with Image.open(found[0]) as image:  # an animated WebP opens at its first frame
        return image.convert("RGB")


def sample_tags(sample: Sample, config: SampleConfig) -> dict[str, str]:
    """What a sample file says of itself: its prompt, the settings it was drawn with and an edit's control files."""
    size = f"{sample.image.width}x{sample.image.height}" + (
        f"x{len(sample.clip)} fps={config.fps}" if sample.clip else ""
    )
    if sample.sound is not None:
        size = f"{sample.sound.samples.shape[1] / sample.sound.rate:g}s@{sample.sound.rate}Hz"
    tags = {
        "prompt": sample.prompt,
        "parameters": f"negative_prompt={config.negative_prompt!r} steps={config.steps} "
        f"guidance_scale={config.guidance_scale} "
        f"scheduler={config.scheduler} seed={sample.seed} size={size} decoder={config.decoder or 'model'}",
    }
    if sample.controls:
        tags["controls"] = "\n".join(sample.entry.controls)
        if sample.entry.mask:
            tags["mask"] = sample.entry.mask
    return tags


def video_encoder_installed() -> bool:
    return importlib.util.find_spec("av") is not None


def save_clip(frames: list[Image.Image], stem: Path, fps: int, tags: dict[str, str]) -> Path:
    """A clip as `stem`.mp4 with `tags` as its metadata, or without PyAV `stem`.webp (animated, lossless) with them as
    its EXIF image description (one `name: text` line each). A clip drawn with its sound (`SoundingClip`) carries it
    in the mp4, both at the frame rate they were drawn for, so they stay in step (`fps` is for silent clips)."""
    if video_encoder_installed():
        sound, fps = (frames.sound, frames.fps) if isinstance(frames, SoundingClip) else (None, fps)
        return write_clip(stem.with_suffix(".mp4"), frames, fps, tags=tags, sound=sound)
    path = stem.with_suffix(".webp")
    exif = Image.Exif()
    exif[0x010E] = "\n".join(f"{name}: {text}" for name, text in tags.items())  # ImageDescription
    frames[0].save(
        path, save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0, lossless=True, exif=exif
    )
    return path


def at_height(image: Image.Image, height: int) -> Image.Image:
    """`image` resized to `height`, its aspect ratio kept (a control beside what was drawn from it: a layered base's
    image beside its layers, side by side)."""
    return image.resize((max(1, round(image.width * height / image.height)), height))


def side_by_side(images: list[Image.Image], keep_alpha: bool = False) -> Image.Image:
    """Images of one height in a row, left to right: an edit's controls, then what was drawn (transparency over
    white); with `keep_alpha`, an RGBA row that keeps each image's transparency (a layered base's layers)."""
    size = (sum(image.width for image in images), images[0].height)
    row = Image.new("RGBA", size, (0, 0, 0, 0)) if keep_alpha else Image.new("RGB", size, "white")
    for i, image in enumerate(images):
        place = (sum(other.width for other in images[:i]), 0)
        if keep_alpha:
            row.paste(image.convert("RGBA"), place)  # copied as it is, its alpha too
        else:
            row.paste(image, place, _alpha(image))
    return row


def _alpha(image: Image.Image) -> Image.Image | None:
    """What pasting `image` keeps of it: its alpha where it has one (RGBA samples: Qwen-Image 2.1's, layers)."""
    return image.getchannel("A") if image.mode == "RGBA" else None


LABELLED_PANEL_WIDTH = 64  # narrower panels are scaled up (nearest) by a whole factor: "control 2" is 40 px wide


def labelled_row(panels: list[tuple[str, Image.Image]]) -> Image.Image:
    """Panels side by side under a white band that names each (`before`, `after`, `control`), so a grid of pairs
    reads without a legend."""
    font = ImageFont.load_default()
    band = font.getbbox("Ag")[3] + 4
    scale = max(1, math.ceil(LABELLED_PANEL_WIDTH / min(image.width for _, image in panels)))
    images = [image.resize((image.width * scale, image.height * scale), Image.NEAREST) for _, image in panels]
    row = side_by_side(images)
    labelled = Image.new("RGB", (row.width, row.height + band), "white")
    labelled.paste(row, (0, band))
    draw, left = ImageDraw.Draw(labelled), 0
    for (label, _), image in zip(panels, images, strict=True):
        draw.text((left + (image.width - draw.textlength(label, font=font)) / 2, 1), label, fill="black", font=font)
        left += image.width
    return labelled


def make_grid(images: list[Image.Image]) -> Image.Image:
    """The images in a square-ish grid, each in a cell of the largest one's size (transparency over white)."""
    columns = math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / columns)
    width, height = max(image.width for image in images), max(image.height for image in images)
    grid = Image.new("RGB", (columns * width, rows * height), "white")
    for i, image in enumerate(images):
        grid.paste(image, ((i % columns) * width, (i // columns) * height), _alpha(image))
    return grid
