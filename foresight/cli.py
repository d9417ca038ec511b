"""The `foresight` command: one verb per module in `foresight.commands`.

Each verb module has a docstring (its help text), `add_arguments(parser)` and `run(args) -> int`.
Verbs are discovered, so adding a stage of the pipeline never edits this file.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from foresight import commands
from trainers.process import quiet_third_party_notices


class HelpFormatter(argparse.HelpFormatter):
    """States each option's default once: appends "(default: X)" unless the help already says it, the
    option is required, or there is nothing to state (None, a switch, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))  # off unless given
        silent = switch or default is None or default is False or default is argparse.SUPPRESS or default == []
        if "(default" in help_text or action.required or not action.option_strings or silent:
            return help_text
        return f"{help_text} (default: %(default)s)".lstrip()


class ArgumentParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, `foresight VERB: error: MESSAGE`, with exit status 2; a
    config key given as LightningCLI spells it (`--trainer.devices 2`) is answered with the verbs' `--set`."""

    def error(self, message: str) -> NoReturn:
        unknown = message.removeprefix("unrecognized arguments: ").split()
        dotted = next((word for word in unknown if re.fullmatch(r"--\w+(\.\w+)+(=.*)?", word)), None)
        if message.startswith("unrecognized arguments: ") and dotted is not None:
            key, _, value = dotted[2:].partition("=")
            following = unknown[unknown.index(dotted) + 1 : unknown.index(dotted) + 2]
            value = value or (following[0] if following and not following[0].startswith("-") else "VALUE")
            message = f"{dotted} is spelled --set {key}={value} (config keys are set with --set KEY=VALUE)"
        self.exit(2, f"{self.prog}: error: {message}\n")


PIPELINE_ORDER = (
    "traces", "labels", "examples", "fit", "rl", "eval", "export",
    "generate", "replay", "calibrate", "policies", "curves", "bench", "demo",
)  # fmt: skip
"""The verbs as `foresight --help` lists them: the training pipeline in its order, then the tools around it."""


def _verbs() -> list[str]:
    """Every verb module, in `PIPELINE_ORDER` (a verb the order does not name yet comes last)."""
    found = {m.name for m in pkgutil.iter_modules(commands.__path__) if not m.name.startswith("_")}
    ordered = [name for name in PIPELINE_ORDER if name in found]
    return ordered + sorted(found - set(ordered))


def owns_help(module) -> bool:
    """Whether a verb's help comes in parts (`HELP_PARTS`), so that it adds its own -h/--help."""
    return hasattr(module, "HELP_PARTS")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="foresight", description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name in _verbs():
        module = importlib.import_module(f"foresight.commands.{name}")
        doc = (module.__doc__ or name).strip()
        summary = " ".join(doc.split("\n\n")[0].split())  # the docstring's first paragraph
        verb = sub.add_parser(
            name, help=summary, description=doc, formatter_class=HelpFormatter, add_help=not owns_help(module)
        )
        module.add_arguments(verb)
        verb.set_defaults(run=module.run)
    return parser


ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def default_allocator_settings() -> None:
    """Let PyTorch's CUDA allocator grow its segments in place unless the user configured it: the
    sampler's batch cache is rebuilt at changing sizes as rows join and leave, which fragmented an
    H100's memory (29 GiB reserved but unused at an out-of-memory error, docs/traces.md). Read when
    CUDA first allocates, so setting it before a verb runs is in time."""
    if not any(name in os.environ for name in ALLOCATOR_VARIABLES):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


class _StderrHandler(logging.StreamHandler):
    """Writes each record to the `sys.stderr` of the moment, so a redirected stderr receives it."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it; the property always reads sys.stderr
        pass


LOGGERS = ("foresight", "trainers")
"""The packages whose module loggers (`logging.getLogger(__name__)`) the command shows."""


def configure_logging() -> None:
    """Diagnostics (notes, progress of the steps before a run) on stderr, one line each; results go to stdout.
    Once per process: a library user who never runs the CLI keeps logging's defaults."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(handler, _StderrHandler) for handler in logger.handlers):
            handler = _StderrHandler()
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    default_allocator_settings()
    configure_logging()
    quiet_third_party_notices()
    try:
        return args.run(args)
    except ValueError as error:  # bad input: one line, no traceback
        print(f"foresight {args.verb}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
