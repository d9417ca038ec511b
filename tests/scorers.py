"""Scorers and supervised examples the tests build: a random scorer for a tiny model, the scorer fields the
data module fixes, synthetic traces whose α a scorer can learn, and a quiet trainer to fit on them."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from foresight.bench.common import random_scorer as bench_random_scorer
from foresight.models import describe, tiny_model
from foresight.scorer.model import ForesightScorer, ScorerConfig

SUPERVISED_B, SUPERVISED_L = 16, 4


def default_shaped_config():
    """A tiny Llama config with the embedded default model's attention shape (30 layers, 9 query / 3 KV heads of
    64): what a config of the default model builds against without loading it."""
    return tiny_model(
        "llama", num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_size=576
    ).config


def scorer_spec(model=None) -> dict:
    """The scorer fields the data module fixes, for a tiny Llama (or `model`) at B=16, L=4."""
    shape = describe(model or tiny_model("llama"))
    return dict(
        num_layers=shape.num_layers,
        num_query_heads=shape.num_query_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        budget=SUPERVISED_B,
        interval=SUPERVISED_L,
        base_model="tiny",
        feature_set="paper",
    )


def synthetic_traces(count: int, steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Traces whose α is a fixed linear function of the keys plus one feature: learnable by the scorer."""
    spec = scorer_spec()
    generator = torch.Generator().manual_seed(seed)
    direction = torch.randn(spec["head_dim"], generator=torch.Generator().manual_seed(99))
    shape = (steps, spec["num_layers"], spec["num_kv_heads"], SUPERVISED_B)
    traces = []
    for _ in range(count):
        keys = torch.randn(*shape, spec["head_dim"], generator=generator)
        features = torch.rand(*shape, 6 * spec["num_query_heads"] // spec["num_kv_heads"], generator=generator)
        alpha = torch.sigmoid(keys @ direction + 2 * features[..., 4])
        traces.append(
            {
                "keys": keys,
                "values": torch.randn(*shape, spec["head_dim"], generator=generator),
                "features": features,
                "alpha": alpha,
            }
        )
    return traces


def quiet_trainer(max_steps: int, folder: Path) -> L.Trainer:
    """A Lightning trainer on the CPU for `max_steps` steps that logs, checkpoints and prints nothing."""
    return L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=folder,
    )


def random_scorer(model, budget: int = 12, interval: int = 4, **options) -> ForesightScorer:
    """The library's random scorer for `model` at the tests' cadence (B = 12, L = 4 unless given), with its
    first layer's weights spread (x4) so that keep scores lie far apart and evictions are decisive."""
    return bench_random_scorer(model, budget, interval, spread=4, **{"base_model": "tiny-llama", **options})


def make_config(**overrides) -> ScorerConfig:
    """A small scorer configuration (3 layers, 4 query / 2 KV heads, head dim 8, B = 16, L = 4, official-8)."""
    options = dict(
        num_layers=3,
        num_query_heads=4,
        num_kv_heads=2,
        head_dim=8,
        budget=16,
        interval=4,
        base_model="tiny-llama",
        feature_set="official-8",
    )
    return ScorerConfig(**{**options, **overrides})


def make_scorer(seed: int = 0, **overrides) -> ForesightScorer:
    """A scorer of `make_config(**overrides)` with weights drawn from `seed`."""
    torch.manual_seed(seed)
    return ForesightScorer(make_config(**overrides))


def random_inputs(config: ScorerConfig, *leading: int, seed: int = 1):
    """Random keys, values and features [*leading, Hkv, 5 entries, ...] for `config`."""
    generator = torch.Generator().manual_seed(seed)
    shape = (*leading, config.num_kv_heads, 5)
    return (
        torch.randn(*shape, config.head_dim, generator=generator),
        torch.randn(*shape, config.head_dim, generator=generator),
        torch.rand(*shape, config.feature_width, generator=generator),
    )
