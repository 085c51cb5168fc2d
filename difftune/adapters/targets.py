"""Which modules an adapter targets: matched as peft matches them, and the message that names a part's layers where a
target matches none."""

from __future__ import annotations

from difftune.errors import DifftuneError


def missing_targets(targets: list[str], names) -> list[str]:
    """The targets no module name matches as peft matches them: the whole name, or its `.`-suffix."""
    names = list(names)
    return [target for target in targets if not any(name == target or name.endswith("." + target) for name in names)]


def unmatched_targets(key: str, part: str, missing: list[str], suffixes: list[str]) -> DifftuneError:
    return DifftuneError(
        f"{key}: {', '.join(map(repr, missing))} names no module of the {part}; "
        f"its layers are named {', '.join(suffixes)}"
    )


def layer_suffixes(layer_names) -> list[str]:
    """The short names by which peft targets layers: each one's name after its last block index (`attn1.to_q`,
    `conv1`), or its last two parts when it ends in one (`to_out.0`)."""
    suffixes = set()
    for name in layer_names:
        parts = name.split(".")
        last_index = max((i for i, part in enumerate(parts) if part.isdigit()), default=-1)
        suffixes.add(".".join(parts[last_index + 1 :] if last_index < len(parts) - 1 else parts[-2:]))
    return sorted(suffixes)
