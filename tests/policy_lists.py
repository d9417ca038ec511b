"""The policy lists of the test suite, built from the policy registry with explicit exclusions, and each
policy built for a random eviction step."""

from __future__ import annotations

import torch

from foresight.models import ModelShape, tiny_model
from foresight.policies import POLICIES, make_policy
from foresight.policies.triattention_stats import TriAttentionStats
from tests.eviction_steps import DIM, GROUP, KV_HEADS
from tests.scorers import random_scorer

NOT_SCORED = {
    "full": "never evicts, so it has no keep scores",
    "golden": "reads the golden labels of a real trace; a random step is off their cadence",
}
"""Registered policies the keep-score tests (half precision, CUDA against CPU) leave out, with the reason."""

SCORED = tuple(name for name in sorted(POLICIES) if name not in NOT_SCORED)
"""Every other registered policy: each scores a random eviction step (`make` builds it)."""


def constructible_policies() -> list[str]:
    """Registered evicting policies that need no external artifact (labels, a scorer) to be built."""
    names = []
    for name, cls in sorted(POLICIES.items()):
        try:
            cls()
        except TypeError:
            continue
        if cls.evicts:
            names.append(name)
    return names


def make(name: str, model=None):
    """The policy `name` with its artifact where it needs one: foresight a random scorer for B = 14, L = 4 (of
    `model`, or of the random step's shape), triattention random statistics of the random step's shape."""
    if name == "foresight":
        model = model or tiny_model("llama", num_attention_heads=KV_HEADS * GROUP, head_dim=DIM, num_hidden_layers=1)
        return make_policy("foresight", scorer=random_scorer(model, budget=14, interval=4))
    if name == "triattention":
        return make_policy("triattention", stats=random_stats(GROUP))
    return make_policy(name)


def random_stats(group: int, rope_scale: float = 1.0, seed: int = 0) -> TriAttentionStats:
    """TriAttention statistics of random query means for the random step's shape (one layer, KV_HEADS x group heads)."""
    generator = torch.Generator().manual_seed(seed)
    heads, bands = KV_HEADS * group, DIM // 2
    q_mean = torch.complex(
        torch.randn(1, heads, bands, generator=generator), torch.randn(1, heads, bands, generator=generator)
    )
    q_abs_mean = q_mean.abs() + torch.rand(1, heads, bands, generator=generator)
    inv_freq = 10000.0 ** (-torch.arange(bands, dtype=torch.float32) / bands)
    return TriAttentionStats("random", ModelShape(1, heads, KV_HEADS, DIM), q_mean, q_abs_mean, inv_freq, rope_scale)
