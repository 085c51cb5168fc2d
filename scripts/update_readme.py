"""Regenerate the README's config reference from the schema: `python scripts/update_readme.py`."""

from pathlib import Path

from difftune.config import reference_markdown
from difftune.families import FAMILY_OPTIONS

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def main() -> None:
    readme = Path(__file__).resolve().parents[1] / "README.md"
    text = readme.read_text(encoding="utf-8")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    readme.write_text(f"{head}{START}\n{reference_markdown(FAMILY_OPTIONS).strip()}\n{END}{tail}", encoding="utf-8")
    print(f"updated {readme}")


if __name__ == "__main__":
    main()
