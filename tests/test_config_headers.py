"""Every `foresight` command a config's header shows parses: a header that spells an option the verbs do not take
(`--trainer.devices N` where the grammar is `--set trainer.devices=N`) fails here, not on a user's GPU machine."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from foresight.cli import build_parser
from trainers.run_config import override_args

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
PLACEHOLDERS = {"N": "2", "M": "4"}  # a header's stand-ins for counts the user picks


def header_commands(path: Path) -> list[list[str]]:
    """The argument lists of the config header's commands: its `Run:` line, every indented `foresight VERB ...`
    line, and every indented line of bare options (`--...`), read as options added to the `Run:` command."""
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    run = next((_words(line.split("Run: ", 1)[1]) for line in header if line.startswith("# Run: foresight")), [])
    shown = [line[1:].strip() for line in header if line.startswith("#   ")]
    commands = [run] if run else []
    commands += [_words(line) for line in shown if line.startswith("foresight ")]
    commands += [run + _words("foresight " + line)[1:] for line in shown if line.startswith("--")]
    return commands


def _words(text: str) -> list[str]:
    """A command's arguments after `foresight` (an explanation in parentheses after two spaces dropped), with the
    placeholders replaced by counts."""
    words = shlex.split(text.split("  (")[0])[1:]  # after `foresight`
    return [re.sub(r"(?<![\w.])([NM])$", lambda m: PLACEHOLDERS[m[1]], word) for word in words]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.name)
def test_every_command_of_a_config_header_parses(config):
    commands = header_commands(config)
    assert commands, f"{config.name} shows no foresight command in its header"
    parser = build_parser()
    for words in commands:
        args = parser.parse_args(words)  # argparse exits (SystemExit 2) on an option the verb does not take
        override_args(args.overrides)  # and each --set must be KEY=VALUE


def test_the_old_multi_gpu_spelling_is_refused():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["fit", "--config", "c.yaml", "--out", "o", "--trainer.devices", "2"])
