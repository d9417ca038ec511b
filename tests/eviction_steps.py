"""A random eviction step as the engine builds it (the policy tests' input), a step of many zero entries (to
see a random policy's score distribution), and a policy's keep scores of one step from fresh per-entry state."""

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
