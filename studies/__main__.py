"""`python -m studies STUDY [options]`: run one research study and rewrite its section of a markdown report.

With no option after STUDY, the study runs the options of its folder's spec.yaml (its published run);
`--spec FILE` names another spec; options on the command line replace the spec (they are not merged).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import yaml

from foresight.bench.options import option_words
from foresight.cli import ArgumentParser, HelpFormatter, configure_logging
from foresight.commands._policy import refuse_old_spelling
from foresight.commands.bench import add_benchmark, run
from trainers.process import quiet_third_party_notices

HERE = Path(__file__).resolve().parent
OLD_SPELLINGS = {"--temperature": "--sample-temperature"}
"""Options a study spelled otherwise before 0.3.0, answered with the new spelling (τ of Eq. 2 is
--sample-temperature wherever evictions are sampled, as in `foresight eval`)."""


def studies() -> dict[str, ModuleType]:
    """{NAME: run module} of every study folder (one holding run.py)."""
    found = {}
    for folder in sorted(HERE.iterdir()):
        if (folder / "run.py").is_file():
            module = importlib.import_module(f"studies.{folder.name}.run")
            found[module.NAME] = module
    return found


def spec_path(module: ModuleType) -> Path:
    """The spec file of a study's published run, beside its run.py."""
    return Path(module.__file__).with_name("spec.yaml")


def spec_words(module: ModuleType, path: Path) -> list[str]:
    """The command-line options a spec file gives (a mapping of option names to values)."""
    if not path.is_file():
        raise ValueError(f"no spec file at {path}; give the study's options or --spec FILE")
    values = yaml.safe_load(path.read_text()) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path} must map option names to values, got {type(values).__name__}")
    return option_words(module.Settings, values)


def build_parser(found: dict[str, ModuleType]) -> ArgumentParser:
    parser = ArgumentParser(prog="python -m studies", description=__doc__, formatter_class=HelpFormatter)
    subparsers = parser.add_subparsers(dest="what", required=True, metavar="STUDY")
    for name, module in found.items():
        sub = add_benchmark(subparsers, name, module, HelpFormatter)
        sub.add_argument("--spec", type=Path, help="a spec file to run instead of the study's spec.yaml")
        for old, new in OLD_SPELLINGS.items():
            if any(new in action.option_strings for action in sub._actions):
                refuse_old_spelling(sub, old, new)
    return parser


def with_spec(words: list[str], found: dict[str, ModuleType]) -> list[str]:
    """The words to parse: a study named alone (or with --spec FILE only) runs its spec's options."""
    if not words or words[0] not in found:
        return words
    name, rest = words[0], words[1:]
    if rest and rest[0] in ("-h", "--help"):
        return words
    if not rest:
        return [name, *spec_words(found[name], spec_path(found[name]))]
    if rest[0] == "--spec" and len(rest) == 2:
        return [name, *spec_words(found[name], Path(rest[1]))]
    if "--spec" in rest:
        raise ValueError("give --spec FILE alone, or the study's options without it")
    return words


def main(argv: Sequence[str] | None = None) -> int:
    found = studies()
    words = list(sys.argv[1:] if argv is None else argv)
    if not words:  # the list of studies
        build_parser(found).print_help()
        return 0
    try:
        args = build_parser(found).parse_args(with_spec(words, found))
        configure_logging()
        quiet_third_party_notices()
        return run(args)
    except ValueError as error:  # bad input: one line, no traceback
        print(f"python -m studies: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
