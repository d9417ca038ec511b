"""Memory of this process on a device, for benchmarks: what it holds now and its peak since a reset.

CUDA: PyTorch's caching allocator (`torch.cuda.memory_allocated`, `max_memory_allocated`). CPU: the C
heap in use (glibc's `mallinfo2`: bytes in allocated chunks, mmapped ones included), which is where
PyTorch's CPU tensors live, and the resident-set size with its high-water mark (Linux VmRSS, VmHWM;
the mark is reset through /proc/self/clear_refs).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def held_bytes(device: str) -> int:
    """Bytes the process holds in tensors' memory now: CUDA allocations, or the C heap in use."""
    if device.startswith("cuda"):
        return torch.cuda.memory_allocated()
    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def reset_peak(device: str) -> None:
    """Start a new peak: the CUDA allocator's, or the resident set's high-water mark."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")


def peak_bytes(device: str) -> int:
    """Peak since `reset_peak`: CUDA allocations, or the resident set (VmHWM)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _status_bytes("VmHWM")


def resident_bytes(device: str) -> int:
    """What `peak_bytes` measures, now: CUDA allocations, or the resident set (VmRSS)."""
    return torch.cuda.memory_allocated() if device.startswith("cuda") else _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    """A memory line of /proc/self/status (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line")
