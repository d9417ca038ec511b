"""Counting the operations a piece of code runs on its tensors' device.

On a GPU every operation that computes something (not a view) launches at least one kernel, and a step
of many small kernels is bound by their launch cost rather than by the device. `DeviceOps` counts those
operations on any device (a dispatch mode sees every aten operation), so a CPU run counts the launches a
GPU run would make. The eviction engine runs each eviction step inside an optional observer
(`EvictionEngine.step_observer`); a `DeviceOps` there counts the step's operations.
"""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class DeviceOps(TorchDispatchMode):
    """A dispatch mode counting the operations that are not views while it is entered (re-enterable)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _is_view(func):
            self.total += 1
        return func(*args, **(kwargs or {}))


def _is_view(func) -> bool:
    """An operation whose outputs alias an input and that writes nothing: metadata only, no kernel."""
    schema = func._schema
    return not schema.is_mutable and any(result.alias_info is not None for result in schema.returns)
