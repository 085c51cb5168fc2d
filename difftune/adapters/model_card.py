"""The model card a run writes beside its result (`README.md` in the output folder), as the Hugging Face Hub reads
one: its metadata built by `huggingface_hub`'s `ModelCardData` (`base_model` where the base is a hub id, `library_name`,
`tags` with the family and the adapter kind, `instance_prompt`, the base card's `license`, the samples as `widget`
images), then what was trained, how to load it, which file goes to which tool, and the settings that matter. The Hub
shows it as the model's page; `difftune push` uploads it with the files.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData, try_to_load_from_cache

from difftune.adapters.export import ADAPTER_FILE, FILE_USES
from difftune.config import HUB_ID, Config, PromptWithControls
from difftune.families.common.family import Family

CARD_FILE = "README.md"
KIND_TAGS = {"none": "full-fine-tune", "embedding": "textual-inversion"}  # adapter.kind -> its tag, where not itself
KIND_NAMES = {
    "lora": "A LoRA",
    "dora": "A DoRA",
    "loha": "A LoHa",
    "lokr": "A LoKr",
    "none": "A full fine-tune",
    "embedding": "A textual-inversion embedding",
    "controlnet": "A ControlNet",
}
CLIP_SUFFIXES = (".mp4", ".webm", ".gif")


def hub_id(base: str) -> str | None:
    """`base` where it names a Hugging Face hub repository (not a local folder or file)."""
    return base if HUB_ID.fullmatch(base) and not Path(base).exists() else None


def base_license(base: str) -> str | None:
    """The base's license as its own card states it: a local folder's `README.md`, or a hub base's card where the hub
    cache holds it (never fetched: a run may be offline)."""
    card = Path(base) / CARD_FILE
    if not card.is_file() and hub_id(base):
        cached = try_to_load_from_cache(base, CARD_FILE)
        card = Path(cached) if isinstance(cached, str) else card
    return ModelCard.load(card).data.license if card.is_file() else None


def trigger_words(config: Config) -> str:
    """The text every caption was given first (`data.caption_prefix`), which prompts should carry."""
    return config.data.caption_prefix.strip(" ,")


def sample_files(output_dir: Path, config: Config) -> list[tuple[str, str]]:
    """(prompt, path relative to the output folder) of each end-of-run sample on disk, in the prompts' order."""
    found = []
    for number, entry in enumerate(config.sample.prompts):
        prompt = entry.prompt if isinstance(entry, PromptWithControls) else entry
        for path in sorted((output_dir / "samples").glob(f"{number:03d}.*")):
            found.append((prompt, path.relative_to(output_dir).as_posix()))
    return found


def card_data(config: Config, family: Family, samples: list[tuple[str, str]]) -> ModelCardData:
    kind = config.adapter.kind
    media = "audio" if family.reads_sound else "video" if family.reads_clips else "image"
    tags = ["difftune", family.name, KIND_TAGS.get(kind, kind), f"text-to-{media}", "diffusers"]
    if config.adapter.is_adapter:
        tags.append("template:sd-lora")  # the Hub's LoRA page layout, as diffusers' scripts tag their cards
    return ModelCardData(
        base_model=hub_id(config.model.base),
        library_name="diffusers",
        license=base_license(config.model.base),
        pipeline_tag=f"text-to-{media}",
        tags=tags,
        instance_prompt=trigger_words(config) or None,
        widget=[
            {"text": prompt, "output": {"url": path}} for prompt, path in samples if not path.endswith(CLIP_SUFFIXES)
        ],
    )


def card_text(config: Config, family: Family, files: dict, output_dir: Path, samples: list[tuple[str, str]]) -> str:
    """The card's markdown below its metadata."""
    base, kind = config.model.base, config.adapter.kind
    named_base = f"[`{base}`](https://huggingface.co/{base})" if hub_id(base) else f"`{base}`"
    lines = [
        f"# {output_dir.name}",
        "",
        f"{KIND_NAMES[kind]} of {family.description} ({named_base}), trained with difftune.",
        "",
    ]
    if trigger := trigger_words(config):
        lines += ["## Trigger words", "", f"Every caption began with `{trigger}`: put it in your prompts.", ""]
    if samples:
        lines += ["## Samples", ""]
        lines += [f"- {prompt}: [{path}]({path})" for prompt, path in samples]
        lines += [""]
    lines += ["## Files", "", "| file | for |", "| --- | --- |"]
    for layout, written in files.items():
        for path in [] if isinstance(written, str) else written:
            lines.append(f"| `{Path(path).relative_to(output_dir).as_posix()}` | {FILE_USES[layout]} |")
    if kind in ("lora", "dora") and "diffusers" in files:
        lines += [
            "",
            "## Use with diffusers",
            "",
            "```python",
            "import torch",
            f"from diffusers import {family.pipeline_class.__name__}",
            "",
            f'pipeline = {family.pipeline_class.__name__}.from_pretrained("{base}", torch_dtype=torch.bfloat16)',
            f'pipeline.load_lora_weights("<this repository or folder>", weight_name="{ADAPTER_FILE}")',
            "```",
        ]
    lines += ["", "## Training settings", "", "| setting | value |", "| --- | --- |"]
    lines += [f"| {name} | {value} |" for name, value in settings(config, family)]
    lines += ["", "The run's whole config is `config.toml` beside this card (`difftune train --config config.toml`)."]
    return "\n".join(lines) + "\n"


def settings(config: Config, family: Family) -> list[tuple[str, str]]:
    """The settings that matter to someone reproducing or judging the run."""
    adapter, train, optim = config.adapter, config.train, config.optim
    rows = [("base", f"`{config.model.base}` ({family.description})"), ("adapter", adapter.kind)]
    if adapter.is_adapter:
        rows.append(("rank / alpha", f"{adapter.rank} / {adapter.alpha or adapter.rank:g}"))
    rows += [
        ("steps", str(train.max_steps)),
        ("batch size", f"{train.batch_size} x {train.gradient_accumulation_steps} accumulated, per process"),
        ("learning rate", f"{optim.learning_rate:g} ({optim.lr_schedule}, {optim.warmup_steps} warmup steps)"),
        ("optimizer", optim.optimizer),
        ("resolution", f"{config.data.resolution} px" + (" (aspect buckets)" if config.data.buckets else "")),
        ("mixed precision", train.mixed_precision),
        ("seed", str(train.seed)),
    ]
    return rows


def write_model_card(config: Config, family: Family, files: dict, output_dir: Path) -> Path:
    """`README.md` in the output folder: the card of what the run wrote (`files`, as `save_result_files` names them)."""
    samples = sample_files(output_dir, config)
    data = card_data(config, family, samples)
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{card_text(config, family, files, output_dir, samples)}")
    path = output_dir / CARD_FILE
    card.save(path)
    return path
