"""A training run's LightningCLI arguments: the config checked, `--set KEY=VALUE` overrides turned into
LightningCLI's own, and its rejections turned into one line naming the key and what it takes."""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from foresight.cadence import Regime


@dataclass(frozen=True, kw_only=True)
class RunRequest:
    """What every training run is given: its config and folder, and the settings that override the config's
    (None: the config's own): the traces, the frozen model, B, L and the regime, a checkpoint to resume from
    ("last" or a path), and `overrides`, `KEY=VALUE` pairs of dotted config keys applied last. Paths and names
    given as text are parsed here, so a bad one stops before any work, whichever door it came through."""

    config: Path
    out: Path
    traces: Path | None = None
    model: str | None = None
    budget: int | None = None
    interval: int | None = None
    regime: Regime | None = None
    ckpt_path: str | None = None
    overrides: Sequence[str] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", Path(self.config))
        object.__setattr__(self, "out", Path(self.out))
        if self.traces is not None:
            object.__setattr__(self, "traces", Path(self.traces))
        if self.regime is not None:
            object.__setattr__(self, "regime", Regime.parse(self.regime))
        object.__setattr__(self, "overrides", tuple(self.overrides))

    def common_args(self) -> list[str]:
        """The LightningCLI arguments every run takes from its request: config, folders, model, B and L."""
        checked_config(self.config)
        cli_args = [
            f"--config={self.config}",
            f"--trainer.default_root_dir={self.out}",
            f"--checkpoint.dirpath={self.out / 'checkpoints'}",
        ]
        if self.traces is not None:
            checked_traces(self.traces)
        return cli_args + data_args(self.model, self.budget, self.interval)


def checked_config(path: Path) -> Path:
    """The config file, or a one-line error when it does not exist."""
    if not path.is_file():
        raise ValueError(f"config {path} does not exist; see configs/ for examples")
    return path


def checked_traces(path: Path) -> Path:
    """An existing traces folder, or a one-line error naming the verb that makes one."""
    if not path.is_dir():
        raise ValueError(f"--traces {path} is not a folder; make one with `foresight traces`")
    return path


def data_args(model: str | None, budget: int | None, interval: int | None) -> list[str]:
    """LightningCLI arguments of the data section from the `--model -B -L` every verb takes (None: the config's)."""
    values = {"model": model, "budget": budget, "interval": interval}
    return [f"--data.{key}={value}" for key, value in values.items() if value is not None]


def override_args(overrides: Sequence[str], ckpt_path: str | None = None) -> list[str]:
    """LightningCLI arguments of `--set KEY=VALUE` overrides and, when given, `--ckpt-path`."""
    cli_args = []
    for text in overrides:
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {text!r} must look like KEY=VALUE, e.g. trainer.max_steps=50")
        cli_args.append(f"--{key.strip()}={value.strip()}")
    if ckpt_path is not None:
        cli_args.append(f"--ckpt_path={ckpt_path}")
    return cli_args


@contextlib.contextmanager
def one_line_config_errors() -> Iterator[None]:
    """Turn LightningCLI's rejection of a config value (raised, not printed, with `exit_on_error=False`)
    into the one-line error of a bad `--set`, instead of its usage screen."""
    try:
        yield
    except argparse.ArgumentError as error:
        raise ValueError(config_error_line(str(error))) from None


TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}
"""A config value's Python type in words, for the one-line error of a bad --set value."""


def config_error_line(message: str) -> str:
    """One line for a LightningCLI argument error: the key and what it takes."""
    unknown = re.fullmatch(r"unrecognized arguments: (.*)", message.strip(), re.DOTALL)
    if unknown:
        keys = [argument.lstrip("-").partition("=")[0] for argument in unknown[1].split()]
        return (
            f"--set {', '.join(keys)}: not a key of the config (keys are dotted paths of its YAML, "
            "e.g. trainer.max_steps, model.lr)"
        )
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    key = re.fullmatch(r'Parser key "([^"]+)":', lines[0]) if lines else None
    if key and len(lines) > 1:
        expected = re.fullmatch(r"Expected a <class '(\w+)'>\. Got value: (.*)", lines[1])
        what = f"takes {TYPE_WORDS.get(expected[1], expected[1])}, not {expected[2]!r}" if expected else lines[1]
        return f"--set {key[1]}: {what}"
    return f"config: {' '.join(lines)}"
