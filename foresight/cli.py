"""The `foresight` command: one verb per module in `foresight.commands`.

Each verb module has a docstring (its help text), `add_arguments(parser)` and `run(args) -> int`.
Verbs are discovered, so adding a stage of the pipeline never edits this file.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from foresight import commands


def _verbs() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(commands.__path__) if not m.name.startswith("_"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="foresight", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for name in _verbs():
        module = importlib.import_module(f"foresight.commands.{name}")
        doc = (module.__doc__ or name).strip()
        verb = sub.add_parser(
            name,
            help=doc.splitlines()[0],
            description=doc,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        module.add_arguments(verb)
        verb.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as error:  # bad input: one line, no traceback
        print(f"foresight {args.verb}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
