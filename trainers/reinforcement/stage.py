"""Refine a trained scorer with the reinforcement stage (GRPO, ForesightKV §3.3): the run behind `trainers.rl`
and `foresight rl`.

Runs the reinforcement LightningCLI of `trainers.cli` on a YAML config (configs/default-rl.yaml for the
embedded default on CPU), starting from `scorer` (a fitted scorer folder or a Hub id, trained for the
config's B and L), which is also the frozen KL reference. Every step rolls out each trace of a batch G times
with the scorer sampling its evictions, rewards low loss damage on low-entropy tokens, and takes a
clipped-ratio step. Everything goes under `out`: checkpoints/ (last.ckpt, resume with ckpt_path "last";
epoch-N.ckpt at the end of every epoch), lightning_logs/ (TensorBoard: reward, KL per (layer, KV head) set,
β, clip fraction, policy entropy, loss ratio, low-entropy damage) and scorer/ (a model card saying it is the
reinforcement stage and what it started from). Under a DDP strategy every process runs the same call; each
replays G / N rollouts of every trace.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from foresight.data.trace_store import folder_sources
from trainers.export import export_scorer, reported_metrics
from trainers.run_config import RunRequest, one_line_config_errors, override_args


@dataclass(frozen=True, kw_only=True)
class RLRequest(RunRequest):
    """One reinforcement run: a `RunRequest` and the scorer it starts from (a folder or Hub id), which is also
    its frozen KL reference; `regime` None runs the scorer's own."""

    scorer: str

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "scorer", str(self.scorer))


def lightning_args(request: RLRequest) -> list[str]:
    """The LightningCLI arguments of a reinforcement run."""
    cli_args = [
        "fit",
        *request.common_args(),
        f"--epoch_checkpoint.dirpath={request.out / 'checkpoints'}",
        f"--model.scorer={request.scorer}",
    ]
    if request.traces is not None:
        cli_args.append(f"--data.traces_dir={request.traces}")
    if request.regime is not None:
        cli_args.append(f"--model.regime={request.regime.value}")
    return cli_args + override_args(request.overrides, request.ckpt_path)


def refine_scorer(request: RLRequest) -> Path:
    """Run the reinforcement stage and export its scorer to out/scorer (on the process that exports)."""
    from trainers.cli import rl_cli_main  # Lightning is imported on the first run, not with the request

    with warnings.catch_warnings():  # LightningCLI warns when given args beside a command line: intended here
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        with one_line_config_errors():
            cli = rl_cli_main(lightning_args(request), exit_on_error=False)
    folder = request.out / "scorer"
    if not cli.trainer.is_global_zero:
        return folder
    module = cli.model
    config = module.scorer.config  # the sources of both stages: a reinforced scorer has seen its rollouts' traces
    config.training_sources = sorted({*config.training_sources, *folder_sources(cli.datamodule.traces_dir)})
    record = module.training_record()
    export_scorer(module.scorer, folder, training=record)
    metrics = ", ".join(f"{name} {value:.4f}" for name, value in reported_metrics(record).items())
    print(f"{folder}: scorer refined by GRPO for {module.global_step} steps from {request.scorer}; {metrics}")
    return folder
