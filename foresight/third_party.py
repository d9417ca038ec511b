"""Notices of third-party libraries that say nothing about a run, silenced by name so that a verb's log
shows its progress and results.

Called by the `foresight` command before any verb and by the training CLIs (`python -m trainers.cli`), so
it holds process-wide: a `warnings.catch_warnings` block inside a verb restores the filters as they were
when it began, these included. Only the messages named here are dropped; any other warning, and every
warning of this project's own calls, still shows.
"""

from __future__ import annotations

import logging
import os
import warnings

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
