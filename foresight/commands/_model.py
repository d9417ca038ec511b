"""--model, --device and --dtype: the arguments of every verb that runs the model, and the keywords
they give `foresight.models.load_model`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from foresight.models import AUTO, DEFAULT_MODEL, DTYPES, check_device, placement


def add_model_arguments(
    parser: argparse.ArgumentParser,
    *,
    made_traces: bool = False,
    architecture_configs: bool = False,
    device: str = "cpu",
    dtype: str = "float32",
) -> None:
    """Add --model, --device and --dtype. With `made_traces`, --model names the model that made the
    traces the verb reads, and defaults to the one their manifest names; with `architecture_configs`
    (benchmarks, where only the shape matters) it also takes a configs/models/*.json file."""
    if made_traces:
        parser.add_argument(
            "--model",
            default=None,
            help="the model that made the traces (default: the one named in the traces manifest; another is refused)",
        )
    else:
        parser.add_argument(
            "--model",
            default=DEFAULT_MODEL,
            help=f"{DEFAULT_MODEL!r} (the embedded SmolLM2-135M-Instruct), a local model folder or a Hub id"
            + (", or an architecture config (configs/models/*.json: random weights)" if architecture_configs else ""),
        )
    add_placement_arguments(parser, device=device, dtype=dtype)


def add_placement_arguments(parser: argparse.ArgumentParser, *, device: str = "cpu", dtype: str = "float32") -> None:
    """Add --device and --dtype alone, for a verb whose model is named elsewhere (a traces manifest, a
    training config)."""
    parser.add_argument(
        "--device",
        type=device_argument,
        default=device,
        help="where the model runs: cpu, cuda, cuda:N, mps, or auto (cuda if available, else cpu)",
    )
    parser.add_argument(
        "--dtype",
        choices=[*DTYPES, AUTO],
        default=dtype,
        help="dtype of the model's weights and activations; auto: bfloat16 on cuda, float32 elsewhere",
    )


def device_argument(text: str) -> str:
    """argparse type of --device: a device name this machine has."""
    try:
        return check_device(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `device` and `dtype` keywords of `load_model` that --device and --dtype ask for, `auto` resolved."""
    device, dtype = placement(args.device, args.dtype)
    return {"device": device, "dtype": dtype}


def model_of_traces(args: argparse.Namespace, traces_dir: Path, made_with: str) -> str:
    """The model that made the traces in `traces_dir`; --model, when given, must name that one."""
    if args.model is not None and args.model != made_with:
        raise ValueError(
            f"--model {args.model!r} is not the model that made the traces in {traces_dir} ({made_with!r})"
        )
    return made_with
