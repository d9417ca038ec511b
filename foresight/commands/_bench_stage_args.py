"""The options of the benchmarks of the pipeline's stages (eval-prefix, labels-memory, paged-reclaim, rl-heldout,
rl-signal, rl-step, trace-generation, ablation) and their translation into the settings of foresight.bench.*, with the
command that reproduces each report."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from pathlib import Path

import torch

from foresight.bench import (
    ablation,
    baselines,
    eval_prefix,
    labels_memory,
    paged_reclaim,
    rl_heldout,
    rl_signal,
    rl_step,
    trace_generation,
)
from foresight.bench.common import dtype_name
from foresight.commands import rl
from foresight.commands.eval import policy_specs
from foresight.commands._bench_args import (
    BenchCommand,
    add_report_arguments,
    device_kind,
    placement_flags,
    report_flags,
)
from foresight.commands._model import add_model_arguments, add_placement_arguments, model_options
from foresight.commands._policy import add_cadence_arguments, add_policies_argument, add_row_options_argument, int_list
from foresight.eval.specs import resolve_policies
from foresight.models import DEFAULT_MODEL
from trainers.rollouts import Rollout

RL_CONFIG = Path("configs/default-rl.yaml")  # the default model, B = 128, L = 32, G = 8, on CPU
SHIPPED_SCORER = "checkpoints/default"


def _add_eval_prefix(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", type=Path, required=True, help="a traces folder with labels at each budget")
    parser.add_argument("--holdout", type=float, default=0.25, help="evaluate this held-out share (as `foresight eval`)")
    add_policies_argument(parser, "every registered policy that can run; golden where labels exist")
    add_cadence_arguments(parser, budget=[128, 256], interval=32, several_budgets=True)
    add_placement_arguments(parser)
    add_report_arguments(parser, "eval-prefix-DEVICE")


def _eval_prefix_settings(args: argparse.Namespace) -> eval_prefix.EvalPrefixSettings:
    specs, _ = resolve_policies(args.policies)
    command = (
        f"foresight bench eval-prefix --traces {args.traces} --holdout {args.holdout} --policies {args.policies} "
        f"--budgets {','.join(map(str, args.budgets))} --interval {args.interval} {placement_flags(args)} {report_flags(args)}"
    )
    return eval_prefix.EvalPrefixSettings(traces=args.traces, holdout=args.holdout, specs=specs, budgets=args.budgets,
                                          interval=args.interval, **model_options(args), command=command)


def _add_labels_memory(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, architecture_configs=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096], help="trace lengths T")
    add_cadence_arguments(parser, budget=128, interval=32)
    add_report_arguments(parser, "labels-memory-DEVICE, or labels-memory-CONFIG-DEVICE for an architecture config or folder")


def _labels_memory_settings(args: argparse.Namespace) -> labels_memory.LabelsMemorySettings:
    command = (
        f"foresight bench labels-memory --model {args.model} --lengths {' '.join(map(str, args.lengths))} "
        f"--budget {args.budget} --interval {args.interval} {placement_flags(args)} {report_flags(args)}"
    )
    return labels_memory.LabelsMemorySettings(model=args.model, **model_options(args), lengths=args.lengths,
                                              budget=args.budget, interval=args.interval, command=command)


def _labels_memory_section(settings: labels_memory.LabelsMemorySettings) -> str:
    name = "" if settings.model == DEFAULT_MODEL else "-" + Path(settings.model).stem
    return f"labels-memory{name}-{settings.device}"


def _add_paged_reclaim(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", type=Path, required=True, help="traces folder (`foresight traces`), labels where golden runs")
    parser.add_argument("--holdout", type=float, default=None,
                        help="replay only the held-out split of this share, as `foresight eval` (default: every trace)")
    add_policies_argument(parser, "every registered policy that evicts; golden where labels exist, foresight with --scorer")
    parser.add_argument(
        "--scorer", action="append", default=[], metavar="DIR",
        help="a trained scorer folder (or Hub id, or NAME=DIR) replayed as the learned `foresight` policy at the B and L "
        "it was trained for; repeat for several",
    )
    add_row_options_argument(parser)
    add_cadence_arguments(parser, budget=[128, 256], interval=32, several_budgets=True)
    parser.add_argument("--page-sizes", type=int_list, default=[16, 32, 64], help="page sizes P (positions per page), comma-separated")
    add_placement_arguments(parser)
    add_report_arguments(parser, "paged-reclaim")
    parser.add_argument("--plot", type=Path, default=None,
                        help="PNG of the reclaimed share against page size (default: SECTION.png beside --out)")


def _paged_reclaim_settings(args: argparse.Namespace) -> paged_reclaim.PagedReclaimSettings:
    specs, notes = policy_specs(args.policies, args.scorer, args.option)
    plot = args.plot or args.out.parent / f"{args.section or paged_reclaim.NAME}.png"
    command = (
        f"foresight bench paged-reclaim --traces {args.traces}"
        + (f" --holdout {args.holdout}" if args.holdout is not None else "")
        + f" --policies {args.policies}" + "".join(f" -o {shlex.quote(option)}" for option in args.option)
        + "".join(f" --scorer {shlex.quote(source)}" for source in args.scorer)
        + f" --budgets {','.join(map(str, args.budgets))} --interval {args.interval}"
        + f" --page-sizes {','.join(map(str, args.page_sizes))} {placement_flags(args)} --plot {shlex.quote(str(plot))}"
        + f" {report_flags(args)}"
    )
    return paged_reclaim.PagedReclaimSettings(
        traces=args.traces, holdout=args.holdout, specs=specs, notes=notes, budgets=args.budgets, interval=args.interval,
        page_sizes=args.page_sizes, **model_options(args), plot=plot, command=command,
    )


def _add_rl_heldout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", type=Path, required=True, help="traces folder (`foresight traces`)")
    parser.add_argument("--holdout", type=float, default=None,
                        help="evaluate the held-out split of this share (the one both training stages left out)")
    parser.add_argument("--exclude", default=None, help="comma-separated trace indices to leave out (traces a stage trained on)")
    parser.add_argument("--holdout-seed", type=int, default=0, help="seed of the held-out split")
    parser.add_argument("--scorer", action="append", required=True, metavar="NAME=DIR",
                        help="exactly two: the supervised scorer first, then the reinforced one")
    parser.add_argument("--batch-size", type=int, default=4, help="traces replayed together")
    parser.add_argument("--resamples", type=int, default=10000, help="bootstrap resamples")
    parser.add_argument("--sampled-seeds", type=int, default=0, metavar="N",
                        help="also compare the sampled policies (Eq. 2), each trace's figures the mean of N seeded replays")
    parser.add_argument("--sample-temperature", type=float, default=1.0, metavar="T",
                        help="τ of the sampled policies (the rollouts' model.temperature)")
    add_placement_arguments(parser)
    add_report_arguments(parser, "rl-heldout-DEVICE")
    parser.add_argument("--results", type=Path, default=None, help="also write the per-trace figures as JSON to this file")


def _rl_heldout_settings(args: argparse.Namespace) -> rl_heldout.RlHeldoutSettings:
    if len(args.scorer) != 2 or not all("=" in text for text in args.scorer):
        raise ValueError("give exactly two --scorer NAME=DIR: the supervised one, then the reinforced one")
    supervised, reinforced = (tuple(text.split("=", 1)) for text in args.scorer)
    if args.sampled_seeds < 0 or not 0 < args.sample_temperature < float("inf"):
        raise ValueError(
            f"--sampled-seeds must be at least 0 and --sample-temperature a finite number > 0, got "
            f"{args.sampled_seeds} and {args.sample_temperature}"
        )
    exclude = {int(index) for index in (args.exclude or "").split(",") if index.strip()}
    command = (
        f"foresight bench rl-heldout --traces {args.traces}"
        + (f" --holdout {args.holdout} --holdout-seed {args.holdout_seed}" if args.holdout is not None else "")
        + (f" --exclude {args.exclude}" if args.exclude else "")
        + "".join(f" --scorer {text}" for text in args.scorer)
        + f" --batch-size {args.batch_size} --resamples {args.resamples}"
        + (f" --sampled-seeds {args.sampled_seeds} --sample-temperature {args.sample_temperature}" if args.sampled_seeds else "")
        + f" {placement_flags(args)} {report_flags(args)}"
    )
    return rl_heldout.RlHeldoutSettings(
        traces=args.traces, scorers=(supervised, reinforced), holdout=args.holdout, holdout_seed=args.holdout_seed,
        exclude=exclude, batch_size=args.batch_size, resamples=args.resamples, **model_options(args),
        results=args.results, command=command, sampled_seeds=args.sampled_seeds, sample_temperature=args.sample_temperature,
    )


def _add_rl_step(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--traces", type=Path, required=True, help="traces of the default model (`foresight traces`)")
    parser.add_argument("--scorer", default=SHIPPED_SCORER, help="supervised scorer to start from")
    parser.add_argument("--steps", type=int, default=2, help="optimisation steps, one trace each")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per trace (G) of episodes")
    parser.add_argument("--rollouts", default="episode",
                        help="comma-separated rollout kinds to time on the same traces, one run each: episode, branch")
    parser.add_argument("--branch", nargs="*", default=[], metavar="NAME=VALUE",
                        help="branch-group settings of the branch run, e.g. branch_rows=8 branch_chunks=4 branch_steps=2 "
                        "branch_layers=null (default: configs/default-rl.yaml's)")
    add_placement_arguments(parser)
    add_report_arguments(parser, "rl-step-DEVICE")


def _rl_step_settings(args: argparse.Namespace) -> rl_step.RlStepSettings:
    options = model_options(args)
    overrides = [f"trainer.max_steps={args.steps}", "data.batch_size=1", f"model.group_size={args.group_size}",
                 "trainer.enable_progress_bar=false", "trainer.logger=false", *_trainer_placement(**options)]

    rollouts = tuple(kind.strip() for kind in args.rollouts.split(",") if kind.strip())
    for kind in rollouts:
        Rollout.parse(kind)
    branch = [f"model.{setting}" for setting in args.branch]

    def lightning_args(scratch: Path, rollout: str) -> list[str]:
        """Those of `foresight rl` on the default config rolling out as `rollout`, writing under `scratch` (no
        subcommand: not run)."""
        parser = argparse.ArgumentParser(prog="foresight rl")
        rl.add_arguments(parser)
        argv = ["--config", str(RL_CONFIG), "--scorer", args.scorer, "--out", str(scratch), "--traces", str(args.traces)]
        settings = [*overrides, f"model.rollout={rollout}", *(branch if rollout == Rollout.BRANCH.value else [])]
        return rl.lightning_args(parser.parse_args(argv + [item for text in settings for item in ("--set", text)]))[1:]

    command = (
        f"foresight bench rl-step --traces {args.traces} --scorer {args.scorer} --steps {args.steps} "
        f"--group-size {args.group_size} --rollouts {','.join(rollouts)}"
        + (f" --branch {' '.join(args.branch)}" if args.branch else "")
        + f" {placement_flags(args)} {report_flags(args)}"
    )
    return rl_step.RlStepSettings(lightning_args=lightning_args, steps=args.steps, group_size=args.group_size,
                                  device=options["device"], command=command, rollouts=rollouts,
                                  branches=", ".join(args.branch) or "configs/default-rl.yaml's settings")


def _trainer_placement(device: str, dtype: torch.dtype) -> list[str]:
    """Config overrides that run the stage's frozen model on `device` in `dtype` (Lightning calls CUDA "gpu")."""
    kind, _, index = device.partition(":")
    return [f"trainer.accelerator={'gpu' if kind == 'cuda' else kind}", f"trainer.devices={f'[{index}]' if index else 1}",
            f"model.dtype={dtype_name(dtype)}"]


def _add_rl_signal(parser: argparse.ArgumentParser) -> None:
    for item in dataclasses.fields(rl_signal.Settings):
        parser.add_argument(f"--{item.name.replace('_', '-')}", type=type(item.default), default=item.default,
                            help=f"{item.metadata['help']} (default: {item.default})")
    add_report_arguments(parser, rl_signal.NAME)


def _rl_signal_settings(args: argparse.Namespace) -> rl_signal.Settings:
    return rl_signal.Settings(**{item.name: getattr(args, item.name) for item in dataclasses.fields(rl_signal.Settings)})


def _add_trace_generation(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--prompts", default=trace_generation.SOURCES, help="prompt SOURCE (a mixture, so completion lengths vary)")
    parser.add_argument("--num", type=int, default=32, help="problems sampled by every mode")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="most new tokens of a completion")
    parser.add_argument("--batch-sizes", type=int_list, default="4,8,16", help="comma-separated b of the static and continuous modes")
    parser.add_argument("--hf", action="store_true", help="also time transformers' generate in static groups of b")
    add_report_arguments(parser, "trace-generation-DEVICE")


def _trace_generation_settings(args: argparse.Namespace) -> trace_generation.TraceGenerationSettings:
    command = (
        f"foresight bench trace-generation --model {args.model} --prompts {shlex.quote(args.prompts)} --num {args.num} "
        f"--max-new-tokens {args.max_new_tokens} --batch-sizes {','.join(map(str, args.batch_sizes))}"
        + (" --hf" if args.hf else "") + f" {placement_flags(args)} {report_flags(args)}"
    )
    return trace_generation.TraceGenerationSettings(
        model=args.model, **model_options(args), prompts=args.prompts, num=args.num, max_new_tokens=args.max_new_tokens,
        batch_sizes=args.batch_sizes, hf=args.hf, command=command,
    )


def _named(kind: str):
    """An argparse type for NAME=VALUE options (the value split on commas for --set)."""

    def parse(text: str) -> tuple[str, str]:
        name, sep, value = text.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise argparse.ArgumentTypeError(f"{text!r} must look like NAME={kind}")
        return name.strip(), value.strip()

    return parse


def _add_ablation(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set", dest="sets", action="append", required=True, type=_named("DIR,DIR,..."), metavar="NAME=DIR,...",
        help="a trace set and the `foresight eval` folders of its traces (repeat per set)",
    )
    parser.add_argument(
        "--learned", action="append", required=True, type=_named("WHAT"), metavar="ROW=WHAT",
        help="a learned scorer's row name in those folders and what it is (repeat; table order)",
    )
    parser.add_argument("--budget", "-B", type=int, default=128, help="the budget B compared")
    parser.add_argument(
        "--pool", default="", metavar="NAME,NAME,...",
        help="one more table with these sets' traces pooled as one set (paired intervals over all of them)",
    )
    add_report_arguments(parser, "ablation-B{budget}")


def _ablation_settings(args: argparse.Namespace) -> ablation.AblationSettings:
    sets = tuple((name, tuple(Path(folder) for folder in folders.split(","))) for name, folders in args.sets)
    flags = " ".join(
        [*(f"--set {shlex.quote(f'{n}={v}')}" for n, v in args.sets), *(f"--learned {shlex.quote(f'{n}={v}')}" for n, v in args.learned)]
    )
    pooled = tuple(name.strip() for name in args.pool.split(",") if name.strip())
    pool = f" --pool {shlex.quote(args.pool)}" if pooled else ""
    command = f"foresight bench ablation {flags} --budget {args.budget}{pool} {report_flags(args)}"
    return ablation.AblationSettings(sets=sets, learned=tuple(args.learned), budget=args.budget, command=command, pooled=pooled)


def _add_baselines(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set", dest="sets", action="append", required=True, type=_named("DIR,DIR,..."), metavar="NAME=DIR,...",
        help="a trace set and the `foresight eval` folders of its traces (repeat per set)",
    )
    parser.add_argument(
        "--learned", action="append", required=True, metavar="ROW",
        help="the learned scorer's row name in those folders; repeat for sets that name it otherwise (a set's "
        "learned row is the first of these it holds)",
    )
    parser.add_argument("--budgets", "-B", type=int_list, default=[128, 256], help="budgets B tabled, comma-separated")
    parser.add_argument("--plot-dir", type=Path, default=Path("docs"), help="folder of the PNGs, one per set")
    add_report_arguments(parser, "baselines")


def _baselines_settings(args: argparse.Namespace) -> baselines.BaselinesSettings:
    sets = tuple((name, tuple(Path(folder) for folder in folders.split(","))) for name, folders in args.sets)
    flags = " ".join(f"--set {shlex.quote(f'{n}={v}')}" for n, v in args.sets)
    command = (
        f"foresight bench baselines {flags} {' '.join(f'--learned {shlex.quote(row)}' for row in args.learned)} "
        f"--budgets {','.join(map(str, args.budgets))} "
        f"--plot-dir {shlex.quote(str(args.plot_dir))} {report_flags(args)}"
    )
    return baselines.BaselinesSettings(
        sets=sets, learned=tuple(args.learned), budgets=tuple(args.budgets), plot_dir=args.plot_dir, command=command
    )


STAGE_BENCHMARKS = (
    BenchCommand(eval_prefix, _add_eval_prefix, _eval_prefix_settings, lambda settings: f"eval-prefix-{device_kind(settings)}"),
    BenchCommand(labels_memory, _add_labels_memory, _labels_memory_settings, _labels_memory_section),
    BenchCommand(paged_reclaim, _add_paged_reclaim, _paged_reclaim_settings, lambda settings: paged_reclaim.NAME),
    BenchCommand(rl_heldout, _add_rl_heldout, _rl_heldout_settings, lambda settings: f"rl-heldout-{device_kind(settings)}"),
    BenchCommand(rl_signal, _add_rl_signal, _rl_signal_settings, lambda settings: rl_signal.NAME),
    BenchCommand(rl_step, _add_rl_step, _rl_step_settings, lambda settings: f"rl-step-{device_kind(settings)}"),
    BenchCommand(trace_generation, _add_trace_generation, _trace_generation_settings,
                 lambda settings: f"trace-generation-{device_kind(settings)}"),
    BenchCommand(ablation, _add_ablation, _ablation_settings, lambda settings: f"ablation-B{settings.budget}"),
    BenchCommand(baselines, _add_baselines, _baselines_settings, lambda settings: baselines.NAME),
)
