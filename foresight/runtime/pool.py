"""One budget across a layer's KV heads: the pooled layout's side of an eviction step (docs/algorithms.md §1, "One
pool per layer").

In the pooled layout (`foresight.runtime.cache`) a layer's H KV heads hold their entries in one pool of slots,
each slot tagged with its owner head, so a head may hold more entries than another while the layer holds H·B. At a
step each head's slots are seen as its own cache (`OwnerView`): the policy reads the per-head tensors it reads
in the per-head layout, per-entry state included, and scores each head's candidates as there; the new state goes
back to the pool's slots (`OwnerView.scatter`) before the compaction. Which candidates stay is `keep_candidates`:
B − L per head (`Allocation.HEAD`, the per-head layout's rule), or AdaKV's allocation (`Allocation.LAYER`): each
head its `floor` best, then the layer's H·(B − L − floor) best left whichever head holds them, which only means
something where the policy's scores compare across heads (`Policy.scores_compare_across_heads`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foresight.cadence import top_k_mask
from foresight.choices import Choice
from foresight.runtime.cache import gather_entries
from foresight.runtime.policy import Policy, StepLayers


class Layout(Choice):
    """How a layer's KV heads hold their entries."""

    HEADS = "heads"  # a cache per KV head, each of B entries after a step
    POOLED = "pooled"  # one pool of H·B slots per layer, each slot tagged with its head


class Allocation(Choice):
    """How a step divides a layer's H·(B − L) kept candidates among its heads."""

    HEAD = "head"  # B − L each
    LAYER = "layer"  # AdaKV's: each head at least the floor, the rest to the best scores of the layer


ADAKV_FLOOR_SHARE = 0.2
"""AdaKV's α: the share of B − L every head keeps at the least (its floor) under `Allocation.LAYER` by default."""


def default_floor(budget: int, interval: int) -> int:
    """AdaKV's floor, α·(B − L) rounded down and at least 1 (19 at B = 128, L = 32)."""
    return max(1, int(ADAKV_FLOOR_SHARE * (budget - interval)))


def pooled_policies() -> list[str]:
    """The names of the policies the pooled layout runs: every `Policy` subclass that declares `runs_pooled` (read
    from the classes, so the refusal below cannot drift from them)."""
    names, classes = set(), list(Policy.__subclasses__())
    while classes:
        cls = classes.pop()
        classes += cls.__subclasses__()
        if cls.runs_pooled and cls.name:
            names.add(cls.name)
    return sorted(names)


def pooled_refusal(name: str) -> str:
    """Why the pooled layout refuses policy `name` (one that does not declare `Policy.runs_pooled`)."""
    return f"layout='pooled' does not run policy {name!r} yet; it runs {', '.join(pooled_policies())}"


def check_runs_pooled(policy: Policy) -> None:
    """Refuse, in one line, a policy the pooled layout does not run yet (`Policy.runs_pooled`), or not with its
    options (`Policy.pooled_limit`)."""
    if not (policy.evicts and policy.runs_pooled):
        raise ValueError(pooled_refusal(policy.name))
    if policy.pooled_limit is not None:
        raise ValueError(f"layout='pooled' does not run policy {policy.name!r} {policy.pooled_limit}")


def check_pooled(policy: Policy, allocation: Allocation) -> None:
    """Refuse, in one line, what the pooled layout does not run of `policy` (`check_runs_pooled`), and `allocation`
    'layer' over keep scores that do not compare across heads (`Policy.scores_compare_across_heads`)."""
    check_runs_pooled(policy)
    if allocation is Allocation.LAYER and not policy.scores_compare_across_heads:
        raise ValueError(
            f"allocation='layer' ranks keep scores across a layer's heads, and {policy.scores_apart_in_words}; "
            "allowed: snapkv, streaming, tova with per_kv_head=True, foresight with a scorer of scale 'log-target'"
        )


def keep_candidates(scores: torch.Tensor, counts: torch.Tensor, allocation: Allocation, floor: int) -> torch.Tensor:
    """Which candidates a step keeps, [layers, rows, Hkv, C] bool, from their keep `scores` [layers, rows, Hkv, C]
    (protected +inf, invalid -inf) and the candidates a head keeps in each row (`counts` [rows]): `counts` per head,
    or, `Allocation.LAYER`, each head's `floor` best and then the best `Hkv·(counts − floor)` of the rest of the
    layer. Ties keep the lower head, then the older entry (`top_k_mask` over the heads in order)."""
    if allocation is Allocation.HEAD:
        return top_k_mask(scores, counts[:, None, None])
    own = top_k_mask(scores, floor)
    rest = scores.masked_fill(own, float("-inf")).flatten(2)
    extra = top_k_mask(rest, (counts[:, None] - floor) * scores.shape[2])
    return own | extra.view_as(own)


@dataclass(frozen=True)
class OwnerView:
    """Each KV head's slots of a pool as its own cache of `width` slots: `index` [layers, rows, H, width] is the pool
    slot of each, a head's valid slots in position order and right-aligned as in a per-head cache, and `held` says
    which are the head's (the others, in front, are padding, seen as invalid entries). `source` [layers, rows, N] is
    the way back: the view slot (flat over the heads, h·width + w) that holds each pool slot, -1 for a slot no head
    holds (an invalid one)."""

    index: torch.Tensor
    held: torch.Tensor
    source: torch.Tensor

    @classmethod
    def of(cls, owners: torch.Tensor, positions: torch.Tensor, heads: int) -> OwnerView:
        """The view of a pool whose slots belong to `owners` [layers, rows, 1, N] and hold `positions` [layers, rows,
        1, N] (-1 on invalid slots). Its width is the most valid slots a head holds: one read of the device."""
        heads_index = torch.arange(heads, device=owners.device)[:, None]
        mine = (owners == heads_index) & (positions >= 0)  # [layers, rows, H, N]
        width = int(mine.sum(-1).amax())
        # A stable sort of the 0/1 mask puts a head's slots last, in position order (as `EvictionCache.compact`).
        index = torch.sort(mine.to(torch.int8), dim=-1, stable=True).indices[..., -width:]
        held = mine.gather(-1, index)
        # Every valid pool slot is one head's: of the view slots that point at it one is held, so the sum of the held
        # ones' numbers (from 1) names it, and a slot no head holds sums to 0 (-1 after the shift).
        number = torch.arange(1, heads * width + 1, device=owners.device) * held.flatten(2)
        source = torch.zeros_like(mine[:, :, 0], dtype=torch.long).scatter_add_(-1, index.flatten(2), number) - 1
        return cls(index, held, source)

    @property
    def width(self) -> int:
        return self.index.shape[-1]

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """A pool's per-slot `tensor` [layers, rows, 1, N, *trailing] as each head's: [layers, rows, H, width,
        *trailing]."""
        heads = self.index.shape[2]
        return gather_entries(tensor.expand(-1, -1, heads, *tensor.shape[3:]), self.index)

    def scatter(self, tensor: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
        """The view's per-slot `tensor` [layers, rows, H, width, *trailing] on the pool: `pool` [layers, rows, 1, N,
        *trailing] with each held slot's value taken from its view slot (the slots no head holds as they are)."""
        taken = gather_entries(tensor.flatten(2, 3), self.source.clamp(min=0))
        held = (self.source >= 0).view(*self.source.shape, *(1,) * (tensor.dim() - 4))
        return torch.where(held, taken, pool[:, :, 0])[:, :, None]

    def step(self, pooled: StepLayers) -> StepLayers:
        """A step's tensors of the pool (`pooled`) as each head's, the padding in front with position -1, and the
        per-entry state gathered with them (`scatter` writes a policy's new state back)."""
        return StepLayers(
            keys=self.gather(pooled.keys),
            values=self.gather(pooled.values),
            positions=self.gather(pooled.positions).masked_fill(~self.held, -1),
            state={name: self.gather(value) for name, value in pooled.state.items()},
            queries=pooled.queries,
            query_positions=pooled.query_positions,
        )

    def to_pool(self, keep: torch.Tensor) -> torch.Tensor:
        """The view's kept slots `keep` [layers, rows, H, width] as the pool's, [layers, rows, 1, N]."""
        return self.scatter(keep, torch.zeros_like(self.source, dtype=torch.bool)[:, :, None])
