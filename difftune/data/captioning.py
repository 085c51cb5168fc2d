"""`difftune caption`: a caption for each image of a data folder, written by a vision-language model from transformers
(Qwen2.5-VL and Qwen3-VL, Florence-2, or any image-text-to-text model transformers loads natively; remote code is
never run), as a `.txt` beside the image or as the folder's `metadata.jsonl`. A caption already there is kept unless
`overwrite`; each one is written as it is made (atomically), so an interrupted run keeps what it wrote and the next
run captions the rest.

A model with a chat template (the Qwen-VL models) is asked `instruction` about the image, in a user turn; one without
(Florence-2, BLIP) is given `instruction` as its text input (Florence-2's task token, `<MORE_DETAILED_CAPTION>`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image, ImageOps
from tqdm.auto import tqdm

from difftune.data.cache_folders import write_text
from difftune.data.dataset import IMAGE_EXTENSIONS, REPEATS_FOLDER
from difftune.errors import DifftuneError

CHAT_INSTRUCTION = "Describe this image in one sentence."
TASK_PROMPTS = {"florence2": "<MORE_DETAILED_CAPTION>"}  # models without a chat template: their captioning input
METADATA = "metadata.jsonl"


@dataclass
class Captioner:
    """A loaded model and its processor, and what it is asked."""

    model: torch.nn.Module
    processor: object
    instruction: str
    max_new_tokens: int = 77

    @property
    def chats(self) -> bool:
        return bool(getattr(self.processor, "chat_template", None))

    def prompt(self) -> str:
        if not self.chats:
            return self.instruction
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": self.instruction}]}]
        return self.processor.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)

    @torch.no_grad()
    def caption(self, images: list[Image.Image]) -> list[str]:
        """One caption per image: greedy decoding, on one line."""
        prompt = self.prompt()
        inputs = self.processor(text=[prompt] * len(images), images=images, return_tensors="pt", padding=True)
        device, dtype = self.model.device, self.model.dtype
        inputs = {
            name: value.to(device, dtype) if value.is_floating_point() else value.to(device)
            for name, value in inputs.items()
        }
        generated = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False)
        prompt_ids = inputs["input_ids"]
        if generated.shape[1] > prompt_ids.shape[1] and torch.equal(generated[:, : prompt_ids.shape[1]], prompt_ids):
            generated = generated[:, prompt_ids.shape[1] :]  # a decoder-only model repeats its prompt first
        texts = self.processor.batch_decode(generated, skip_special_tokens=True)
        return [" ".join(text.split()) for text in texts]


def load_captioner(
    model: str, instruction: str | None = None, device: str | None = None, max_new_tokens: int = 77
) -> Captioner:
    """The model at `model` (a local folder or a hub id) and its processor, on `device` (default: CUDA where there is
    one, in bf16; else the CPU in fp32). `instruction`: what it is asked (default: one sentence, or the model's
    captioning task)."""
    import transformers
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    from difftune.models.processors import load_without_video_processor

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        config = AutoConfig.from_pretrained(model)
        processor_name = PROCESSOR_MAPPING_NAMES.get(config.model_type)
        if processor_name:  # a Qwen-VL processor loads without torchvision this way (loading.py)
            load_without_video_processor(getattr(transformers, processor_name))
        processor = AutoProcessor.from_pretrained(model)
        loaded = AutoModelForImageTextToText.from_pretrained(
            model, dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32
        )
    except (OSError, ValueError) as err:
        raise DifftuneError(
            f"caption --model {model}: not a vision-language model transformers loads ({err}); give a local folder "
            "or hub id of Qwen2.5-VL, Qwen3-VL, Florence-2 or another image-text-to-text model"
        ) from None
    if getattr(processor, "tokenizer", None) is not None:
        processor.tokenizer.padding_side = "left"  # a batch's prompts end where generation starts
    captioner = Captioner(loaded.to(device).eval(), processor, "", max_new_tokens)
    default = CHAT_INSTRUCTION if captioner.chats else TASK_PROMPTS.get(config.model_type, "")
    captioner.instruction = instruction if instruction is not None else default
    return captioner


def images_to_caption(folder: Path) -> list[Path]:
    """The images a run reads from `folder`: those in it and in its `N_name` subfolders (not an edit pair's controls,
    which lie in a `control` folder)."""
    if not folder.is_dir():
        raise DifftuneError(f"caption: {folder} is not a folder; give the folder of images to caption")
    folders = [folder, *sorted(p for p in folder.iterdir() if p.is_dir() and REPEATS_FOLDER.match(p.name))]
    return [path for where in folders for path in sorted(where.iterdir()) if path.suffix.lower() in IMAGE_EXTENSIONS]


@dataclass
class CaptionReport:
    written: int = 0
    kept: int = 0  # already captioned, left as they were
    unreadable: list[str] = field(default_factory=list)  # images that could not be opened, with the reason


def caption_folder(
    folder: Path,
    captioner: Captioner,
    extension: str = ".txt",
    metadata: bool = False,
    overwrite: bool = False,
    batch_size: int = 4,
    quiet: bool = False,
) -> CaptionReport:
    """Caption every image of `folder` (`images_to_caption`) without a caption (all of them with `overwrite`): a
    same-stem `extension` file beside each, or with `metadata` a line each in its own folder's `metadata.jsonl` (as
    the data scan reads them: `file_name` and `text`), rewritten whole after each batch."""
    images = images_to_caption(folder)
    if not images:
        raise DifftuneError(f"caption: {folder} holds no images ({', '.join(sorted(IMAGE_EXTENSIONS))})")
    listed = {where: metadata_lines(where / METADATA) for where in {path.parent for path in images}} if metadata else {}
    report = CaptionReport()

    def captioned(path: Path) -> bool:
        if metadata:
            return bool(listed[path.parent].get(path.name, {}).get("text"))
        return path.with_suffix(extension).exists()

    todo = [path for path in images if overwrite or not captioned(path)]
    report.kept = len(images) - len(todo)
    batches = [todo[start : start + batch_size] for start in range(0, len(todo), batch_size)]
    for batch in tqdm(batches, desc="captioning", unit="batch", disable=quiet or not batches):
        opened = []
        for path in batch:
            try:
                with Image.open(path) as image:
                    opened.append((path, ImageOps.exif_transpose(image).convert("RGB")))
            except OSError as err:
                report.unreadable.append(f"{path}: {err}")
        if not opened:
            continue
        for (path, _), text in zip(opened, captioner.caption([image for _, image in opened]), strict=True):
            if metadata:
                listed[path.parent].setdefault(path.name, {"file_name": path.name})["text"] = text
            else:
                write_text(path.with_suffix(extension), text + "\n")
            report.written += 1
        for where in {path.parent for path, _ in opened} if metadata else ():
            write_text(where / METADATA, "".join(json.dumps(entry) + "\n" for entry in listed[where].values()))
    return report


def metadata_lines(path: Path) -> dict[str, dict]:
    """A `metadata.jsonl`'s lines by file name, in its order, each kept whole (an edit pair's `control_files` too); an
    unreadable line is refused by number (the file is rewritten whole, and a line lost there would lose a caption)."""
    if not path.is_file():
        return {}
    listed = {}
    lines = [line for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    for number, line in enumerate(lines, 1):
        try:
            entry = json.loads(line)
            listed[str(entry["file_name"])] = entry
        except (json.JSONDecodeError, KeyError, TypeError):
            raise DifftuneError(
                f"caption: {path} line {number} is not a JSON object with a file_name; mend it or move the file away"
            ) from None
    return listed
