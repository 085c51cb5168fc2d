"""Regenerate what the README and the docs site hold that is generated: the families table (README and the families
page) from the family registry and the bundled bases' scores, the config reference page from the schema, and the
benchmarks page from benchmarks/*.jsonl: `python scripts/update_docs.py`. With `--first-screen`, also run the
default job as the quick start says and put what it printed in the README's quick start, and its before/after grid in
docs/images/ (a minute on 2 CPU cores). A test keeps every generated part current."""

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from difftune.config import reference_markdown
from difftune.families import FAMILY_OPTIONS, family_table_markdown
from difftune.toy import benchmark_tables

sys.path.insert(0, str(Path(__file__).parent))  # the peer benchmarks' own table makers, beside this script
import bench_big_peer  # noqa: E402
import bench_peer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"


def _peer_table(script) -> str:
    """A peer benchmark's table, from its JSONL (none yet: said so)."""
    found = benchmark_tables.records(script.RESULTS)
    return script.markdown_table(found) if found else f"No sitting yet: `python scripts/{script.__name__}.py`."


# file -> its generated sections (between `<!-- name:start -->` and `<!-- name:end -->`) and what makes each
SECTIONS = {
    "README.md": {"families": lambda: family_table_markdown(REPO / "models")},
    "docs/families/index.md": {"families": lambda: family_table_markdown(REPO / "models", pages="")},
    "docs/reference/config.md": {"config-reference": lambda: reference_markdown(FAMILY_OPTIONS)},
    "docs/benchmarks.md": {
        "peer-bench": lambda: _peer_table(bench_peer),
        "peer-big": lambda: _peer_table(bench_big_peer),
        "gpu-speed": lambda: benchmark_tables.speed_table(BENCHMARKS),
        "host-memory": lambda: benchmark_tables.host_memory_table(BENCHMARKS),
        "plan": lambda: benchmark_tables.plan_table(BENCHMARKS),
        "quality": lambda: benchmark_tables.quality_table(BENCHMARKS, REPO / "configs"),
        "family-jobs": lambda: benchmark_tables.family_jobs_table(BENCHMARKS),
    },
}


def replaced(text: str, section: str, content: str) -> str:
    start, end = f"<!-- {section}:start -->", f"<!-- {section}:end -->"
    head, rest = text.split(start)
    _, tail = rest.split(end)
    return f"{head}{start}\n{content.strip()}\n{end}{tail}"


def first_screen() -> str:
    """The default job's output as a terminal shows it once it has ended (its step bar at its last state), with this
    checkout's paths as a user's; its end-of-run grid copied to docs/images/tiny_lora_grid.png."""
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
        shutil.copyfile(out / "samples" / "grid.png", REPO / "docs" / "images" / "tiny_lora_grid.png")
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
    files = {**SECTIONS}
    if args.first_screen:
        files["README.md"] = {**files["README.md"], "first-screen": first_screen}
    for name, sections in files.items():
        path = REPO / name
        text = path.read_text(encoding="utf-8")
        for section, content in sections.items():
            text = replaced(text, section, content())
        path.write_text(text, encoding="utf-8")
        print(f"updated {path}")


if __name__ == "__main__":
    main()
