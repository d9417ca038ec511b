"""The command line of `foresight bench`: how a benchmark of foresight.bench is offered as a sub-command
(`BenchCommand`), what the options shared by several read, and the runtime benchmarks' own options
(decode, memory, capacity, serve) turned into their settings. The benchmarks never see a Namespace."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from foresight.bench import capacity, decode, memory, serve
from foresight.bench.kvpress_worker import PRESSES
from foresight.commands._model import add_model_arguments, model_options
from foresight.commands._policy import add_cadence_arguments, add_policies_argument, int_list, selected_policies

REPORT = Path("docs/benchmarks.md")
ALL_BENCHABLE = "every policy that needs no labels or scorer; full is always included"


@dataclass(frozen=True)
class BenchCommand:
    """A benchmark as a sub-command: `module` (foresight.bench.*) has NAME, a docstring (the help) and
    `run(settings) -> str` (the report's markdown section); `settings` makes those settings of the parsed
    options and `section` names the report section rewritten when --section is not given."""

    module: ModuleType
    add_arguments: Callable[[argparse.ArgumentParser], None]
    settings: Callable[[argparse.Namespace], Any]
    section: Callable[[Any], str]


def add_report_arguments(
    parser: argparse.ArgumentParser, section: str, out_help: str = "markdown report whose section is rewritten"
) -> None:
    """--out and --section; `section` says what the section defaults to."""
    parser.add_argument("--out", type=Path, default=REPORT, help=out_help)
    parser.add_argument("--section", default=None, help=f"name of the report section to rewrite (default: {section})")


def report_flags(args: argparse.Namespace) -> str:
    """The --out and --section of a report's command."""
    return f"--out {shlex.quote(str(args.out))}" + (f" --section {args.section}" if args.section else "")


def placement_flags(args: argparse.Namespace) -> str:
    """The --device and --dtype of a report's command, as given (`auto` included)."""
    return f"--device {args.device} --dtype {args.dtype}"


def device_kind(settings: Any) -> str:
    """cpu, cuda or mps: the device part of a default section name."""
    return torch.device(settings.device).type


def add_runtime_arguments(parser: argparse.ArgumentParser, budget: int, interval: int) -> None:
    """The model (an architecture config too), the policies, the cadence and the report."""
    add_model_arguments(parser, device="auto", dtype="auto", architecture_configs=True)
    add_policies_argument(parser, ALL_BENCHABLE)
    add_cadence_arguments(parser, budget=budget, interval=interval)
    add_report_arguments(parser, "per benchmark and device")


def runtime_settings(args: argparse.Namespace, verb: str, *extra: str, tail: tuple[str, ...] = ()) -> dict[str, Any]:
    """The `BenchSettings` fields of the shared options (the policies checked before any model loads)."""
    return dict(model=args.model, **model_options(args), policies=selected_policies(args.policies), budget=args.budget,
                interval=args.interval, command=command_line(verb, args, *extra, tail=tail))


def command_line(verb: str, args: argparse.Namespace, *extra: str, tail: tuple[str, ...] = ()) -> str:
    """The `foresight bench` command that reproduces a runtime benchmark's report (`tail` after --dtype)."""
    parts = [f"foresight bench {verb} --model {args.model} --policies {args.policies} --budget {args.budget}",
             f"--interval {args.interval}", *extra, placement_flags(args), *tail, report_flags(args)]
    return " ".join(parts)


def _add_decode(parser: argparse.ArgumentParser) -> None:
    add_runtime_arguments(parser, budget=256, interval=64)
    parser.add_argument("--max-new-tokens", type=int, default=2048, help="tokens decoded per policy and batch size")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 8], help="comma-separated batch sizes")


def _decode_settings(args: argparse.Namespace) -> decode.DecodeSettings:
    batch_sizes = ",".join(map(str, args.batch_sizes))
    extra = f"--max-new-tokens {args.max_new_tokens} --batch-sizes {batch_sizes}"
    return decode.DecodeSettings(**runtime_settings(args, decode.NAME, extra), max_new_tokens=args.max_new_tokens,
                                 batch_sizes=args.batch_sizes)


def _add_memory(parser: argparse.ArgumentParser) -> None:
    add_runtime_arguments(parser, budget=256, interval=64)
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="tokens decoded per policy (EOS ignored)")
    parser.add_argument("--batch-size", type=int, default=4, help="rows decoded together")


def _memory_settings(args: argparse.Namespace) -> memory.MemorySettings:
    extra = f"--max-new-tokens {args.max_new_tokens} --batch-size {args.batch_size}"
    return memory.MemorySettings(**runtime_settings(args, memory.NAME, extra), max_new_tokens=args.max_new_tokens,
                                 batch_size=args.batch_size)


def _add_capacity(parser: argparse.ArgumentParser) -> None:
    add_runtime_arguments(parser, budget=1024, interval=256)
    parser.add_argument("--lengths", default="8192,16384,32768", help="comma-separated generation lengths T")
    parser.add_argument("--memory-fraction", type=float, default=0.9, help="share of the GPU's memory a run may take")
    parser.add_argument("--probe-tokens", type=int, default=16, help="decode steps of a full-cache memory probe")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds a throughput run may decode (None: all T)")


def _capacity_settings(args: argparse.Namespace) -> capacity.CapacitySettings:
    extra = f"--lengths {args.lengths} --memory-fraction {args.memory_fraction} --probe-tokens {args.probe_tokens}"
    if args.time_limit is not None:
        extra += f" --time-limit {args.time_limit}"
    return capacity.CapacitySettings(
        **runtime_settings(args, capacity.NAME, extra), lengths=[int(text) for text in args.lengths.split(",")],
        memory_fraction=args.memory_fraction, probe_tokens=args.probe_tokens, time_limit=args.time_limit,
    )


def _add_serve(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, device="auto", dtype="auto")
    add_policies_argument(parser, ALL_BENCHABLE)
    add_cadence_arguments(parser, budget=256, interval=64)
    parser.add_argument(
        "--kv-memory", required=True, metavar="SIZE|FRACTION",
        help="the KV-memory cap: a size such as 512MiB or 2GiB, or a fraction of the free memory such as 0.5",
    )
    parser.add_argument("--lengths", type=int_list, default="1024,2048,4096", help="generation lengths (new tokens), comma-separated")
    parser.add_argument(
        "--kvpress-python", default=None, metavar="PYTHON",
        help="the python of an environment with kvpress (e.g. .venv-kvpress/bin/python, made by scripts/crosscheck.sh): "
        f"also run kvpress's DecodingPress for the policies it has ({', '.join(PRESSES)})",
    )
    add_report_arguments(parser, "serve-DEVICE", out_help="markdown report whose serve section is rewritten")
    parser.add_argument("--results", type=Path, default=None, help="also write every run as JSON to this file")


def _serve_settings(args: argparse.Namespace) -> serve.ServeSettings:
    extra = f"--kv-memory {args.kv_memory} --lengths {','.join(map(str, args.lengths))}"
    tail = (f"--kvpress-python {shlex.quote(args.kvpress_python)}",) if args.kvpress_python else ()
    return serve.ServeSettings(
        **runtime_settings(args, serve.NAME, extra, tail=tail), kv_memory=args.kv_memory, lengths=args.lengths,
        kvpress_python=args.kvpress_python, results=args.results,
    )


RUNTIME_BENCHMARKS = (
    BenchCommand(decode, _add_decode, _decode_settings, lambda settings: f"decode-{settings.device}"),
    BenchCommand(memory, _add_memory, _memory_settings, lambda settings: f"memory-{settings.device}"),
    BenchCommand(capacity, _add_capacity, _capacity_settings, lambda settings: "capacity-cuda"),
    BenchCommand(serve, _add_serve, _serve_settings, lambda settings: f"serve-{device_kind(settings)}"),
)
