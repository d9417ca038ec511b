"""The import-linter contracts of pyproject.toml hold (the layers; only the command layer and the pipeline
benchmark reach the trainers), and would catch a wrong import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("foresight", "trainers")


def layers() -> list[list[str]]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    return [[name.strip() for name in layer.split("|")] for layer in contract["layers"]]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """Run import-linter on the packages under `root` (a separate process, so nothing is cached)."""
    script = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_module_of_the_library_has_a_layer():
    named = {name for layer in layers() for name in layer}
    modules = {
        f"foresight.{path.stem}"
        for path in (REPO / "foresight").iterdir()
        if path.name != "__init__.py" and (path.suffix == ".py" or (path / "__init__.py").is_file())
    }
    assert modules - named == set(), "add these modules to a layer in pyproject.toml"


def test_the_layer_contract_is_kept():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout[-2000:]


def test_an_import_against_the_layers_breaks_the_contract(tmp_path):
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    cache = tmp_path / "foresight" / "runtime" / "cache.py"
    cache.write_text(cache.read_text() + "\nimport foresight.policies.h2o  # the runtime reaching up into a policy\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1
    assert "foresight.runtime.cache -> foresight.policies.h2o" in result.stdout


@pytest.mark.parametrize(
    "importer, line",
    [
        (
            "foresight/eval/replay.py",
            "import trainers.reinforcement.rollouts  # the library reaching into the trainers",
        ),
        (
            "foresight/bench/serve.py",
            "import trainers.reinforcement.grpo  # a product benchmark importing the trainers",
        ),
    ],
)
def test_only_the_command_layer_and_the_pipeline_bench_reach_the_trainers(tmp_path, importer, line):
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    path = tmp_path / importer
    path.write_text(path.read_text() + f"\n{line}\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1
    assert "Only the command layer and the pipeline benchmark reach the trainers BROKEN" in result.stdout
    module = importer.removesuffix(".py").replace("/", ".")
    assert f"{module} -> {line.split()[1]}" in result.stdout


def test_attention_is_hooked_in_one_place():
    """Labels, the evaluation probe and the engine all register attention through `runtime.capture`."""
    hooks = {
        path.relative_to(REPO).as_posix()
        for package in PACKAGES
        for path in (REPO / package).rglob("*.py")
        if "AttentionInterface.register" in path.read_text() or "set_attn_implementation" in path.read_text()
    }
    assert hooks <= {"foresight/runtime/capture.py", "foresight/bench/kvpress_worker.py"}, hooks


def test_the_public_api_resolves_to_its_modules():
    import importlib

    import foresight

    for name in foresight.__all__:
        module = importlib.import_module(foresight._EXPORTS[name])
        assert getattr(foresight, name) is getattr(module, name)
    with pytest.raises(AttributeError, match="no attribute 'evict'"):
        foresight.evict
