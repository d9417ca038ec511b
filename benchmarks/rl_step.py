"""Throughput of the reinforcement stage: rollout eviction steps per second and the share of an RL step
spent in the frozen model's forward passes.

Runs `foresight rl` (configs/default-rl.yaml: the default model, B = 128, L = 32, G = 8) for a few
optimisation steps of one trace each from the shipped supervised scorer, in a scratch folder, and
reports what the module logs at every step: eviction steps per second of a rollout group (each step
evicts in all layers and KV heads of all G rows), and forward seconds / step seconds (the rest is
block attention, features, scoring and sampling at evictions, and the scorer's update).

    python benchmarks/rl_step.py --traces runs/rl-default/traces --steps 2
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from foresight import cli
from foresight.report import write_section

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "docs" / "benchmarks.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, required=True, help="traces of the default model (`foresight traces`)")
    parser.add_argument("--scorer", default=str(REPO / "checkpoints" / "default"), help="supervised scorer to start from")
    parser.add_argument("--steps", type=int, default=2, help="optimisation steps, one trace each")
    parser.add_argument("--group-size", type=int, default=8, help="G")
    parser.add_argument("--section", default="rl-step-cpu", help="section of docs/benchmarks.md to rewrite")
    args = parser.parse_args()
    from lightning.pytorch.callbacks import Callback

    class Figures(Callback):
        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            metrics = trainer.callback_metrics
            self.steps.append({name: float(metrics[f"train/{name}"]) for name in ("steps_per_second", "forward_share")})
            self.steps[-1]["tokens"] = sum(trace.input_ids.numel() for trace in batch)

    from trainers.cli import rl_cli_main
    from foresight.commands.rl import lightning_args

    figures = Figures()
    with tempfile.TemporaryDirectory() as scratch:
        argv = ["rl", "--config", str(REPO / "configs" / "default-rl.yaml"), "--scorer", args.scorer, "--out", scratch,
                "--traces", str(args.traces), "--set", f"trainer.max_steps={args.steps}", "--set", "data.batch_size=1",
                "--set", f"model.group_size={args.group_size}", "--set", "trainer.enable_progress_bar=false",
                "--set", "trainer.logger=false"]
        built = rl_cli_main(lightning_args(cli.build_parser().parse_args(argv))[1:], run=False)
        built.trainer.callbacks.append(figures)
        started = time.perf_counter()
        built.trainer.fit(built.model, datamodule=built.datamodule)
        seconds = time.perf_counter() - started
    rates = [step["steps_per_second"] for step in figures.steps]
    shares = [step["forward_share"] for step in figures.steps]
    threads = torch.get_num_threads()
    report = "\n".join([
        "### Reinforcement stage throughput (cpu)", "",
        f"Command: `python benchmarks/rl_step.py --traces {args.traces} --steps {args.steps}` "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {threads} torch thread(s))", "",
        f"Default model, B = 128, L = 32, G = {args.group_size} rollouts of one trace per optimisation step, from the "
        f"shipped supervised scorer; {args.steps} steps in {seconds:.0f} s (model load included).", "",
        "| step | trace tokens | eviction steps / s (group of G) | frozen-model forward share of the RL step |",
        "|---:|---:|---:|---:|",
        *(f"| {i + 1} | {step['tokens']} | {step['steps_per_second']:.2f} | {step['forward_share']:.1%} |"
          for i, step in enumerate(figures.steps)),
        f"| mean | | {sum(rates) / len(rates):.2f} | {sum(shares) / len(shares):.1%} |",
    ])
    print(report)
    write_section(REPORT, args.section, report)


if __name__ == "__main__":
    main()
