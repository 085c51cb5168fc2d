"""What people type, as typed values: the config schema as form fields (the UI's form), adapter specs.

Each config field becomes one `FormField` of a kind (checkbox, choice, number, text, list, pair); the form's
values go back through `Config` itself, so the form shows the schema's own validation messages.
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import tomli_w
import tomllib
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from difftune.config import Config, describe_errors, load_config
from difftune.errors import DifftuneError


def parse_adapter_spec(text: str) -> tuple[Path, float]:
    """`FILE` or `FILE:SCALE`."""
    path, sep, scale = text.strip().rpartition(":")
    if sep:
        try:
            return Path(path), float(scale)
        except ValueError:
            pass
    return Path(text.strip()), 1.0


def parse_adapter_lines(text: str) -> list[tuple[Path, float]]:
    """One `FILE[:SCALE]` per line; blank lines are skipped."""
    return [parse_adapter_spec(line) for line in text.splitlines() if line.strip()]


@dataclass(frozen=True)
class FormField:
    section: str
    name: str
    info: FieldInfo

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def value_type(self) -> Any:
        """The annotation without `| None`."""
        annotation = self.info.annotation
        if get_origin(annotation) in (Union, types.UnionType):
            return next(arg for arg in get_args(annotation) if arg is not type(None))
        return annotation

    @property
    def optional(self) -> bool:
        return self.value_type is not self.info.annotation

    @property
    def kind(self) -> str:
        """One of: bool, choice, int, float, text, list (one item per line), pair (comma-separated), table (TOML
        `key = value` lines), and `optional` for a number that may be left empty (a browser number box cannot be
        empty)."""
        value_type = self.value_type
        origin = get_origin(value_type)
        if self.optional and value_type in (int, float):
            return "optional"
        if origin is Literal:
            return "choice"
        if origin is list:
            return "list"
        if origin is dict:
            return "table"
        if origin is tuple:
            return "pair"
        return {bool: "bool", int: "int", float: "float", str: "text"}[value_type]

    @property
    def choices(self) -> list[str]:
        return list(get_args(self.value_type)) if self.kind == "choice" else []

    def to_widget(self, value: Any) -> Any:
        if self.kind == "optional":
            return "" if value is None else str(value)
        if self.kind == "list":  # a table entry (a prompt with controls) as one JSON object a line
            return "\n".join(
                json.dumps(item.model_dump(exclude_none=True)) if isinstance(item, BaseModel) else str(item)
                for item in value
            )
        if self.kind == "pair":
            return ", ".join(str(item) for item in value)
        if self.kind == "table":
            return tomli_w.dumps(value or {})
        return value

    def from_widget(self, value: Any) -> Any:
        """The widget's value as the schema's type where it reads as one; otherwise left for validation to name."""
        if self.kind in ("list", "pair"):
            items = (value or "").splitlines() if self.kind == "list" else (value or "").split(",")
            item_types = get_args(self.value_type)
            return [_as_type(item.strip(), item_types[0]) for item in items if item.strip()]
        if self.kind == "optional":
            return None if not (value or "").strip() else _as_type(value.strip(), self.value_type)
        if self.kind == "table":
            try:
                return tomllib.loads(value or "")
            except tomllib.TOMLDecodeError:
                return value  # validation names the field
        if self.kind == "int" and isinstance(value, float) and value.is_integer():
            return int(value)  # a browser number box gives 100.0 for 100
        return value


def _as_type(text: str, item_type: type) -> Any:
    if text.startswith("{"):  # a table entry, as `to_widget` writes it
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text  # validation names the field
    try:
        return item_type(text) if item_type in (int, float) else text
    except ValueError:
        return text


def form_fields(sections: list[str] | None = None) -> list[FormField]:
    """Every field of the named sections (all by default), in schema order."""
    fields = []
    for section, section_field in Config.model_fields.items():
        if sections is None or section in sections:
            fields += [FormField(section, name, info) for name, info in section_field.annotation.model_fields.items()]
    return fields


def widget_values(config: Config, fields: list[FormField]) -> list[Any]:
    return [field.to_widget(getattr(getattr(config, field.section), field.name)) for field in fields]


def file_widget_values(path: Path, fields: list[FormField]) -> list[Any]:
    """A config file's values for the form: what the file sets, and empty where it leaves a field to follow another
    (`adapter.alpha` the rank, `sample.resolution` the training size...). Filled with the resolved value instead,
    such a field would stay put when the one it follows is edited, and the form would send another job than the CLI
    does with the same edits."""
    config = load_config(path)
    raw = tomllib.loads(Path(path).read_text(encoding="utf-8-sig"))
    return [
        field.to_widget(None)
        if field.optional and field.name not in raw.get(field.section, {})
        else field.to_widget(getattr(getattr(config, field.section), field.name))
        for field in fields
    ]


def form_toml(fields: list[FormField], values: list[Any]) -> str:
    """The form as a config file: validated and resolved, less the fields left empty to follow others."""
    data = config_from_widgets(fields, values).model_dump(mode="json", exclude_none=True)
    for field, value in zip(fields, values, strict=True):
        if field.optional and field.from_widget(value) is None:
            data[field.section].pop(field.name, None)
    return tomli_w.dumps(data)


def config_from_widgets(fields: list[FormField], values: list[Any], source: str = "form", section: str | None = None):
    """Validate the form's values as one `Config` (or, given `section`, as that section alone); errors name
    `section.key` in the schema's own words."""
    data: dict[str, dict] = {}
    for field, value in zip(fields, values, strict=True):
        data.setdefault(field.section, {})[field.name] = field.from_widget(value)
    model = Config.model_fields[section].annotation if section else Config
    try:
        return model.model_validate(data[section] if section else data)
    except ValidationError as err:
        raise DifftuneError(describe_errors(source, err, section)) from None


DEFAULT_PRESET = "tiny_lora"  # the README's default job: runs here, on the bundled tiny base
SUMMARY_LENGTH = 110


@dataclass(frozen=True)
class Preset:
    """A config file offered in the form: its name, the first sentence of its leading comment, and whether its base
    is on this machine (else the job downloads it, and is sized for a GPU)."""

    name: str
    path: Path
    summary: str
    base_is_here: bool

    @property
    def label(self) -> str:
        return f"{self.name}{'' if self.base_is_here else ' [GPU, downloads its base]'}: {self.summary}"


def presets(configs_dir: Path) -> list[Preset]:
    """The folder's config files: the default job first, then those whose base is here, then the rest, by name."""
    found = []
    for path in sorted(Path(configs_dir).glob("*.toml")):
        text = path.read_text(encoding="utf-8-sig")
        try:
            base = tomllib.loads(text).get("model", {}).get("base", Config().model.base)
        except tomllib.TOMLDecodeError:
            continue  # not offered: the form would refuse it (loading it by hand says why)
        found.append(
            Preset(path.stem, path, _first_sentence(text), (path.parent / base).exists() or Path(base).exists())
        )
    return sorted(found, key=lambda preset: (preset.name != DEFAULT_PRESET, not preset.base_is_here, preset.name))


def _first_sentence(text: str) -> str:
    """The leading comment's first sentence, shortened at a word to `SUMMARY_LENGTH` characters."""
    comment = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        comment.append(line.lstrip("#").strip())
    words = " ".join(comment)
    sentence = words.split(". ")[0].removesuffix(".")
    if len(sentence) <= SUMMARY_LENGTH:
        return sentence
    return sentence[:SUMMARY_LENGTH].rsplit(" ", 1)[0] + "…"
