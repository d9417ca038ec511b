"""Engines of the storage and held-memory tests: a tiny three-layer Qwen3 and each policy at B = 12, L = 4."""

from __future__ import annotations

from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from tests.scorers import random_scorer

B, L = 12, 4


def make(name: str, model) -> EvictionEngine:
    """The engine of policy `name` on `model` (the learned one with a random scorer), evicting at (B, L)."""
    policy = make_policy(name, scorer=random_scorer(model)) if name == "foresight" else make_policy(name)
    return EvictionEngine(model, policy, EvictionConfig(B, L) if policy.evicts else None)
