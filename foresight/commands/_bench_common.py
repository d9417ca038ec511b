"""What every `foresight bench` benchmark shares: the model and its dtype, the prompt, the policies,
the budget, and a line naming the machine."""

from __future__ import annotations

import argparse
import platform
import shlex
from pathlib import Path

import torch

from foresight.commands._model import add_model_arguments, model_options
from foresight.commands._policy import add_cadence_arguments, add_policies_argument
from foresight.models import load_for_benchmark
from foresight.runtime.engine import EvictionConfig
from foresight.tasks import chat_prompt_ids

PROMPT = "Solve step by step: a train leaves at 9:40 and travels 3 hours 35 minutes. When does it arrive?"


def add_common_arguments(parser: argparse.ArgumentParser, budget: int, interval: int) -> None:
    add_model_arguments(parser, device="auto", dtype="auto", architecture_configs=True)
    add_policies_argument(parser, "every policy that needs no labels or scorer; full is always included")
    add_cadence_arguments(parser, budget=budget, interval=interval)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"), help="markdown report whose section is rewritten")
    parser.add_argument("--section", default=None, help="name of the report section to rewrite (default: per benchmark and device)")


def benchmark_device(args: argparse.Namespace) -> str:
    """The device --device names, `auto` resolved."""
    return model_options(args)["device"]


def load_benchmark_model(args: argparse.Namespace):
    """The model (an architecture config builds a seeded random one) and its tokenizer (None then)."""
    return load_for_benchmark(args.model, **model_options(args))


def prompt_ids(tokenizer, vocab_size: int) -> list[int]:
    """The benchmark prompt: PROMPT in the model's chat format, or, for a model without a tokenizer,
    64 seeded random token ids (about as long)."""
    if tokenizer is not None:
        return chat_prompt_ids(tokenizer, PROMPT)
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (64,), generator=generator).tolist()


def eviction_config(args: argparse.Namespace) -> EvictionConfig:
    return EvictionConfig(args.budget, args.interval)


def machine(device: str) -> str:
    """The device in words: the GPU's name, or the CPU threads torch uses."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{torch.get_num_threads()} CPU threads ({platform.processor() or platform.machine()})"


def command_line(verb: str, args: argparse.Namespace, *extra: str) -> str:
    """The `foresight bench` command that reproduces a report."""
    parts = [f"foresight bench {verb} --model {args.model} --policies {args.policies} --budget {args.budget}",
             f"--interval {args.interval}", *extra,
             f"--device {args.device} --dtype {args.dtype} --out {shlex.quote(str(args.out))}"]
    if args.section:
        parts.append(f"--section {args.section}")
    return " ".join(parts)
