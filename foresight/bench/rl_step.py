"""Throughput of the reinforcement stage: rollout eviction steps and forward tokens per second, forward share.

Runs `foresight rl` (configs/default-rl.yaml: the default model, B = 128, L = 32, G = 8) for a few
optimisation steps of one trace each from the shipped supervised scorer, in a scratch folder, once per
rollout kind asked (`model.rollout`: the paper's episodes, step-level branch groups), on the same traces
in the same order, and reports what the module logs at every step: eviction steps per second of a
rollout group (each step evicts in all layers and KV heads of all its rows), tokens the frozen model was
fed per second of rollout (row by row), and forward seconds / step seconds: the share of an RL step
spent in the frozen model's forward passes (the rest is block attention, features, scoring and sampling
at evictions, and the scorer's update).

    foresight bench rl-step --traces runs/rl-default/traces --steps 2 --rollouts episode,branch
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from foresight.bench.common import threads_note

NAME = "rl-step"


@dataclass(frozen=True, kw_only=True)
class RlStepSettings:
    """`lightning_args(scratch, rollout)`: the reinforcement LightningCLI's arguments (no subcommand) of a
    `foresight rl` run of `steps` optimisation steps, one trace each, with episode groups of `group_size`
    or the branch groups `branches` describes (for the report), rolled out as `rollout`, writing under the
    folder `scratch`; `rollouts`: the kinds to time, one run each; `device` names where it runs."""

    lightning_args: Callable[[Path, str], list[str]]
    steps: int
    group_size: int
    device: str
    command: str
    rollouts: tuple[str, ...] = ("episode",)
    branches: str = ""


def run(settings: RlStepSettings) -> str:
    """Run the stage for a few steps, noting the module's figures at each; the report's markdown section."""
    from lightning.pytorch.callbacks import Callback  # Lightning is imported only when the stage runs

    from trainers.cli import rl_cli_main

    class Figures(Callback):
        names = ("steps_per_second", "forward_share", "tokens_per_second")

        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            metrics = trainer.callback_metrics
            self.steps.append({name: float(metrics[f"train/{name}"]) for name in self.names})
            self.steps[-1]["tokens"] = sum(trace.input_ids.numel() for trace in batch)

    lines = [
        f"### Reinforcement stage throughput ({torch.device(settings.device).type})", "",
        f"Command: `{settings.command}` {threads_note()}", "",
        f"Default model, B = 128, L = 32, one trace per optimisation step, from the shipped supervised scorer; "
        f"episodes: G = {settings.group_size} rollouts sampling every step; branch: {settings.branches or 'not run'}.", "",
        "| rollouts | step | trace tokens | tokens fed / s (rows × tokens) | eviction steps / s | forward share of the RL step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for rollout in settings.rollouts:
        figures = Figures()
        with tempfile.TemporaryDirectory() as scratch:
            built = rl_cli_main(settings.lightning_args(Path(scratch), rollout), run=False)
            built.trainer.callbacks.append(figures)
            started = time.perf_counter()
            built.trainer.fit(built.model, datamodule=built.datamodule)
            seconds = time.perf_counter() - started
        lines += [
            f"| {rollout} | {i + 1} | {step['tokens']} | {step['tokens_per_second']:.0f} | {step['steps_per_second']:.2f} | "
            f"{step['forward_share']:.1%} |"
            for i, step in enumerate(figures.steps)
        ]
        means = {name: sum(step[name] for step in figures.steps) / len(figures.steps) for name in figures.names}
        lines.append(
            f"| {rollout} | mean ({seconds:.0f} s in all, model load included) | | {means['tokens_per_second']:.0f} | "
            f"{means['steps_per_second']:.2f} | {means['forward_share']:.1%} |"
        )
    return "\n".join(lines)
