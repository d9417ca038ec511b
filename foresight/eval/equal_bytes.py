"""The learned scorer against each heuristic at equal bytes held, every budget on the same tokens
(docs/algorithms.md section 8, "Headroom at equal bytes").

Equal entries (`foresight.eval.headroom`) compares policies at one budget B, each scored on its own tokens.
A policy's memory is more than its entries (`foresight.runtime.held_memory`: the learned scorer also holds
its state and a ring of L queries), so here each heuristic's budget sweep is a curve of loss ratio against
the bytes it holds per sequence, read at the learned scorer's bytes:

- common tokens: on each trace, every compared row (the learned scorer and golden at their budget, each
  heuristic at every budget of its sweep) is scored on the predictions from the latest first eviction among
  them, i.e. after the largest budget's first eviction; a trace some row did not score is left out. A
  larger B no longer drops early tokens from its mean, so the sweep's ratios differ only by the budget.
- equal bytes: a heuristic's loss ratio is linearly interpolated between the two budgets of its sweep whose
  held bytes bracket the learned scorer's (no extrapolation: a sweep that does not reach them gives none).
- headroom: best heuristic at those bytes (lowest interpolated ratio, chosen again in every resample) −
  learned, over best − golden.
- token sets: every figure over all the common predictions, or those of prompt or of generated tokens only
  (`TokenSet`; a saved row holds its trace's prompt length).
- the learned scorer's own curve: when the folders hold it at other budgets too (fits of its recipe at
  those budgets, under the same row name), each of its points is compared with the best heuristic at that
  point's bytes, so the two curves meet on one axis; the headroom stays at `budget`, where golden is.

Intervals resample traces as the headroom does (`RESAMPLES` paired resamples, a fixed seed): every row is
pooled over the same resampled traces and the interpolation is redone on each resample; the held bytes are
fixed (every scored trace holds B + L entries).

Per-token losses: `TokenLosses` is one replayed trace under one (policy, budget), what eval saves
(token_nll.pt) so that budgets can be scored on common tokens after the run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from foresight.eval.headroom import ORACLE, Estimate, estimate, percent, pooled_ratio, resample_weights
from foresight.eval.metric_registry import TokenSet
from foresight.eval.stats import CONFIDENCE, RESAMPLES


@dataclass(frozen=True)
class TokenLosses:
    """One trace replayed under one policy at one budget: the NLL of every prediction [T - 1] and the first
    prediction made with an evicted cache (`foresight.metrics.scored_tokens`)."""

    policy: str
    budget: int
    index: int
    first_eviction: int
    nll: torch.Tensor
    prompt_length: int | None = None  # None: a token_nll.pt written before the token sets


TOKEN_NLL = "token_nll.pt"
"""The file of an eval folder holding every scored trace's per-token NLL (`save_token_losses`)."""


def save_token_losses(
    path: str | os.PathLike, losses: Sequence[TokenLosses], reference: dict[int, torch.Tensor]
) -> None:
    """Write the per-token NLL of every (policy, budget, trace) and the full cache's NLL per trace."""
    rows = [vars(loss) | {"nll": loss.nll.float()} for loss in losses]
    torch.save({"rows": rows, "reference": {i: nll.float() for i, nll in reference.items()}}, path)


def load_token_losses(path: str | os.PathLike) -> tuple[list[TokenLosses], dict[int, torch.Tensor]]:
    """The losses and reference NLL `save_token_losses` wrote."""
    saved = torch.load(path, weights_only=True)
    return [TokenLosses(**row) for row in saved["rows"]], saved["reference"]


Row = tuple[str, int]
"""(policy, budget) of an evaluated row."""


def merged_token_losses(folders: Sequence[Path]) -> tuple[list[TokenLosses], dict[int, torch.Tensor]]:
    """The per-token losses of several eval folders of the same traces, each (policy, budget, trace) once, and
    the full cache's NLL per trace."""
    merged: dict[tuple[str, int, int], TokenLosses] = {}
    reference: dict[int, torch.Tensor] = {}
    for folder in folders:
        path = Path(folder) / TOKEN_NLL
        if not path.is_file():
            raise ValueError(
                f"{folder} holds no {TOKEN_NLL}; make it with `foresight eval --traces ... --out {folder}`"
            )
        losses, full = load_token_losses(path)
        for index, nll in full.items():
            if index in reference and not torch.equal(reference[index], nll):
                raise ValueError(f"trace {index} differs between {folder} and an earlier folder: merge one trace set")
            reference[index] = nll
        merged |= {(loss.policy, loss.budget, loss.index): loss for loss in losses}
    return list(merged.values()), reference


def common_starts(losses: Sequence[TokenLosses], rows: Sequence[Row]) -> dict[int, int]:
    """Per trace scored by every row of `rows`: the first prediction all of them score (the latest first eviction)."""
    scored: dict[int, dict[Row, int]] = {}
    for loss in losses:
        if (loss.policy, loss.budget) in rows:
            scored.setdefault(loss.index, {})[loss.policy, loss.budget] = loss.first_eviction
    return {index: max(firsts.values()) for index, firsts in sorted(scored.items()) if len(firsts) == len(set(rows))}


def common_token_sums(
    losses: Sequence[TokenLosses],
    reference: dict[int, torch.Tensor],
    starts: dict[int, int],
    row: Row,
    token_set: TokenSet = TokenSet.ALL,
) -> tuple[np.ndarray, np.ndarray]:
    """The row's NLL and the full cache's, summed per trace over the common tokens of `token_set` (in the order
    of `starts`)."""
    by_index = {loss.index: loss for loss in losses if (loss.policy, loss.budget) == row}
    evicted, full = [], []
    for i, start in starts.items():
        mask = _token_mask(by_index[i], start, token_set)
        evicted.append(float(by_index[i].nll[start:][mask].double().sum()))
        full.append(float(reference[i][start:][mask].double().sum()))
    return np.array(evicted), np.array(full)


def _token_mask(loss: TokenLosses, start: int, token_set: TokenSet) -> torch.Tensor:
    """The predictions from `start` on that belong to `token_set`."""
    if token_set is not TokenSet.ALL and loss.prompt_length is None:
        raise ValueError(f"{TOKEN_NLL} was written before the token sets; run that `foresight eval` again")
    return token_set.mask(start, loss.nll.numel() - start, loss.prompt_length or 0)


def interpolate(xs: Sequence[float], ys: np.ndarray, x: float) -> np.ndarray | None:
    """Linear interpolation at `x` of ys [points, ...] along xs (increasing); None outside [xs[0], xs[-1]]."""
    if not xs[0] <= x <= xs[-1]:
        return None
    right = min(int(np.searchsorted(xs, x, side="left")), len(xs) - 1)
    if xs[right] == x or right == 0:
        return ys[right]
    t = (x - xs[right - 1]) / (xs[right] - xs[right - 1])
    return ys[right - 1] + t * (ys[right] - ys[right - 1])


@dataclass(frozen=True)
class Curve:
    """One heuristic's sweep on the common tokens: its budgets, the MiB each holds and its loss ratios, and the
    ratio interpolated at the learned scorer's bytes (None: the sweep does not reach them)."""

    policy: str
    budgets: tuple[int, ...]
    held_mib: tuple[float, ...]
    loss_ratio: tuple[Estimate, ...]
    at_learned: Estimate | None


@dataclass(frozen=True)
class Meeting:
    """One point of the learned scorer's curve against the best heuristic at the bytes it holds there."""

    budget: int
    held_mib: float
    best: str
    gain: Estimate  # best heuristic at these bytes − learned


@dataclass(frozen=True)
class EqualBytes:
    """The learned scorer against every heuristic's sweep at its bytes, on common tokens."""

    learned: str
    budget: int
    held_mib: float
    traces: int
    tokens: int
    learned_ratio: Estimate
    golden_ratio: Estimate
    curves: tuple[Curve, ...]
    best: str | None  # the best heuristic at the learned scorer's bytes (of the full sample; resamples choose again)
    share: Estimate | None  # of the headroom (best at equal bytes − golden) the learned scorer captures
    gain: Estimate | None  # best at equal bytes − learned
    best_entries: str | None  # the best heuristic at the learned scorer's budget, on the same common tokens
    share_entries: Estimate | None
    learned_curve: Curve | None = None  # its points at every budget the folders hold it at, when more than one
    meetings: tuple[Meeting, ...] = ()  # each such point against the best heuristic at its bytes
    token_set: TokenSet = TokenSet.ALL

    def markdown(self) -> str:
        lines = [
            f"{self.learned} at B = {self.budget} holds {self.held_mib:.2f} MiB per sequence; {self.traces} traces, "
            f"{self.tokens} common tokens (after the largest budget's first eviction; {self.token_set.value} "
            f"predictions); {CONFIDENCE:.0%} bootstrap "
            f"intervals over traces ({RESAMPLES} resamples, paired). Loss ratios on the common tokens.",
            "",
            "| policy | B | MiB / sequence | loss ratio |",
            "|---|---:|---:|---:|",
            f"| golden | {self.budget} | – | {self.golden_ratio} |",
        ]
        own = self.learned_curve or Curve(self.learned, (self.budget,), (self.held_mib,), (self.learned_ratio,), None)
        lines += [
            f"| {self.learned} | {b} | {mib:.2f} | {ratio} |"
            for b, mib, ratio in zip(own.budgets, own.held_mib, own.loss_ratio)
        ]
        for curve in self.curves:
            lines += [
                f"| {curve.policy} | {b} | {mib:.2f} | {ratio} |"
                for b, mib, ratio in zip(curve.budgets, curve.held_mib, curve.loss_ratio)
            ]
            at = "beyond its sweep" if curve.at_learned is None else str(curve.at_learned)
            lines.append(f"| {curve.policy} at {self.learned}'s bytes | – | {self.held_mib:.2f} | {at} |")
        lines.append("")
        if self.share is not None:
            lines += [
                f"- at equal bytes: best heuristic {self.best}; {self.best} − {self.learned} {self.gain}; "
                f"share of the headroom captured {percent(self.share, 1)}",
            ]
        if self.share_entries is not None:
            lines.append(
                f"- at equal entries (B = {self.budget}, the same tokens): best heuristic {self.best_entries}; share "
                f"of the headroom captured {percent(self.share_entries, 1)}"
            )
        lines += [
            f"- {self.learned}'s curve at B = {m.budget} ({m.held_mib:.2f} MiB): best heuristic at those bytes "
            f"{m.best}; {m.best} − {self.learned} {m.gain}"
            for m in self.meetings
        ]
        return "\n".join(lines)


def equal_bytes(
    losses: Sequence[TokenLosses],
    reference: dict[int, torch.Tensor],
    held_mib: dict[Row, float],
    learned: str,
    budget: int,
    heuristics: Sequence[str],
    seed: int = 0,
    resamples: int = RESAMPLES,
    token_set: TokenSet | str = TokenSet.ALL,
) -> EqualBytes | None:
    """The headroom at equal bytes of `learned` at `budget` over `heuristics` (each with every budget it was
    evaluated at), on the common tokens of `token_set`, or None when no trace was scored by every compared row
    or none holds a prediction of that set. `held_mib`: MiB per sequence of every row (eval's `kv_mib`)."""
    token_set = TokenSet.parse(token_set)
    available = {(loss.policy, loss.budget) for loss in losses}
    sweeps = {h: sorted(b for p, b in available if p == h) for h in heuristics}
    required = [(learned, budget), (ORACLE, budget)]
    missing = [f"{p} at B = {b}" for p, b in required if (p, b) not in available] + [
        h for h, bs in sweeps.items() if not bs
    ]
    if missing:
        raise ValueError(f"no per-token losses for {', '.join(missing)} in the folders given")
    own = sorted(b for p, b in available if p == learned)
    rows = [*required, *((learned, b) for b in own if b != budget), *((h, b) for h, bs in sweeps.items() for b in bs)]
    starts = common_starts(losses, rows)
    learned_rows = {loss.index: loss for loss in losses if (loss.policy, loss.budget) == (learned, budget)}
    if token_set is not TokenSet.ALL:  # traces with none of the set's predictions after their start left out
        starts = {i: start for i, start in starts.items() if bool(_token_mask(learned_rows[i], start, token_set).any())}
    if not starts:
        return None
    weights = resample_weights(len(starts), resamples, seed)
    ratios = {row: pooled_ratio(*common_token_sums(losses, reference, starts, row, token_set), weights) for row in rows}

    def heuristics_at(mib: float) -> dict[str, np.ndarray]:
        """Each heuristic's ratio interpolated at `mib` along its sweep (those whose sweep reaches it)."""
        at = {
            h: interpolate([held_mib[h, b] for b in bs], np.stack([ratios[h, b] for b in bs]), mib)
            for h, bs in sweeps.items()
        }
        return {h: ratio for h, ratio in at.items() if ratio is not None}

    target = held_mib[learned, budget]
    at_bytes = heuristics_at(target)
    curves = [
        Curve(
            h,
            tuple(bs),
            tuple(held_mib[h, b] for b in bs),
            tuple(estimate(ratios[h, b]) for b in bs),
            estimate(at_bytes[h]) if h in at_bytes else None,
        )
        for h, bs in sweeps.items()
    ]
    ours, golden = ratios[learned, budget], ratios[ORACLE, budget]
    best = _lowest(at_bytes)
    at_entries = {h: ratios[h, budget] for h, bs in sweeps.items() if budget in bs}
    best_entries = _lowest(at_entries)
    best_at_bytes, best_at_entries = (
        np.min(list(at.values()), axis=0) if at else None for at in (at_bytes, at_entries)
    )
    learned_curve, meetings = None, []
    if len(own) > 1:
        mibs = tuple(held_mib[learned, b] for b in own)
        learned_curve = Curve(learned, tuple(own), mibs, tuple(estimate(ratios[learned, b]) for b in own), None)
        for b, mib in zip(own, mibs):
            there = at_bytes if b == budget else heuristics_at(mib)
            if (h := _lowest(there)) is not None:
                meetings.append(Meeting(b, mib, h, estimate(there[h] - ratios[learned, b])))
    return EqualBytes(
        learned=learned,
        budget=budget,
        held_mib=target,
        traces=len(starts),
        tokens=sum(int(_token_mask(learned_rows[i], start, token_set).sum()) for i, start in starts.items()),
        learned_ratio=estimate(ours),
        golden_ratio=estimate(golden),
        curves=tuple(curves),
        best=best,
        share=None if best is None else estimate(_share(best_at_bytes, ours, golden)),
        gain=None if best is None else estimate(best_at_bytes - ours),
        best_entries=best_entries,
        share_entries=None if best_entries is None else estimate(_share(best_at_entries, ours, golden)),
        learned_curve=learned_curve,
        meetings=tuple(meetings),
        token_set=token_set,
    )


def _lowest(ratios: dict[str, np.ndarray]) -> str | None:
    """The policy of the lowest ratio (its full-sample value, [0]), or None when there is none."""
    return min(ratios, key=lambda h: ratios[h][0]) if ratios else None


def _share(heuristic: np.ndarray, learned: np.ndarray, golden: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return (heuristic - learned) / (heuristic - golden)


def held_by_row(folders: Sequence[Path]) -> dict[Row, float]:
    """Each (policy, budget)'s MiB per sequence (eval's kv_mib, from `foresight.runtime.held_memory`)."""
    rows = [row for folder in folders for row in json.loads((Path(folder) / "results.json").read_text())]
    return {(row["policy"], row["budget"]): row["kv_mib"] for row in rows if row.get("kv_mib") is not None}
