"""Throughput of the reinforcement stage: rollout eviction steps and forward tokens per second, forward share.

Runs `foresight rl` (configs/default-rl.yaml: the default model, B = 128, L = 32, G = 8) for a few
optimisation steps of one trace each from the shipped supervised scorer, in a scratch folder, once per
rollout kind asked (`model.rollout`: the paper's episodes, step-level branch groups), on the same traces
in the same order, and reports what the module logs at every step: eviction steps per second of a
rollout group (each step evicts in all layers and KV heads of all its rows), tokens the frozen model was
fed per second of rollout (row by row), and forward seconds / step seconds: the share of an RL step
spent in the frozen model's forward passes (the rest is block attention, features, scoring and sampling
at evictions, and the scorer's update).

    python -m studies rl-step --traces runs/rl-default/traces --steps 2 --rollout episode --rollout branch
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from foresight.bench.common import OneScorer, PlacedSettings, scorer_field, threads_note, traces_field
from foresight.models import dtype_name
from studies import COMMAND as COMMAND  # how its report names it, where it goes
from studies import REPORTS as REPORTS

NAME = "rl-step"
RL_CONFIG = Path("configs/default-rl.yaml")  # the default model, B = 128, L = 32, G = 8, on CPU


@dataclass(frozen=True, kw_only=True)
class Settings(OneScorer, PlacedSettings):
    traces: Path = traces_field("traces of the default model (`foresight traces`)")
    scorer: tuple[str, ...] = scorer_field("the supervised scorer to start from", ("checkpoints/default",))
    steps: int = field(default=2, metadata={"help": "optimisation steps, one trace each"})
    group_size: int = field(default=8, metadata={"help": "rollouts per trace (G) of episodes"})
    rollouts: tuple[str, ...] = field(
        default=("episode",),
        metadata={
            "help": "a rollout kind to time on the same traces, one run each: episode, branch (repeat for both)",
            "flags": ("--rollout",),
        },
    )
    branch: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "a branch-group setting of the branch run, NAME=VALUE (e.g. branch_rows=8; repeat; default: "
            "configs/default-rl.yaml's)"
        },
    )

    def lightning_args(self, scratch: Path, rollout: str = "episode") -> list[str]:
        """The reinforcement LightningCLI's arguments (no subcommand) of `foresight rl` on RL_CONFIG for
        `steps` steps of one trace each, groups of `group_size` (or the branch groups of `branch` when
        `rollout` is "branch"), on the device, writing under `scratch`."""
        if not self.traces.is_dir():
            raise ValueError(f"--traces {self.traces} is not a folder; make one with `foresight traces`")
        kind, _, index = self.run_device.partition(":")  # Lightning calls CUDA "gpu"
        return [
            f"--config={RL_CONFIG}",
            f"--trainer.default_root_dir={scratch}",
            f"--checkpoint.dirpath={scratch / 'checkpoints'}",
            f"--epoch_checkpoint.dirpath={scratch / 'checkpoints'}",
            f"--model.scorer={self.learned[1]}",
            f"--data.traces_dir={self.traces}",
            f"--trainer.max_steps={self.steps}",
            "--data.batch_size=1",
            f"--model.group_size={self.group_size}",
            "--trainer.enable_progress_bar=false",
            "--trainer.logger=false",
            f"--trainer.accelerator={'gpu' if kind == 'cuda' else kind}",
            f"--trainer.devices={f'[{index}]' if index else 1}",
            f"--model.dtype={dtype_name(self.run_dtype)}",
            *(
                (f"--model.rollout={rollout}", *(f"--model.{setting}" for setting in self.branch))
                if rollout == "branch"
                else ()
            ),
        ]


def run(settings: Settings) -> str:
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
        f"### Reinforcement stage throughput ({torch.device(settings.run_device).type})",
        "",
        f"Command: `{settings.command}` {threads_note()}",
        "",
        f"Default model, B = 128, L = 32, one trace per optimisation step, from the shipped supervised scorer; "
        f"episodes: G = {settings.group_size} rollouts sampling every step; branch: {', '.join(settings.branch) or 'configs/default-rl.yaml settings' if 'branch' in settings.rollouts else 'not run'}.",
        "",
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
