"""Teacher-forced replays kept batch by batch, so that a killed `foresight eval --traces` resumes where it stopped.

`OUT/replays/settings.json` records the model, its dtype and device and the label kind; each evicting policy's
tally of one batch is `OUT/replays/POLICY/B{B}-L{L}/batch-DIGEST.pt`, written atomically once the batch is
replayed. DIGEST names the batch by its traces' indices and tokens, so a batch of other traces (another
`--batch-size`, another traces folder) is replayed again, never read as this one. Several processes started on
one OUT share its batches: each claims a batch before replaying it (`OUT/replays/claims/`), as the label
processes share a traces folder.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch

from foresight.artifacts import atomic_file
from foresight.data.trace_store import Trace
from foresight.eval.run_store import RunStore
from foresight.eval.specs import PolicySpec
from foresight.eval.tally import TraceTally
from foresight.runtime.engine import EvictionConfig


def batch_digest(batch: Sequence[Trace]) -> str:
    """A name for a batch of traces, from each one's index and tokens, in order."""
    digest = hashlib.blake2b(digest_size=12)
    for trace in batch:
        digest.update(f"{trace.index}:{trace.input_ids.numel()}:".encode())
        digest.update(trace.input_ids.cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class ReplayStore(RunStore):
    """Each (evicting policy, budget, batch)'s `TraceTally`, kept as soon as its replay ends."""

    def _path(self, spec: PolicySpec, eviction: EvictionConfig, batch: Sequence[Trace]) -> Path:
        return self.policy_folder(spec, eviction) / f"batch-{batch_digest(batch)}.pt"

    def holds(self, specs: Sequence[PolicySpec], eviction: EvictionConfig, batch: Sequence[Trace]) -> bool:
        """Whether every evicting policy of `specs` has its replay of this batch kept (nothing left to replay)."""
        return all(self._path(spec, eviction, batch).is_file() for spec in specs if spec.evicts)

    def claim_path(self, eviction: EvictionConfig, batch: Sequence[Trace]) -> Path:
        """The file a process holds while it replays this batch (`foresight.artifacts.claimed`)."""
        return self.folder / "claims" / f"B{eviction.budget}-L{eviction.interval}-batch-{batch_digest(batch)}.claim"

    def load(self, spec: PolicySpec, eviction: EvictionConfig, batch: Sequence[Trace]) -> TraceTally | None:
        """The tally an earlier run kept for this batch, or None."""
        path = self._path(spec, eviction, batch)
        if not path.is_file():
            return None
        return TraceTally.from_state(torch.load(path, weights_only=True), batch)

    def save(self, spec: PolicySpec, tally: TraceTally, eviction: EvictionConfig, batch: Sequence[Trace]) -> None:
        with atomic_file(self._path(spec, eviction, batch)) as temporary:
            torch.save(tally.state(), temporary)
