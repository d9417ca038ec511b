"""Eviction policies, one small module each, collected in a registry by name."""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import fields
from typing import Any

from foresight.runtime.policy import EvictionContext, Policy

POLICIES: dict[str, type[Policy]] = {}

DEFAULT_POLICY = "snapkv"
"""The policy a command runs when none is named (generate, replay, demo, the pipeline benchmark's eval stage):
the best heuristic on unseen set A (docs/benchmarks.md)."""


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: add a policy to the registry under its `name`."""
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, **options: Any) -> Policy:
    """Instantiate a registered policy; unknown names and options get a one-line error."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}")
    cls = POLICIES[name]
    allowed = [f.name for f in fields(cls) if f.init]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"policy {name!r} has no option {unknown[0]!r}; its options are: {', '.join(allowed) or 'none'}"
        )
    return cls(**options)


def constructible(cls: type[Policy]) -> bool:
    """Whether a policy runs on its defaults alone (not one that needs labels or a scorer)."""
    try:
        cls()
    except TypeError:  # a required field: labels or a scorer
        return False
    return True


def _load_all() -> None:
    for module in pkgutil.iter_modules(__path__):
        if module.name != "base":
            importlib.import_module(f"{__name__}.{module.name}")


_load_all()

__all__ = ["POLICIES", "EvictionContext", "Policy", "constructible", "make_policy", "register"]
