"""A random eviction step as the engine builds it (the policy tests' input), a step of many zero entries (to
see a random policy's score distribution), a policy's keep scores of one step from fresh per-entry state, and a
hand-built step of the learned scorer's standardised sets."""

from __future__ import annotations

import torch

from foresight.policies import EvictionContext

KV_HEADS = 2
INVALID_PER_ROW = (0, 3)  # left padding / eviction leftovers in front of row 1


def candidate_positions(generator: torch.Generator, window_start: int, candidates: int) -> torch.Tensor:
    """[batch, Hkv, C]: each head its own sorted candidate positions below `window_start`,
    after the row's invalid (-1) slots."""
    rows = []
    for invalid in INVALID_PER_ROW:
        heads = []
        for _ in range(KV_HEADS):
            chosen = torch.randperm(window_start, generator=generator)[: candidates - invalid].sort().values
            heads.append(torch.cat([torch.full((invalid,), -1), chosen]))
        rows.append(torch.stack(heads))
    return torch.stack(rows)


DIM, INTERVAL, CANDIDATES = 8, 4, 14
BATCH = len(INVALID_PER_ROW)
SCALING = DIM**-0.5


def clustered_keys(generator: torch.Generator, count: int) -> torch.Tensor:
    """Keys [batch, Hkv, count, D], half of them near one of three directions, so some pairs have
    cosine similarity above 0.5 and others do not."""
    centres = torch.randn(3, DIM, generator=generator) * 2.0
    near = centres[torch.randint(0, 3, (BATCH, KV_HEADS, count), generator=generator)]
    noise = torch.randn(BATCH, KV_HEADS, count, DIM, generator=generator)
    use_centre = torch.rand(BATCH, KV_HEADS, count, 1, generator=generator) < 0.5
    return torch.where(use_centre, near + noise, noise * 2.0)


def random_context(group: int, seed: int = 0, query_start: int | None = None) -> EvictionContext:
    """An eviction step as the engine builds it: C candidates below position 40, then the recent
    window of L entries at 40..43, whose tokens are the L buffered queries. `query_start` moves the
    queries back among the candidates, so the causal mask matters for candidates too."""
    generator = torch.Generator().manual_seed(seed)
    window_start = 40
    recent = torch.arange(window_start, window_start + INTERVAL)
    positions = torch.cat(
        [candidate_positions(generator, window_start, CANDIDATES), recent.expand(BATCH, KV_HEADS, -1)], dim=-1
    )
    keys = clustered_keys(generator, CANDIDATES + INTERVAL)
    first_query = window_start if query_start is None else query_start
    return EvictionContext(
        layer_idx=0,
        num_layers=1,
        keys=keys,
        values=torch.randn(keys.shape, generator=generator),
        positions=positions,
        num_candidates=CANDIDATES,
        scaling=SCALING,
        queries=torch.randn(BATCH, KV_HEADS * group, INTERVAL, DIM, generator=generator) * 1.5,
        query_positions=torch.arange(first_query, first_query + INTERVAL).expand(BATCH, -1),
    )


def zero_context(entries: int, candidates: int, layer_idx: int, num_layers: int) -> EvictionContext:
    """One row of `entries` zero keys and values per KV head at positions 0.., the first `candidates` of them
    candidates: nothing in it tells entries apart, so a random policy's scores show their distribution."""
    return EvictionContext(
        layer_idx=layer_idx,
        num_layers=num_layers,
        keys=torch.zeros(1, KV_HEADS, entries, 1),
        values=torch.zeros(1, KV_HEADS, entries, 1),
        positions=torch.arange(entries).expand(1, KV_HEADS, -1),
        num_candidates=candidates,
        scaling=1.0,
    )


GROUP = 2


def keep_scores(policy, context: EvictionContext) -> torch.Tensor:
    """The policy's keep scores of one step, from fresh per-entry state."""
    policy.reset()
    shape = context.positions.shape
    for field in policy.state_fields:
        trailing = (GROUP,) if field.per_query_head else ()
        context.state[field.name] = torch.full((*shape, *trailing), field.fill, device=context.positions.device)
    context.state.update(policy.observe(context))
    return policy.keep_scores(context)


def standardised_step(scorer, scale: float = 1.0, budget: int = 12, interval: int = 4) -> EvictionContext:
    """A hand-built step of layer 1 for a standardised scorer at B = `budget`, L = `interval`: two rows, row 1 with
    padding slots; `scale` multiplies the block attention and every raw sum of the state."""
    shape = scorer.config
    generator = torch.Generator().manual_seed(6)
    rows, kv_heads, group, dim, entries = 2, shape.num_kv_heads, shape.group_size, shape.head_dim, budget + interval
    positions = torch.cat(
        [torch.randperm(40, generator=generator)[:budget].sort().values, torch.arange(40, 40 + interval)]
    )
    positions = positions.repeat(rows, kv_heads, 1)
    positions[1, :, :3] = -1
    sums = (rows, kv_heads, entries, group)
    context = EvictionContext(
        layer_idx=1,
        num_layers=shape.num_layers,
        keys=torch.randn(rows, kv_heads, entries, dim, generator=generator),
        values=torch.randn(rows, kv_heads, entries, dim, generator=generator),
        positions=positions,
        num_candidates=budget,
        scaling=dim**-0.5,
        state={
            "cumulative": torch.rand(sums, generator=generator) * 3 * scale,
            "decayed": torch.rand(sums, generator=generator) * scale,
            "recent": torch.rand(sums, generator=generator) * 0.5 * scale,
        },
        queries=torch.randn(rows, shape.num_query_heads, interval, dim, generator=generator),
        query_positions=torch.arange(40, 40 + interval).repeat(rows, 1),
        first_observed=torch.tensor([12, 40]),  # row 0 observed from 12 on before this block; row 1 from this one
    )
    context.attention = context.attention * scale  # fills the cached property
    return context
