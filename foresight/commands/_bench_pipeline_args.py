"""The options of `foresight bench pipeline` and their translation into `foresight.bench.pipeline`'s settings,
with the command that reproduces the report."""

from __future__ import annotations

import argparse
from pathlib import Path

from foresight.bench import pipeline
from foresight.commands._bench_args import (
    BenchCommand,
    add_report_arguments,
    device_kind,
    placement_flags,
    report_flags,
)
from foresight.commands._model import add_placement_arguments, model_options
from foresight.commands._policy import add_cadence_arguments
from foresight.eval.specs import resolve_policies


def _add_pipeline(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", type=Path, required=True,
                        help="a traces folder with its golden labels at -B and -L (`foresight labels`)")
    add_cadence_arguments(parser, budget=128, interval=32)
    parser.add_argument("--policy", default="snapkv", help="the policy the eval stage replays")
    parser.add_argument("--fit-steps", type=int, default=20, help="optimisation steps of each fit run (at least 2)")
    parser.add_argument("--batch-size", type=int, default=2, help="traces per optimisation step of the fit, and per replay in the packed rl rollouts row")
    parser.add_argument("--group-size", type=int, default=4, help="rollouts of each trace (G)")
    add_placement_arguments(parser)
    add_report_arguments(parser, "pipeline-DEVICE")


def _pipeline_settings(args: argparse.Namespace) -> pipeline.PipelineSettings:
    (policy,), _ = resolve_policies(args.policy)
    if not policy.evicts:
        raise ValueError(f"--policy {args.policy!r} evicts nothing; the eval stage needs one that does, e.g. snapkv")
    for name, value, least in (("--fit-steps", args.fit_steps, 2), ("--batch-size", args.batch_size, 1),
                               ("--group-size", args.group_size, 1)):
        if value < least:
            raise ValueError(f"{name} {value} must be at least {least}")
    command = (
        f"foresight bench pipeline --traces {args.traces} --budget {args.budget} --interval {args.interval} "
        f"--policy {args.policy} --fit-steps {args.fit_steps} --batch-size {args.batch_size} "
        f"--group-size {args.group_size} {placement_flags(args)} {report_flags(args)}"
    )
    return pipeline.PipelineSettings(
        traces=args.traces, budget=args.budget, interval=args.interval, policy=policy, fit_steps=args.fit_steps,
        batch_size=args.batch_size, group_size=args.group_size, **model_options(args), command=command,
    )


PIPELINE_BENCHMARKS = (
    BenchCommand(pipeline, _add_pipeline, _pipeline_settings, lambda settings: f"pipeline-{device_kind(settings)}"),
)
