"""Regenerate the README's generated parts: the families table from the family registry and the bundled bases'
scores, and the config reference from the schema: `python scripts/update_readme.py`."""

from pathlib import Path

from difftune.config import reference_markdown
from difftune.families import FAMILY_OPTIONS, family_table_markdown

REPO = Path(__file__).resolve().parents[1]
SECTIONS = {"config-reference": lambda: reference_markdown(FAMILY_OPTIONS),
            "families": lambda: family_table_markdown(REPO / "models")}


def replaced(text: str, section: str, content: str) -> str:
    start, end = f"<!-- {section}:start -->", f"<!-- {section}:end -->"
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{content.strip()}\n{end}{tail}"


def main() -> None:
    readme = REPO / "README.md"
    text = readme.read_text(encoding="utf-8")
    for section, content in SECTIONS.items():
        text = replaced(text, section, content())
    readme.write_text(text, encoding="utf-8")
    print(f"updated {readme}")


if __name__ == "__main__":
    main()
