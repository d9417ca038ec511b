"""Counting the tensor values a piece of code reads back to the host.

On a GPU each such read (`.item()`, `int(t)`, `bool(t)`, `.tolist()`, `.cpu()`, `nonzero`, ...) makes the
host wait for the device, which is what keeps a loop of small kernels host-bound. `HostReads` counts the
calls that read a value (or, like `nonzero`, size their output from one) on any device, so a CPU run
finds the reads a GPU run would synchronise on. The eviction engine runs each eviction step inside an
optional observer (`EvictionEngine.step_observer`); a `HostReads` there counts the step's reads.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

READS = frozenset(
    {
        "item",
        "tolist",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "cpu",
        "numpy",
        "equal",
        "allclose",
        "is_nonzero",
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "unique_consecutive",
        "repeat_interleave",
    }
)
"""Tensor functions that bring a device value to the host, or size their output from one."""
MASKED = frozenset({"__getitem__", "__setitem__"})
"""Indexing, which sizes its result from the host when the index is a boolean mask."""
COPIES = frozenset({"to", "copy_"})
"""Copies, which wait for the device when they cross between it and the host."""


class HostReads(TorchFunctionMode):
    """A torch function mode counting calls of `READS` by name while it is entered (re-enterable)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS or (name in MASKED and _is_mask(args[1])) or (name in COPIES and _crosses(name, args, kwargs)):
            self.counts[name] += 1
        return func(*args, **kwargs)


def _is_mask(index: object) -> bool:
    indices = index if isinstance(index, tuple) else (index,)
    return any(isinstance(item, torch.Tensor) and item.dtype == torch.bool for item in indices)


def _crosses(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a copy moves a tensor between two kinds of device (host and accelerator)."""
    source = args[0]
    if name == "copy_":
        return isinstance(args[1], torch.Tensor) and args[1].device.type != source.device.type
    device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
    return device is not None and device.type != source.device.type
