"""The eviction cadence (docs/algorithms.md §1 and §4): one home for the rules every stage shares.

- B > L >= 1 (`check_budget`);
- eviction step t = 1..M runs right after position p_t = B + tL - 1, when the cache first holds
  B + L entries (`step_position`, `step_of`); M = floor((T - B) / L) steps fit in a trace of T tokens
  (`eviction_steps`), and a trace shorter than B + L has none (`TraceTooShort`);
- at a step the most recent L entries are kept, and the top B - L candidates by keep score
  (`top_k_mask`, or `keep_top` for positions with their future scores); ties keep the older entry;
- a batch replayed on that cadence prefills the same `golden_prefill` tokens in every row, so every
  row's step t falls after p_t whatever its prompt length.

Two regimes place the steps (`Regime`, docs/algorithms.md §1). **streaming** (the paper's): the cadence above
from the first token, the prompt streamed through the window. **decode** (what `foresight generate` runs): the
whole prompt of P tokens prefilled; when P > B + L, one compression step right after it (position P - 1) keeps
the L newest and B - L of the P - L older entries, and step t follows at p_t = P - 1 + tL; a prompt of at most
B + L tokens runs the streaming cadence, since no step falls inside it. Both are the cadence above moved by a
per-trace `shift` (`regime_shift`: 0, or P - B after a compression), which every function here takes.

The labels, the golden policy, the runtime, the evaluation and the trainer all call these functions,
so changing the cadence means editing this file only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from foresight.choices import Choice

DEFAULT_BUDGET = 128
DEFAULT_INTERVAL = 32
"""B and L wherever a command line leaves them out (every verb, benchmark and study): the shipped scorer's, trained
for the default model. A learned scorer runs only at the B and L it was trained for (its config says them)."""


class Regime(Choice):
    """Where the eviction steps of a trace fall (module docstring)."""

    STREAMING = "streaming"  # the paper's: from the first token, the prompt streamed through the window
    DECODE = "decode"  # foresight generate's: the whole prompt prefilled, one compression step, then every L


def regime_shift(prompt_length: int, budget: int, interval: int, regime: Regime | str) -> int:
    """How far a trace's steps lie after the streaming cadence's: P - B in the decode regime when the prompt
    of P tokens ends with a compression step (P > B + L), else 0. Step t then follows p_t = B + tL - 1 + shift,
    and the compression (step 0) follows P - 1 = B - 1 + shift."""
    check_budget(budget, interval)
    if Regime.parse(regime) is Regime.DECODE and prompt_length > budget + interval:
        return prompt_length - budget
    return 0


def regime_prefill(prompt_length: int, budget: int, interval: int, regime: Regime | str) -> int:
    """Tokens a one-trace replay prefills so that its first eviction runs where the regime puts it: B + L in the
    streaming regime (the cache fills there), the whole prompt after which a decode compression runs."""
    return prompt_length if regime_shift(prompt_length, budget, interval, regime) else budget + interval


class TraceTooShort(ValueError):
    """A trace shorter than B + L never fills the cache, so it has no eviction step."""


def check_budget(budget: int, interval: int) -> None:
    """B > L >= 1: an eviction step keeps the L most recent entries plus B - L >= 1 candidates."""
    for name, value in (("interval L", interval), ("budget B", budget)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name}={value!r} must be an integer")
    if interval < 1:
        raise ValueError(f"interval L={interval} must be at least 1")
    if budget <= interval:
        raise ValueError(f"budget B={budget} must be larger than the interval L={interval}")


def eviction_steps(num_tokens: int, budget: int, interval: int, shift: int = 0) -> int:
    """M = floor((T - B - shift) / L): the steps whose position p_t = B + tL - 1 + shift lies inside a trace of T
    tokens (after a decode regime's compression step, which is not counted)."""
    check_budget(budget, interval)
    if num_tokens < budget + interval + shift:
        needed = f"B + L = {budget + interval}" if not shift else f"its prompt + L = {budget + shift + interval}"
        raise TraceTooShort(f"trace of {num_tokens} tokens is shorter than {needed}: no eviction step")
    return (num_tokens - budget - shift) // interval


def step_position(step: int, budget: int, interval: int, shift: int = 0) -> int:
    """p_t = B + tL - 1 + shift: the newest position in the cache when step t (1-based) runs."""
    return budget + step * interval - 1 + shift


def step_of(newest: torch.Tensor, budget: int, interval: int, shift: int | torch.Tensor = 0) -> torch.Tensor:
    """Step t of an eviction whose newest cached position is `newest` (0 where it is off the cadence, and at a
    decode regime's compression step); `shift` per trace, an int or a tensor broadcastable to `newest`."""
    offset = newest + 1 - budget - shift
    on_cadence = (offset % interval == 0) & (offset >= interval)
    return torch.where(on_cadence, offset // interval, 0)


def golden_prefill(prompt_lengths: Sequence[int], budget: int, interval: int) -> int:
    """Tokens every row of a batch prefills so that all rows evict on the cadence from the first token:
    at most B + L (so the prefill itself runs at most step 1) and no more than the shortest prompt."""
    return min(budget + interval, *prompt_lengths)


def top_k_mask(scores: torch.Tensor, counts: int | torch.Tensor) -> torch.Tensor:
    """Boolean mask of the `counts` highest scores along the last dim (ties: the lower index, which is
    the older entry). `counts` is an int or a tensor broadcastable to the leading dims, e.g. [batch, 1, 1]
    for a count per batch row."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order))
    return ranks < counts


def keep_top(candidates: torch.Tensor, alpha: torch.Tensor, count: int) -> torch.Tensor:
    """Top_{B-L} of ForesightKV Eq. 5: the `count` candidates with the largest α, in ascending position.

    `candidates` must be ascending along the last dim, so ties keep the lower position."""
    kept = top_k_mask(alpha, count)
    return candidates.masked_select(kept).view(*candidates.shape[:-1], count)
