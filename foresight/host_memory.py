"""Host memory kept for reuse by the training loops.

glibc's malloc serves a block above its mmap threshold (at most 32 MiB) with a fresh mapping and unmaps
it when freed, and gives the top of its heap back to the OS past a trim threshold. A training step
allocates the same large tensors every step (a batch laid out per (layer, head) is ~100 MB for two
traces of the default model), so each step faults every page of them in again (`foresight bench pipeline`'s
fit rows measure the step with and without). With mmap off and
trimming past 2 GiB, freed blocks stay in the heap and the next step reuses them; the resident set
then holds the loop's peak for the rest of the process, which is what a training process keeps anyway.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1
"""mallopt's parameter numbers (malloc.h)."""
M_MMAP_MAX = -4
TRIM_THRESHOLD = 2**31 - 1
"""The largest trim threshold mallopt takes (an int): the heap's top is practically never given back."""
MALLOC_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed blocks for reuse (see the module docstring); whether it was set.

    Left alone where the user tuned malloc (a MALLOC_* variable above, or glibc.malloc tunables in
    GLIBC_TUNABLES) and where the C library is not glibc (no mallopt)."""
    if any(name in os.environ for name in MALLOC_VARIABLES) or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
