"""The test suite's own contract: every evicting policy has a slow twin that a test compares it with, and
no test module imports another (shared helpers live in modules named for their purpose)."""

from __future__ import annotations

import ast
from pathlib import Path

from foresight.policies import POLICIES
from tests.policy_lists import NOT_SCORED, SCORED
from tests.reference_policies import TWINS

TESTS = Path(__file__).resolve().parent
MODULES = {path: ast.parse(path.read_text()) for path in sorted(TESTS.glob("test_*.py"))}


def test_every_evicting_policy_has_a_twin_that_a_test_calls():
    evicting = {name for name, cls in POLICIES.items() if cls.evicts}
    assert set(TWINS) == evicting
    called = {
        node.func.attr
        for tree in MODULES.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "ref"
    }
    uncalled = {name: twin.__name__ for name, twin in TWINS.items() if twin.__name__ not in called}
    assert not uncalled, f"twins no test calls as ref.NAME(...): {uncalled}"


def test_the_scored_list_is_the_registry_less_its_stated_exclusions():
    assert set(SCORED) | set(NOT_SCORED) == set(POLICIES) and not set(SCORED) & set(NOT_SCORED)
    assert all(reason.strip() for reason in NOT_SCORED.values())


def test_no_test_module_imports_another():
    names = {path.stem for path in MODULES}
    offenders = []
    for path, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            else:
                continue
            offenders += [(path.name, name) for name in imported if name.split(".")[-1] in names]
    assert not offenders
