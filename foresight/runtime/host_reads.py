"""Counting the tensor values a piece of code reads back to the host.

On a GPU each such read (`.item()`, `int(t)`, `bool(t)`, `.tolist()`, `.cpu()`, `nonzero`, ...) makes the
host wait for the device, which is what keeps a loop of small kernels host-bound. `HostReads` counts the
calls that read a value (or, like `nonzero`, size their output from one) on any device, so a CPU run
finds the reads a GPU run would synchronise on. The eviction engine runs each eviction step inside an
optional observer (`EvictionEngine.step_observer`); a `HostReads` there counts the step's reads.
"""

from __future__ import annotations

from collections import Counter

from torch.overrides import TorchFunctionMode

READS = frozenset(
    {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy",
     "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "repeat_interleave"}
)
"""Tensor functions that bring a device value to the host, or size their output from one."""


class HostReads(TorchFunctionMode):
    """A torch function mode counting calls of `READS` by name while it is entered (re-enterable)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))
