"""Timing regions of work as the device runs them, without making the host wait inside the loop.

On a GPU the host only queues kernels: `time.perf_counter` around a region measures how long queueing
took, not how long the device worked, and synchronising at every edge would add the waits a loop of
small kernels is built to avoid. `DeviceClock` records a pair of CUDA events around each region on a
GPU and reads them all once, at `settle` (one synchronisation per run); on the host, where work runs as
it is called, it reads `time.perf_counter` and hands each region's seconds over at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

Mark = float | torch.cuda.Event


class DeviceClock:
    """Seconds of regions of work on `device`: `start()` a region, `stop(mark, into)` it; `into(seconds)`
    receives its seconds at once on the host, or at `settle()` on a GPU (in the order the regions stopped)."""

    def __init__(self, device: torch.device | str) -> None:
        self.events = torch.device(device).type == "cuda"
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event, Callable[[float], None]]] = []

    def start(self) -> Mark:
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, mark: Mark, into: Callable[[float], None]) -> None:
        if not self.events:
            into(time.perf_counter() - mark)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((mark, end, into))

    def settle(self) -> None:
        """Hand every stopped region its seconds (on a GPU: after waiting once for the last of them)."""
        if not self._pending:
            return
        self._pending[-1][1].synchronize()
        pending, self._pending = self._pending, []
        for start, end, into in pending:
            into(start.elapsed_time(end) / 1000)


def adding_to(counters: object, name: str) -> Callable[[float], None]:
    """A receiver of a region's seconds (`DeviceClock.stop`) that adds them to the attribute `name` of `counters`."""

    def add(seconds: float) -> None:
        setattr(counters, name, getattr(counters, name) + seconds)

    return add
