"""The set-up of a process that trains: host memory kept for reuse, third-party notices silenced.

Called by the `foresight` command before any verb and by the training CLIs (`python -m trainers.cli`). It
tunes the process, not the library, so it lives with the training stage rather than on the library's
ground floor.

Host memory: glibc's malloc serves a block above its mmap threshold (at most 32 MiB) with a fresh mapping
and unmaps it when freed, and gives the top of its heap back to the OS past a trim threshold. A training
step allocates the same large tensors every step (a batch laid out per (layer, head) is ~100 MB for two
traces of the default model), so each step faults every page of them in again (`foresight bench
pipeline`'s fit rows measure the step with and without). With mmap off and trimming past 2 GiB, freed
blocks stay in the heap and the next step reuses them; the resident set then holds the loop's peak for the
rest of the process, which is what a training process keeps anyway.

Notices: those of third-party libraries that say nothing about a run are silenced by name, so that a
verb's log shows its progress and results. The filters hold process-wide: a `warnings.catch_warnings`
block inside a verb restores them as they were when it began, these included. Only the messages named
here are dropped; any other warning, and every warning of this project's own calls, still shows.
"""

from __future__ import annotations

import ctypes
import logging
import os
import warnings

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


LIGHTNING_TIP = "💡 Tip:"
"""How Lightning's advertisement of its cloud logger begins (an INFO line at every Trainer's start)."""


class _NoTips(logging.Filter):
    """Drops Lightning's tip lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(LIGHTNING_TIP)


_NO_TIPS = _NoTips()


def quiet_third_party_notices() -> None:
    """Silence Lightning's litlogger tip, torch's `LeafSpec` deprecation (a FutureWarning raised by
    Lightning's own pytree helper at every training step's first batch), Lightning's notice that manual
    optimisation checkpoints hold the weights after the step, and jsonargparse's deprecations
    of LightningCLI's calls (off through its documented switch, unless the user set it)."""
    os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    # The reinforcement stage optimises by hand and saves after each step on purpose: a checkpoint holds the
    # weights its step made, and resuming from it runs the next step (tests/test_rl.py resumes to the same weights).
    warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization and every_n_train_steps")
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_NO_TIPS)
