"""Regenerate the README's generated parts: the families table from the family registry and the bundled bases'
scores, and the config reference from the schema: `python scripts/update_readme.py`. With `--first-screen`, also
run the default job as the quick start says and put what it printed in the quick start, and its before/after grid in
docs/ (a minute on 2 CPU cores)."""

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from difftune.config import reference_markdown
from difftune.families import FAMILY_OPTIONS, family_table_markdown

REPO = Path(__file__).resolve().parents[1]
SECTIONS = {
    "config-reference": lambda: reference_markdown(FAMILY_OPTIONS),
    "families": lambda: family_table_markdown(REPO / "models"),
}


def replaced(text: str, section: str, content: str) -> str:
    start, end = f"<!-- {section}:start -->", f"<!-- {section}:end -->"
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{content.strip()}\n{end}{tail}"


def first_screen() -> str:
    """The default job's output as a terminal shows it once it has ended (its step bar at its last state), with this
    checkout's paths as a user's; its end-of-run grid copied to docs/tiny_lora_grid.png."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "tiny_lora"
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "difftune.cli",
                "train",
                "--config",
                "configs/tiny_lora.toml",
                f"train.output_dir={out}",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        shutil.copyfile(out / "samples" / "grid.png", REPO / "docs" / "tiny_lora_grid.png")
        text = run.stdout.replace(str(out), "/home/you/difftune/output/tiny_lora").replace(
            str(REPO), "/home/you/difftune"
        )
    bar = re.findall(r"train: 100%[^\r\n]*", run.stderr)[-1]
    lines = text.splitlines()
    lines.insert(lines.index("difftune: training ...") + 1, bar)
    return "```text\n$ difftune train --config configs/tiny_lora.toml\n" + "\n".join(lines) + "\n```"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--first-screen", action="store_true", help="also run the default job for the quick start")
    args = parser.parse_args()
    readme = REPO / "README.md"
    text = readme.read_text(encoding="utf-8")
    sections = {**SECTIONS, **({"first-screen": first_screen} if args.first_screen else {})}
    for section, content in sections.items():
        text = replaced(text, section, content())
    readme.write_text(text, encoding="utf-8")
    print(f"updated {readme}")


if __name__ == "__main__":
    main()
