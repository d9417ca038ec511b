"""What the reinforcement stage's tests share: the tiny traces' cadence, a random trace with its full-cache
losses, Eq. 2's order probabilities by enumeration, a `foresight rl` config and command line for the tiny
model, and a callback that stops a run as a kill would."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import lightning as L
import torch
import yaml

from foresight.data.trace_generation import token_losses
from foresight.data.trace_store import Trace

B, L_ = 16, 4  # the cadence of the tiny traces (tests.test_trainer)


def random_trace(model, length: int, prompt: int = 5, seed: int = 0) -> Trace:
    ids = torch.randint(3, 120, (length,), generator=torch.Generator().manual_seed(seed))
    nll, entropy = token_losses(model, ids)
    return Trace(
        index=seed,
        source="tiny",
        input_ids=ids,
        prompt_length=prompt,
        token_nll=nll,
        token_entropy=entropy,
        answer=None,
        correct=None,
        prompt="",
        completion="",
    )


def enumerated_order_probabilities(scores: list[float], eligible: list[bool], draws: int) -> dict[tuple, float]:
    """P(order) of every ordered draw of `draws` eligible entries, by sequential softmax over the negated
    scores of the entries still available (the definition of Eq. 2's sampling without replacement)."""
    probabilities = {}
    for order in itertools.permutations([i for i in range(len(scores)) if eligible[i]], draws):
        available, probability = [i for i in range(len(scores)) if eligible[i]], 1.0
        for pick in order:
            weights = {i: math.exp(-scores[i]) for i in available}
            probability *= weights[pick] / sum(weights.values())
            available.remove(pick)
        probabilities[order] = probability
    return probabilities


def rl_config(path: Path, tiny_dir: Path, traces: Path, **sections) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 2,
            "log_every_n_steps": 1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
        },
        "model": {"group_size": 4, "lr": 0.01, "warm_up": 1, "beta": 0.05, "damage_threshold": 0.0},
        "data": {
            "model": str(tiny_dir),
            "traces_dir": str(traces),
            "budget": B,
            "interval": L_,
            "holdout": 0.2,
            "batch_size": 2,
        },
        "checkpoint": {},
    }
    for section, values in sections.items():
        config[section].update(values)
    path.write_text(yaml.safe_dump(config))
    return path


def rl_args(config: Path, scorer: Path, out: Path, *overrides: str) -> list[str]:
    return [
        "rl",
        "--config",
        str(config),
        "--scorer",
        str(scorer),
        "--out",
        str(out),
        *itertools.chain.from_iterable(("--set", item) for item in overrides),
    ]


class Killed(Exception):
    pass


class KillAtStep(L.Callback):
    """Stops a run as a kill would: before the batch after `step`, whose checkpoint is written."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise Killed
