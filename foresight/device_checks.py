"""Checks of tensor values that do not stall an accelerator: an asynchronous device assert, so a hot loop
(the eviction step) never waits for a value to come back to the host only to validate it.

On a CPU a failed check raises at once, a ValueError with its message. On a GPU it is a device-side assert
that surfaces at the next synchronisation as a RuntimeError and leaves the CUDA context unusable, so it
guards what the runtime itself must hold (the cadence's counts, the sampler's inputs from the engine);
input a user hands to a public function off the hot path is checked synchronously where it arrives."""

from __future__ import annotations

import torch


def require(condition: torch.Tensor, message: str) -> None:
    """Raise ValueError(`message`) unless the one-element `condition` holds (asynchronously off the CPU)."""
    if condition.numel() != 1:
        raise ValueError(f"a check takes a one-element condition, got shape {tuple(condition.shape)}")
    try:
        torch._assert_async(condition, message)
    except RuntimeError as error:  # a failed check on a CPU tensor, raised here at once
        raise ValueError(message) from error
