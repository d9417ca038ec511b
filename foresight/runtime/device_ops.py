"""Counting the operations a piece of code runs on its tensors' device.

On a GPU every operation that computes something (not a view) launches at least one kernel, and a step
of many small kernels is bound by their launch cost rather than by the device. `DeviceOps` counts those
operations on any device (a dispatch mode sees every aten operation), so a CPU run counts the launches a
GPU run would make. The eviction engine runs each eviction step inside an optional observer
(`EvictionEngine.step_observer`); a `DeviceOps` there counts the step's operations.
"""

from __future__ import annotations

import torch
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


class OpTrace(TorchDispatchMode):
    """A dispatch mode recording every operation while it is entered: its name, each tensor argument's shape,
    dtype and, for a tensor the traced code did not make, its address, and every other argument. Two runs of
    code a CUDA graph can replay give equal traces: a graph replays the same kernels on the same memory with the
    same scalars, so a shape, a Python number or an input tensor that changes between runs would be stale."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self._made: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = tuple(self._describe(value) for value in (*args, *kwargs.values()))
        result = func(*args, **kwargs)
        self.ops.append((str(func), inputs))
        for value in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(value, torch.Tensor):
                self._made.add(value.data_ptr())
        return result

    def _describe(self, value):
        if isinstance(value, torch.Tensor):
            address = None if value.data_ptr() in self._made else value.data_ptr()
            return (tuple(value.shape), value.dtype, address)
        if isinstance(value, (tuple, list)):
            return tuple(self._describe(item) for item in value)
        return value
