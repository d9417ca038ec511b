"""Checks of tensor values that do not stall an accelerator: an asynchronous device assert, so a hot loop
(the eviction step) never waits for a value to come back to the host only to validate it. On a GPU a
failed check surfaces at the next synchronisation; on a CPU at once, as a ValueError with its message."""

from __future__ import annotations

import torch


def require(condition: torch.Tensor, message: str) -> None:
    """Raise ValueError(`message`) unless the boolean scalar `condition` holds (asynchronously off the CPU)."""
    try:
        torch._assert_async(condition, message)
    except RuntimeError as error:  # raised here only where the check runs synchronously (a CPU tensor)
        raise ValueError(message) from error
