"""Benchmarks of the eviction runtime and of the pipeline's stages, each written to its own section of a
markdown report (runs/bench/BENCHMARK.md unless --out says otherwise) with the command that made it,
every figure of a table from one run on one machine.

Every module of foresight/bench that defines NAME, a frozen `Settings` dataclass and `run(settings) -> str`
is a benchmark: its docstring is the help, the fields of its settings are the options
(`foresight.bench.options`). Every benchmark takes --out and --section (`foresight.bench.common.ReportSettings`,
whose subclasses also know the command that reproduces them). `--model` also takes an architecture config
(configs/models/*.json) where a benchmark's speed and memory depend on the model's shape alone (random
weights).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from types import ModuleType

import torch

import foresight.bench
from foresight.bench.common import ReportSettings, default_report
from foresight.commands._grammar import add_options, settings_from
from foresight.eval.report import write_section


def benchmarks() -> dict[str, ModuleType]:
    """{NAME: module} of every benchmark module of foresight.bench, found as the verbs are."""
    found = {}
    for info in pkgutil.iter_modules(foresight.bench.__path__):
        module = importlib.import_module(f"foresight.bench.{info.name}")
        if all(hasattr(module, name) for name in ("NAME", "Settings", "run")):
            found[module.NAME] = module
    return dict(sorted(found.items()))


MOVED_TO_STUDIES = ("ablation", "baselines", "rl-heldout", "rl-signal", "rl-step", "rl-window")
"""Research studies that were benchmarks: `python -m studies NAME` runs them (the studies/ folder)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    subparsers = parser.add_subparsers(dest="what", required=True, metavar="BENCHMARK")
    for name, module in benchmarks().items():
        add_benchmark(subparsers, name, module, parser.formatter_class)
    for name in MOVED_TO_STUDIES:  # the old spelling answers with the new one, whatever follows it
        sub = subparsers.add_parser(name, add_help=False, prefix_chars="\0")  # every word after it is taken
        sub.add_argument("rest", nargs="*")
        sub.set_defaults(moved=name)


def add_benchmark(subparsers, name: str, module: ModuleType, formatter_class) -> argparse.ArgumentParser:
    """The sub-command of one benchmark (or study) module: its docstring as help, its settings as options."""
    doc = module.__doc__
    sub = subparsers.add_parser(name, help=doc.splitlines()[0], description=doc, formatter_class=formatter_class)
    add_options(sub, module.Settings)
    if not issubclass(module.Settings, ReportSettings):  # the verb writes the report all the same
        add_options(sub, ReportSettings)
    sub.set_defaults(benchmark=module)
    return sub


def section(module: ModuleType, settings, given: str | None) -> str:
    """The report section a run rewrites: --section, the benchmark's own `section(settings)`, or
    NAME-DEVICE (NAME for a benchmark that runs no model of its own)."""
    if given:
        return given
    if hasattr(module, "section"):
        return module.section(settings)
    device = getattr(settings, "run_device", None)
    return module.NAME if device is None else f"{module.NAME}-{torch.device(device).type}"


def run(args: argparse.Namespace) -> int:
    """Read the options into the benchmark's settings, run it, and rewrite its section of the report."""
    if getattr(args, "moved", None):
        raise ValueError(
            f"`foresight bench {args.moved}` is a study now: run `python -m studies {args.moved}` (studies/README.md)"
        )
    module = args.benchmark
    settings = settings_from(module.Settings, args)
    report = module.run(settings)
    out = args.out or default_report(module)
    write_section(out, section(module, settings, args.section), report)
    print(report)
    print(f"wrote the {module.NAME} section of {out}")
    return 0
