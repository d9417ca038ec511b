"""A run's state between forwards: its cache, each row's cadence mirrored on the host (`HostCadence`) and its
counters (`RunStats`), which the engine's drivers and its eviction step both read and write."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from foresight.runtime.cache import EvictionCache


@dataclass
class RunStats:
    """Counters of one generation or replay run. Seconds are the device's (`DeviceClock`: CUDA events on a
    GPU, read once at the end of the run), so the eviction share is the device time eviction steps took."""

    tokens: int = 0
    evictions: int = 0  # eviction steps (each evicts one or more rows)
    row_evictions: list[int] = field(default_factory=list)  # eviction steps each row took part in
    max_entries: int = 0
    forward_seconds: float = 0.0
    eviction_seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)  # decode latency per generated token

    @property
    def eviction_share(self) -> float:
        total = self.forward_seconds + self.eviction_seconds
        return self.eviction_seconds / total if total else 0.0


@dataclass
class HostCadence:
    """Each row's valid entries, the count at which it evicts and the count an eviction leaves, mirrored on
    the host: every decision of the cadence (which rows evict, how far a chunk may run, how many slots the
    compacted cache keeps) is read here, so an eviction step whose rows all evict reads nothing back
    from the device. When a row evicts it holds at least its limit (protected + B + L valid entries), so
    its top-k of protected + B − L candidates never reaches an invalid slot, and the step leaves it
    exactly those candidates and the recent window: protected + B entries."""

    lengths: list[int]
    limits: list[int]
    left: list[int]  # entries an eviction step leaves: kept candidates + L

    def fed(self, counts: Sequence[int]) -> None:
        self.lengths = [length + count for length, count in zip(self.lengths, counts, strict=True)]

    def due(self) -> list[bool]:
        return [length >= limit for length, limit in zip(self.lengths, self.limits)]

    def room(self) -> int:
        """Tokens every row can still take before its next eviction."""
        return min(limit - length for length, limit in zip(self.lengths, self.limits))

    def evict(self, due: Sequence[bool]) -> int:
        """Apply an eviction step of the `due` rows; the entries the widest row holds after it."""
        self.lengths = [left if evicts else length for length, left, evicts in zip(self.lengths, self.left, due)]
        return max(self.lengths)

    def select_rows(self, rows: Sequence[int]) -> HostCadence:
        return HostCadence(*([values[row] for row in rows] for values in (self.lengths, self.limits, self.left)))


@dataclass
class Run:
    """Per-run bookkeeping: the cache and each row's cadence (on the device for the masks, on the host
    for the decisions)."""

    cache: EvictionCache
    cadence: HostCadence
    protected: torch.Tensor  # [batch] prompt entries that are never evicted
    limits: torch.Tensor  # [batch] entries at which the row evicts
    keep_counts: torch.Tensor  # [batch] candidates kept by an eviction step
    sinks: int
    first_eviction: torch.Tensor  # [batch] next position at the first eviction, -1 before
    first_observed: torch.Tensor  # [batch] oldest query of the first window observed, -1 before (a WINDOW policy)
    next_positions: torch.Tensor  # [batch]
    prefilled: bool = False
    stats: RunStats = field(default_factory=RunStats)

    def select_rows(self, rows: Sequence[int]) -> Run:
        """A copy of the run holding batch rows `rows` (repeats allowed), its counters carried over."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.protected.device)
        return dataclasses.replace(
            self,
            cache=self.cache.select_rows(index),
            cadence=self.cadence.select_rows(rows),
            **{name: getattr(self, name)[index] for name in Run.ROW_TENSORS},
            stats=dataclasses.replace(
                self.stats,
                step_seconds=list(self.stats.step_seconds),
                row_evictions=[self.stats.row_evictions[row] for row in rows],
            ),
        )

    ROW_TENSORS: ClassVar[tuple[str, ...]] = (
        "protected",
        "limits",
        "keep_counts",
        "first_eviction",
        "first_observed",
        "next_positions",
    )
