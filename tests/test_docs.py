"""The documentation site (mkdocs.yml, docs/) builds in strict mode, reaches every page from its navigation, and its
search index holds them; the README stays a few screens and the benchmarks page a page."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, script_module

README_LIMIT = 25_000  # bytes: a few screens, the rest on the site
BENCHMARKS_LIMIT = 40_000


def _nav_pages(entries) -> list[str]:
    pages = []
    for entry in entries:
        if isinstance(entry, str):
            pages.append(entry)
        elif isinstance(entry, dict):
            for value in entry.values():
                pages += [value] if isinstance(value, str) else _nav_pages(value)
    return pages


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site built as `mkdocs build --strict` builds it (a broken link or anchor, or a page the navigation leaves
    out, fails it); warnings are only counted where they are logged, so never with --quiet."""
    site = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stderr[-3000:]
    return site


def test_every_page_is_in_the_navigation_and_the_search_index(site):
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))
    pages = {path.relative_to(REPO / "docs").as_posix() for path in (REPO / "docs").rglob("*.md")}
    assert sorted(_nav_pages(config["nav"])) == sorted(pages)
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    searched = {entry["location"].split("#")[0] for entry in index["docs"]}
    assert {
        page.removesuffix("index.md").removesuffix(".md") + ("" if page.endswith("index.md") else "/") for page in pages
    } <= searched
    assert (site / "guides" / "memory" / "index.html").is_file()


def test_a_broken_link_fails_the_strict_build(tmp_path):
    """What the build above guards against does fail it: a link to a page that does not exist."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[gone](missing.md)\n")
    (tmp_path / "mkdocs.yml").write_text("site_name: t\nstrict: true\nnav:\n  - index.md\n")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode != 0 and "missing.md" in built.stderr


def test_the_readme_is_a_few_screens_and_links_into_the_site():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode("utf-8")) <= README_LIMIT
    for page in ("docs/getting-started.md", "docs/reference/config.md", "docs/benchmarks.md", "docs/families/index.md"):
        assert f"]({page})" in readme, page


def test_every_generated_part_is_current_and_the_benchmarks_page_a_page():
    """What the README and the site hold that is generated (the families tables, the config reference, the benchmarks
    page's tables from benchmarks/*.jsonl, never typed by hand) is what its generator makes now; the benchmarks page
    is current results, not a notebook."""
    update_docs = script_module("update_docs")
    for name, sections in update_docs.SECTIONS.items():
        text = (REPO / name).read_text(encoding="utf-8")
        for section, make in sections.items():
            assert update_docs.replaced(text, section, make()) == text, f"{name} {section}: run scripts/update_docs.py"
    assert len((REPO / "docs" / "benchmarks.md").read_bytes()) <= BENCHMARKS_LIMIT
