"""How far an engine's log-probabilities of the tokens it sampled are from the project's teacher-forced pass.

An imported trace's loss and entropy come from the project's own pass of --model (`trace_import`); when the
engine also returned the log-probability of each sampled token, the two must agree, up to the engines'
arithmetic: float32 on both sides agrees to ~1e-5 nats per token, a bfloat16 engine to a few hundredths on
average. A larger mean gap means the engine ran another model (or other weights, or another dtype's
rounding on every token), or returned processed log-probabilities (after temperature or top-k/top-p),
so the stored losses would not describe the traces the engine made. Each compared trace is recorded in its
shard's record as {"row", "tokens", "max_abs_diff", "mean_abs_diff"} (nats); a trace whose mean gap exceeds
the tolerance is flagged by row in the import's summary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_TOLERANCE = 0.05  # nats, mean |Δ| per trace
_SHOWN_ROWS = 8


def logprob_agreement(row: int, engine: Sequence[float], token_nll: np.ndarray, prompt_length: int) -> dict[str, Any]:
    """The record of one trace: |engine log-probability − pass log-probability| of its first len(engine)
    completion tokens; the pass's log-probability of token t is −token_nll[t − 1]."""
    engine = np.asarray(engine, dtype=np.float64)
    start = prompt_length - 1
    ours = -np.asarray(token_nll[start : start + len(engine)], dtype=np.float64)
    gap = np.abs(engine - ours)
    return {"row": row, "tokens": len(gap), "max_abs_diff": float(gap.max()), "mean_abs_diff": float(gap.mean())}


@dataclass(frozen=True)
class LogprobAgreement:
    """The compared traces of an import (their shard records' entries) and the tolerance that flags one."""

    traces: tuple[dict[str, Any], ...]
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def tokens(self) -> int:
        return sum(trace["tokens"] for trace in self.traces)

    @property
    def max_abs_diff(self) -> float:
        return max(trace["max_abs_diff"] for trace in self.traces)

    @property
    def mean_abs_diff(self) -> float:
        """Over all compared tokens."""
        return sum(trace["mean_abs_diff"] * trace["tokens"] for trace in self.traces) / self.tokens

    @property
    def flagged(self) -> list[int]:
        """The rows whose mean |Δ| exceeds the tolerance."""
        return sorted(trace["row"] for trace in self.traces if trace["mean_abs_diff"] > self.tolerance)

    def describe(self) -> str:
        """One clause for the import's summary line (empty when no row carried log-probabilities)."""
        if not self.traces:
            return ""
        line = (
            f"engine log-probabilities of {len(self.traces)} traces ({self.tokens} tokens) against the pass: "
            f"max |Δ| {self.max_abs_diff:.2e}, mean |Δ| {self.mean_abs_diff:.2e} nats"
        )
        flagged = self.flagged
        if flagged:
            shown = ", ".join(map(str, flagged[:_SHOWN_ROWS])) + (", ..." if len(flagged) > _SHOWN_ROWS else "")
            line += (
                f"; {len(flagged)} traces over the tolerance of {self.tolerance:g} nats mean |Δ| (row {shown}): "
                "the engine ran another model, or returned processed log-probabilities"
            )
        return line
