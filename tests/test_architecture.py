"""The architecture the folders show is the one the imports keep: `.importlinter`'s contracts, checked."""

import configparser
import os
import re
import subprocess
import sys
from pathlib import Path

import difftune

REPO = Path(__file__).resolve().parents[1]
CONTRACTS = REPO / ".importlinter"


def test_import_contracts_are_kept():
    """In a process of its own: import-linter configures logging as a command does, which would silence other
    libraries' loggers for the rest of the session."""
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
            "--config",
            str(CONTRACTS),
            "--no-cache",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]  # the report names each broken import


def test_every_package_and_module_of_the_library_has_a_layer():
    """A new package or top-level module must be placed in the layers (else no contract would hold it), and each
    package says its job and what it may import."""
    contracts = configparser.ConfigParser()
    contracts.read(CONTRACTS)
    layered = {
        name.strip()
        for line in contracts["importlinter:contract:layers"]["layers"].splitlines()
        for name in line.replace("|", ":").split(":")
        if name.strip()
    }
    root = Path(difftune.__file__).parent
    members = {path.stem for path in root.glob("*.py") if path.stem != "__init__"}
    packages = {path.parent.name for path in root.glob("*/__init__.py")}
    assert members | packages == layered
    for package in packages:
        doc = (root / package / "__init__.py").read_text(encoding="utf-8")
        assert doc.startswith('"""') and ("May import" in doc or "may import" in doc), package


def test_code_is_laid_out_by_the_formatter():
    """`ruff format` lays out every file (CI's `ruff check` then holds E501: only strings and comments can run long)."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_family_is_named_outside_its_own_folder():
    """Adding a family touches its folder (and its configs, tests and tiny base), nothing else: the library, the toy
    tooling and the published configs ask families and never name one, by a string or by importing its folder. The one
    name left is a default for files older than `model.family`."""
    import re

    from difftune.config import FAMILY_NAMES

    root = Path(difftune.__file__).parent
    names = "|".join(FAMILY_NAMES)
    named_by_string = re.compile(rf"[\"']({names})[\"']")
    imported = re.compile(rf"difftune\.families\.({names})\b|from difftune\.families import ({names})\b")
    named = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[0] == "families" and relative.parts[1] in FAMILY_NAMES:
            continue  # a family's folder (a family may build on another: Kontext on Flux.1)
        text = path.read_text(encoding="utf-8")
        named += [f"{relative}: {match.group(0)}" for match in named_by_string.finditer(text)]
        named += [f"{relative}: {match.group(0)}" for match in imported.finditer(text)]
    assert named == ['training/checkpoint.py: "sd"']  # a checkpoint saved before `model.family` is SD's


def test_a_family_is_one_folder_and_the_toy_keeps_no_familys_builder():
    """Each family's folder holds its family (registered as `FAMILY`), its published bases and its micro model; a
    builder of the toy's shared `tiny.py` that one family's micro model alone uses belongs in that family's folder."""
    import ast

    from difftune.config import FAMILY_NAMES

    root = Path(difftune.__file__).parent
    for name in FAMILY_NAMES:
        assert {"__init__.py", "micro.py", "bases.json"} <= {p.name for p in (root / "families" / name).iterdir()}, name
    assert {p.name for p in (root / "families").iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        *FAMILY_NAMES,
        "common",
    }
    tiny_text = (root / "toy" / "tiny.py").read_text(encoding="utf-8")
    tiny = ast.parse(tiny_text)
    builders = [node.name for node in tiny.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]
    toy_sources = {
        path.relative_to(root).as_posix(): path.read_text(encoding="utf-8")
        for path in [*root.glob("families/*/micro.py"), *(root / "toy").rglob("*.py")]
        if path.name != "tiny.py"
    }
    single_family = []
    for builder in builders:
        users = [source for source, text in toy_sources.items() if re.search(rf"\b{builder}\b", text)]
        used_in_tiny = len(re.findall(rf"\b{builder}\b", tiny_text)) > 1
        if len(users) == 1 and users[0].startswith("families/") and not used_in_tiny:
            single_family.append(f"{builder}: {users[0]}")
    assert single_family == []


def test_adapter_kinds_are_types_the_library_acts_on_not_names():
    """An adapter kind is one type in adapter_kinds.py (its facts, its config problems, its peft config); the library
    acts on the type and never compares `adapter.kind` with a name, so adding a kind touches that module and the
    type's implementations, nothing else."""
    import re

    from difftune.adapter_kinds import KINDS

    root = Path(difftune.__file__).parent
    names = "|".join(KINDS)
    compared = re.compile(rf"(adapter|config)\.kind\s*(==|!=|in|not in)\s*[\"'(]|[\"']({names})[\"']\s*(==|!=)")
    found = [
        f"{path.relative_to(root)}: {match.group(0)}"
        for path in sorted(root.rglob("*.py"))
        if path.relative_to(root).parts[0] != "toy" and path.name != "adapter_kinds.py"
        for match in compared.finditer(path.read_text(encoding="utf-8"))
    ]
    assert found == []


def test_every_adapter_kind_has_each_job_the_adapters_package_does_by_type():
    from difftune.adapter_kinds import KINDS, AdapterKind
    from difftune.adapters.export import result_path, save_kind
    from difftune.adapters.trained import attach, trained_part_names

    for job in (trained_part_names, attach, result_path, save_kind):
        missing = [name for name, kind in KINDS.items() if job.dispatch(type(kind)) is job.dispatch(AdapterKind)]
        assert missing == [], f"{job.__name__} has no implementation for {missing}"


def _protocol_members(protocol: type) -> set[str]:
    own = {name for name in vars(protocol) if not name.startswith("_")}
    return own | set(getattr(protocol, "__annotations__", {}))


def test_what_a_lower_layer_asks_of_a_higher_ones_types_is_there():
    """A lower layer names what it asks of a higher layer's type as a Protocol of its own (no import of that type,
    not even for annotations): each member it names is one the real type has, nested sections included."""
    import typing

    from difftune.adapter_kinds import Settings
    from difftune.config import Config
    from difftune.families import FAMILIES
    from difftune.models.components import PartsFamily

    def missing(protocol: type, value: object, path: str) -> list[str]:
        hints = typing.get_type_hints(protocol)
        found = []
        for member in sorted(_protocol_members(protocol)):
            if not hasattr(value, member):
                found.append(f"{path}.{member}")
            elif isinstance(hints.get(member), type) and issubclass(hints[member], typing.Protocol):
                found += missing(hints[member], getattr(value, member), f"{path}.{member}")
        return found

    assert missing(Settings, Config(), "config") == []
    assert [gap for family in FAMILIES.values() for gap in missing(PartsFamily, family, family.name)] == []
    assert all("TYPE_CHECKING" not in path.read_text() for path in Path(difftune.__file__).parent.rglob("*.py"))


def test_a_family_added_as_one_folder_is_found_everywhere(tmp_path):
    """Adding a family is one folder: in a copy of the library with one more family folder (FLUX.2 [klein]'s, among
    the smallest, under another name) and nothing else changed, `model.family` accepts it, the registry loads it, the
    memory plan knows its reference base, the toy builds its micro pipeline and the README's family table lists it."""
    import shutil

    package = tmp_path / "difftune"
    shutil.copytree(Path(difftune.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    added = package / "families" / "added_family"
    shutil.copytree(package / "families" / "flux2_klein", added)
    family = added / "__init__.py"
    family.write_text(family.read_text().replace('name = "flux2_klein"', 'name = "added_family"'))
    check = """
from pathlib import Path
import difftune
from difftune import published
from difftune.config import FAMILY_NAMES, Config
from difftune.families import FAMILIES, family_table_markdown
from difftune.toy.micro import build_pipeline
assert Path(difftune.__file__).parent == Path("difftune").resolve(), difftune.__file__
assert "added_family" in FAMILY_NAMES and FAMILIES["added_family"].name == "added_family"
assert Config(model={"family": "added_family"}).model.family == "added_family"
assert published.reference_bases()["added_family"] == "black-forest-labs/FLUX.2-klein-4B"
assert type(build_pipeline(family="added_family")).__name__ == "Flux2KleinPipeline"
assert "| `added_family` | `Flux2KleinPipeline` |" in family_table_markdown(Path("models"))
"""
    done = subprocess.run(
        [sys.executable, "-c", check],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_readme_says_what_a_family_must_say():
    """The docs' "Adding a family" lists, by role, the members a family has no default for (annotated without a
    value, or raising NotImplementedError): the list is the code's."""
    import inspect

    from difftune.families.common.conditioning import Conditioning
    from difftune.families.common.drawing import Drawing
    from difftune.families.common.family import Family
    from difftune.families.common.loading import Loading
    from difftune.families.common.targets import AdapterTargets

    def must_say(role: type) -> list[str]:
        members = [name for name in role.__annotations__ if name not in vars(role)]
        for name, value in vars(role).items():
            function = value.fget if isinstance(value, property) else value
            if callable(function) and "raise NotImplementedError" in inspect.getsource(function):
                members.append(name)
        return members

    readme = (REPO / "docs" / "contributing" / "adding-a-family.md").read_text(encoding="utf-8")
    listed = readme.split("<!-- family-must-say:start -->")[1].split("<!-- family-must-say:end -->")[0]
    said = {
        role: sorted(re.findall(r"`(\w+)`", line.split(":", 1)[1]))
        for line in listed.strip().splitlines()
        for role in re.findall(r"`(\w+)`", line.split(":", 1)[0])
    }
    roles = (Family, Conditioning, AdapterTargets, Loading, Drawing)
    assert said == {role.__name__: sorted(must_say(role)) for role in roles}
