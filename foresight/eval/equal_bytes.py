"""The learned scorer against each heuristic at equal bytes held (docs/algorithms.md section 8).

Per-token losses first: `TokenLosses` is one replayed trace under one (policy, budget), what eval saves
(token_nll.pt) so that budgets can be scored on common tokens after the run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLosses:
    """One trace replayed under one policy at one budget: the NLL of every prediction [T - 1] and the first
    prediction made with an evicted cache (`foresight.metrics.scored_tokens`)."""

    policy: str
    budget: int
    index: int
    first_eviction: int
    nll: torch.Tensor


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
