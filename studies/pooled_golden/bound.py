"""Golden with one budget across heads: the pooled schedules and the masked replay that scores them.

Per-head golden (docs/algorithms.md §4) keeps B − L entries in every (layer, KV head) cache at every step, the ones
with the largest future score α_{i,t}. A pooled golden keeps the same total over a group of heads: a layer's H KV
heads (`Pool.LAYER`, H·(B − L)) or every head of the model (`Pool.ALL`), each head keeping at least `floor` of its
candidates (its recent window of L entries is kept besides, as in every policy here); the rest go to the group's
largest α, whichever head holds them. Greedy on its own trajectory, as golden: a head's candidates at a step are
what it kept at the step before plus the L entries leaving its window. α reads the full-cache attention only
(`foresight.labels.future_score_table`), so one table scores every trajectory.

The runtime holds the same count in every head, so a pooled schedule is scored by a masked replay instead: the
full-cache forward, each head's attention restricted to the entries its cache would hold (the kept set of the last
eviction step plus the window and the tokens fed since). With per-head golden's kept sets it gives the engine's
golden replay (tests/test_pooled_golden.py), so the difference between schedules is the schedules'.

A heuristic's schedule depends on its own trajectory, so it is made during the replay (`HeuristicSchedule`): before
each eviction step the replay hands it the attention logits of the last queries, and it keeps SnapKV's or TOVA's
choice per head (the engine's twins, `foresight.policies.snapkv` and `.tova`) or, pooled, AdaKV's: one budget
over a group of heads by the same scores, each head keeping at least the floor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from foresight.cadence import step_position, top_k_mask
from foresight.choices import Choice
from foresight.policies.snapkv import masked_softmax
from foresight.runtime.capture import attention_implementation, cache_argument, register_attention

MASKED_ATTENTION = "foresight_masked_replay"


class Pool(Choice):
    """Which heads share one budget: each its own (golden), a layer's, or the whole model's."""

    HEAD = "head"
    LAYER = "layer"
    ALL = "all"


Eviction = tuple[int, torch.Tensor]
"""An eviction step: the position of the newest token when it ran and the kept set after it, bool [layers, H, N]."""


def pooled_schedule(
    future: torch.Tensor,
    budget: int,
    interval: int,
    pool: Pool | str,
    floor: int,
    shift: int = 0,
    compression: torch.Tensor | None = None,
) -> list[Eviction]:
    """The greedy schedule of one trace by α: every eviction step's position and kept set.

    future: α of steps t = 1..M, [M, layers, H, N] (N covers every candidate position). shift and compression: a
    decode regime's compression step after position P − 1 = B − 1 + shift, whose α row ([layers, H, N]) is
    `compression` (`Greedy` says which entries each step chooses among)."""
    if (shift > 0) != (compression is not None):
        raise ValueError(
            f"shift={shift} and a compression row go together: a decode regime's shift is its compression's"
        )
    schedule = Greedy(budget, interval, future.shape[0], Pool.parse(pool), floor, shift)
    rows = ([] if compression is None else [compression]) + list(future)
    width = future.shape[-1]
    return [
        (position, schedule.keep(alpha, schedule.candidates(index, width)))
        for index, (position, alpha) in enumerate(zip(schedule.positions, rows))
    ]


@dataclass
class Greedy:
    """The candidates and the kept sets of a greedy schedule on its own trajectory: at each step the entries kept at
    the step before plus the L leaving the window (step 1: positions 0..B − 1; a decode compression after position
    P − 1 = B − 1 + shift: every prompt entry but the window); every group of heads (`Pool`) keeps its heads' share
    of B − L entries each, a head at least `floor` (0..L, so that its L leaving entries can always meet it), the
    rest by score; ties keep the lower head, then the lower position."""

    budget: int
    interval: int
    num_steps: int
    pool: Pool
    floor: int = 0
    shift: int = 0
    _kept: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.pool = Pool.parse(self.pool)
        if not 0 <= self.floor <= self.interval:
            raise ValueError(
                f"floor={self.floor} must be 0..L={self.interval}: a head's L leaving entries must be able to meet it"
            )

    @property
    def positions(self) -> list[int]:
        """The newest position at each eviction step (`foresight.cadence.step_position`; step 0: the compression)."""
        first = 0 if self.shift else 1
        return [
            step_position(step, self.budget, self.interval, self.shift) for step in range(first, self.num_steps + 1)
        ]

    def candidates(self, index: int, width: int) -> torch.Tensor:
        """The candidates [layers, H, width] of eviction step `index` (of `positions`), after the steps before it."""
        layers, heads = (1, 1) if self._kept is None else self._kept.shape[:2]
        candidates = torch.zeros(layers, heads, width, dtype=torch.bool)
        step = index - bool(self.shift)  # the index among steps 1..M
        if step < 0:
            candidates[..., : self.budget + self.shift - self.interval] = True
            return candidates
        if self._kept is None:
            candidates[..., : self.budget - self.interval] = True
        else:
            candidates[..., : self._kept.shape[-1]] = self._kept
        leaving = self.budget + (step - 1) * self.interval + self.shift
        candidates[..., leaving : leaving + self.interval] = True
        return candidates

    def keep(self, scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """The step's kept set by `scores` [layers, H, width] among `candidates` (broadcast over layers and heads)."""
        self._kept = _select(scores, candidates.expand_as(scores), self.budget - self.interval, self.floor, self.pool)
        return self._kept


def _select(alpha: torch.Tensor, candidates: torch.Tensor, share: int, floor: int, pool: Pool) -> torch.Tensor:
    """The kept set [layers, H, N]: each group's heads keep `share` entries each in all, a head at least `floor` (a
    head keeps exactly `share` when it is its own group). A head's candidates number at least L >= floor and a
    group's at least its heads' shares, so no non-candidate (α = −inf here) is ever kept."""
    layers, heads, width = alpha.shape
    group = {Pool.HEAD: 1, Pool.LAYER: heads, Pool.ALL: layers * heads}[pool]
    scores = alpha.masked_fill(~candidates, float("-inf")).reshape(-1, group, width)
    own = top_k_mask(scores, share if group == 1 else floor)
    rest = scores.masked_fill(own, float("-inf")).flatten(1)
    extra = top_k_mask(rest, 0 if group == 1 else group * (share - floor)).view_as(own)
    return (own | extra).reshape(layers, heads, width)


def golden_evictions(
    kept_positions: torch.Tensor, prefill_kept: torch.Tensor | None, budget: int, interval: int, width: int, shift: int
) -> list[Eviction]:
    """Per-head golden's schedule from its labels (`GoldenLabels.kept_positions()` [M, layers, H, B − L] and its
    decode compression's `prefill_kept`), as the masked replay reads one."""

    def mask(positions: torch.Tensor) -> torch.Tensor:
        held = torch.zeros(*positions.shape[:-1], width, dtype=torch.bool)
        return held.scatter(-1, positions.long(), True)

    evictions = [] if prefill_kept is None else [(step_position(0, budget, interval, shift), mask(prefill_kept))]
    return evictions + [
        (step_position(step, budget, interval, shift), mask(kept)) for step, kept in enumerate(kept_positions, 1)
    ]


class Schedule(Protocol):
    """What the masked replay evicts by: the positions after which its steps run and each step's kept set, given the
    attention logits of the `window` queries before it ([layers, Hkv, G, window, keys]; None when window is 0) and
    the keys the newest of them sees ([layers, Hkv, keys])."""

    positions: list[int]
    window: int

    def kept(self, index: int, logits: torch.Tensor | None, visible: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass
class FixedSchedule:
    """A schedule made before the replay (`pooled_schedule`, `golden_evictions`)."""

    evictions: Sequence[Eviction]
    window: int = 0

    @property
    def positions(self) -> list[int]:
        return [position for position, _ in self.evictions]

    def kept(self, index: int, logits: torch.Tensor | None, visible: torch.Tensor | None = None) -> torch.Tensor:
        return self.evictions[index][1]


@dataclass
class HeuristicSchedule(Greedy):
    """A heuristic's evictions on its own trajectory (`Greedy`'s candidates), per head as the engine runs it or pooled
    as AdaKV allocates: the heads of a group keep their shares of B − L in all by the heuristic's scores, each at
    least `floor`.

    heuristic: "snapkv" (the engine's `snapkv` with its defaults: the last 8 queries' logits max-pooled over the
    group's query heads, a softmax over the candidates, their mean over the queries, a max-pool of 7 along the
    candidates in position order) or "tova" (the newest query's attention over everything the cache holds, its
    mean over the layer's heads as the engine's `tova` keeps one set per layer; pooled, over each KV head's group
    only, the per-head statistic an allocation needs)."""

    heuristic: str = "snapkv"
    kernel: int = 7

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.heuristic not in ("snapkv", "tova"):
            raise ValueError(f"heuristic {self.heuristic!r}: the masked replay scores 'snapkv' and 'tova'")

    @property
    def window(self) -> int:
        """Queries whose logits a step reads: SnapKV's 8, clamped to L as the engine does; TOVA's newest one."""
        return min(8, self.interval) if self.heuristic == "snapkv" else 1

    def kept(self, index: int, logits: torch.Tensor | None, visible: torch.Tensor | None = None) -> torch.Tensor:
        layers, heads, _, _, width = logits.shape
        candidates = self.candidates(index, width).expand(layers, heads, width)
        logits = logits.float().cpu()
        if self.heuristic == "snapkv":
            scores = snapkv_scores(logits, candidates, self.kernel)
        else:
            scores = tova_scores(logits, visible.cpu(), per_head=self.pool is not Pool.HEAD)
        return self.keep(scores, candidates)


def snapkv_scores(logits: torch.Tensor, candidates: torch.Tensor, kernel: int) -> torch.Tensor:
    """`foresight.policies.snapkv.SnapKV.importance` over the candidates of each head ([layers, Hkv, keys] bool)
    from the window's logits [layers, Hkv, G, window, keys]; −inf off the candidates."""
    weights = masked_softmax(logits.amax(2), candidates[:, :, None]).mean(2)
    order = torch.sort((~candidates).to(torch.int8), dim=-1, stable=True).indices  # candidates first, in order
    packed = weights.gather(-1, order).masked_fill(~candidates.gather(-1, order), float("-inf"))
    pooled = F.max_pool1d(packed.reshape(-1, 1, packed.shape[-1]), kernel, stride=1, padding=kernel // 2)
    scores = torch.empty_like(packed).scatter_(-1, order, pooled.view_as(packed))
    return scores.masked_fill(~candidates, float("-inf"))


def tova_scores(logits: torch.Tensor, visible: torch.Tensor, per_head: bool) -> torch.Tensor:
    """`foresight.policies.tova.TOVA` from the newest query's logits [layers, Hkv, G, 1, keys] and what it sees
    [layers, Hkv, keys]: its softmax over the visible keys, the mean over the layer's heads (`per_head`: over each
    KV head's group) -> [layers, Hkv, keys]."""
    weights = masked_softmax(logits[..., -1, :], visible[:, :, None])
    if per_head:
        return weights.mean(2)
    return weights.mean((1, 2), keepdim=True)[:, :, 0].expand(-1, logits.shape[1], -1)


def _masked_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    visible: torch.Tensor,
    window_logits: dict[int, torch.Tensor] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA with each KV head's own key mask (`visible` [layers, Hkv, queries, keys]), its query heads sharing it;
    with `window_logits` ({layer: window}), the logits of the last `window` queries are kept per layer as
    [Hkv, G, window, keys]."""
    groups = query.shape[1] // key.shape[1]
    if window_logits is not None:
        window = window_logits[module.layer_idx]
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        logits = query[0, :, -window:].float() @ key[0].float().repeat_interleave(groups, dim=0).transpose(-1, -2)
        window_logits[module.layer_idx] = (logits * scale).unflatten(0, (key.shape[1], groups))
    mask = visible[module.layer_idx].repeat_interleave(groups, dim=0)[None]
    key, value = (tensor.repeat_interleave(groups, dim=1) for tensor in (key, value))
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return output.transpose(1, 2).contiguous(), None


register_attention(MASKED_ATTENTION, _masked_attention, full_cache=True)


@torch.no_grad()
def masked_replay(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    schedule: Schedule | Sequence[Eviction],
    interval: int,
    chunk: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token NLL [T − 1] and top-1 predictions [T − 1] of the trace, each head attending only to what its cache
    holds: before the first eviction every earlier token, after an eviction at position e its kept set, the
    window (e − L, e] and the tokens fed since (no evictions: the full cache). `schedule`: the evictions, or a
    `Schedule` that chooses each kept set from the last queries' logits. `chunk` bounds the forwards before the
    first eviction."""
    schedule = schedule if hasattr(schedule, "kept") else FixedSchedule(schedule)
    length = input_ids.numel()
    config = model.config.get_text_config()
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    cache = DynamicCache(config=model.config)
    positions = [position for position in schedule.positions if position < length - 1]
    unevicted = positions[0] + 1 if positions else length  # no schedule: the full cache throughout
    starts = list(range(0, unevicted, chunk))
    if len(starts) > 1 and unevicted - starts[-1] < schedule.window:
        starts.pop()  # the span before the first step holds the window's queries whole
    bounds = [*starts, *(position + 1 for position in positions), length]
    nll, greedy = torch.empty(length - 1), torch.empty(length - 1, dtype=torch.long)
    device = model.device
    ids = input_ids.to(device)
    state: tuple[int, torch.Tensor] | None = None
    with attention_implementation(model, MASKED_ATTENTION):
        for start, end in zip(bounds, bounds[1:]):
            keys = torch.arange(end, device=device)
            visible = (keys[None, :] <= torch.arange(start, end, device=device)[:, None]).expand(layers, heads, -1, -1)
            if state is not None:
                newest, kept = state
                held = torch.zeros(layers, heads, end, dtype=torch.bool, device=device)
                held[..., : min(kept.shape[-1], end)] = kept[..., :end].to(device)
                held[..., max(newest - interval + 1, 0) :] = True
                visible = visible & held[:, :, None, :]
            evicting = end - 1 in positions
            captured = dict.fromkeys(range(layers), schedule.window) if evicting and schedule.window else None
            logits = model(
                input_ids=ids[start:end][None],
                **cache_argument(model, cache),
                use_cache=True,
                visible=visible,
                window_logits=captured,
            ).logits[0]
            targets = slice(start, min(end, length - 1))
            log_probs = logits[: targets.stop - start].float().log_softmax(-1)
            nll[targets] = -log_probs.gather(-1, ids[start + 1 : targets.stop + 1, None])[:, 0].cpu()
            greedy[targets] = log_probs.argmax(-1).cpu()
            if evicting:
                window = None if captured is None else torch.stack([captured[layer] for layer in range(layers)])
                state = (end - 1, schedule.kept(positions.index(end - 1), window, visible[:, :, -1]))
    return nll, greedy
