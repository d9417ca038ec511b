"""docs/architecture.md stays true to the code: its ownership table names every module and only modules
that exist, the layer count it states is the import-linter contract's, and a module past 400 lines says
at its top why it is one module."""

from __future__ import annotations

import ast
import re
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
FOLDER_ROWS = ("foresight/policies/", "foresight/bench/", "foresight/commands/")  # one row owns the folder
LONG_MODULE = 400


def owned_paths() -> set[str]:
    """Paths the ownership table names: a row's first cell lists backticked paths, later ones relative to
    the first one's folder (`foresight/data/sampler.py`, `slot_cache.py`)."""
    section = DOC.read_text().split("## Who owns what", 1)[1].split("\n## ", 1)[0]
    paths = set()
    for row in section.splitlines():
        if not row.startswith("| `"):
            continue
        names = re.findall(r"`([^`]+)`", row.split(" | ", 1)[0])
        folder = names[0].rsplit("/", 1)[0] + "/" if "/" in names[0] else ""
        paths.update(name if "/" in name else folder + name for name in names)
    return paths


def modules() -> set[str]:
    found = set()
    for package in ("foresight", "trainers"):
        for path in (ROOT / package).rglob("*.py"):
            relative = path.relative_to(ROOT).as_posix()
            if path.name != "__init__.py" and not relative.startswith(FOLDER_ROWS):
                found.add(relative)
    return found


def test_the_ownership_table_names_every_module():
    owned = owned_paths()
    assert sorted(modules() - owned) == []


def test_every_path_of_the_ownership_table_exists():
    assert sorted(path for path in owned_paths() if not (ROOT / path).exists()) == []


def test_the_stated_layer_count_is_the_contracts():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(contract for contract in contracts if contract["type"] == "layers")["layers"]
    stated = re.search(r"(\d+) layers of the import-linter contract", DOC.read_text())
    assert stated is not None and int(stated[1]) == len(layers)


def test_the_stated_group_count_is_the_code():
    """Groups of the import graph: each package of foresight/, each of its base modules, and trainers/."""
    library = ROOT / "foresight"
    packages = [path for path in library.iterdir() if (path / "__init__.py").is_file()]
    base = [path for path in library.glob("*.py") if path.name != "__init__.py"]
    stated = re.search(
        r"now (\d+) groups \(the (\d+) packages of `foresight/`, its (\d+) base modules", DOC.read_text()
    )
    assert stated is not None
    assert tuple(map(int, stated.groups())) == (len(packages) + len(base) + 1, len(packages), len(base))


@pytest.mark.parametrize("package", ["foresight", "trainers", "studies"])
def test_long_modules_say_why_they_are_one_module(package):
    unexplained = []
    for path in sorted((ROOT / package).rglob("*.py")):
        source = path.read_text()
        docstring = ast.get_docstring(ast.parse(source)) or ""
        if len(source.splitlines()) > LONG_MODULE and "Size:" not in docstring:
            unexplained.append(path.relative_to(ROOT).as_posix())
    assert unexplained == []
