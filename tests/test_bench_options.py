"""A benchmark's (and a study's) options come from its settings' fields (foresight.bench.options): every
benchmark module is a sub-command with its fields as options, a new one needs only its own file, the command
written into a report parses back into the same settings, the commands of the docs still parse as they did,
and a study's old `foresight bench` spelling answers with its new one."""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import sys
import typing
from pathlib import Path

import pytest

import foresight.bench
from foresight import cli
from foresight.bench.common import trace_sets
from foresight.bench.options import flags, options
from foresight.commands._grammar import settings_from
from foresight.commands.bench import MOVED_TO_STUDIES, benchmarks
from studies.__main__ import build_parser as studies_parser
from studies.__main__ import main as studies_main
from studies.__main__ import studies

STUDIES = studies()
MODULES = {**benchmarks(), **STUDIES}
RUNNER = {**dict.fromkeys(benchmarks(), "foresight bench"), **dict.fromkeys(STUDIES, "python -m studies")}

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = {  # values of the options without a default, by field name
    "traces": Path("runs/traces dir"),
    "eval": Path("runs/eval dir"),
    "kv_memory": "512MiB",
    "heuristics": "snapkv,tova",
    "sets": ("a b=runs/x,runs/y", "c=runs/z"),
    "learned": ("shipped=paper features", "std=standardised"),
    "scorer": ("sl=checkpoints/default", "rl=runs/rl"),
    "run": ("alpha=runs/eval a", "value=runs/v"),
}
ONE_OF = {"rl-heldout": "traces"}  # a study that needs one of several optional options: the one the test gives


def subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bench = action.choices["bench"]
    return next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices


def parse(words: list[str]):
    """The settings that `foresight bench ...` or `python -m studies ...` words ask for, as their runner reads them."""
    if words[:3] == ["python", "-m", "studies"]:
        args = studies_parser(STUDIES).parse_args(words[3:])
    else:
        args = cli.build_parser().parse_args(words[1:] if words[0] == "foresight" else words)
    return settings_from(args.benchmark.Settings, args)


def name_of(command: str) -> str:
    """The benchmark or study a command runs."""
    words = command.split()
    return words[3] if words[:3] == ["python", "-m", "studies"] else words[2]


def test_every_benchmark_module_is_a_sub_command_with_its_fields_as_options():
    modules = [info.name for info in __import__("pkgutil").iter_modules(foresight.bench.__path__)]
    declared = {}
    for name in modules:
        module = __import__(f"foresight.bench.{name}", fromlist=["NAME"])
        if hasattr(module, "NAME"):
            declared[module.NAME] = module
    offered = subcommands()
    assert set(declared) == set(benchmarks()) == set(offered) - set(MOVED_TO_STUDIES) and len(declared) >= 12
    assert set(MOVED_TO_STUDIES) <= set(STUDIES) and not set(STUDIES) & set(declared)  # studies born as studies too
    for name, module in declared.items():
        strings = {s for action in offered[name]._actions for s in action.option_strings}
        assert {flag for option in options(module.Settings) for flag in flags(option)} <= strings, name
        assert offered[name].description == module.__doc__


def test_a_new_benchmark_is_one_file(tmp_path, monkeypatch, capsys):
    """A module dropped beside the others, declaring NAME, Settings and run, is a sub-command."""
    (tmp_path / "count_words.py").write_text('''"""Counts to N: a benchmark in one file."""
from dataclasses import dataclass, field

from foresight.bench.common import ReportSettings

NAME = "count-words"


@dataclass(frozen=True, kw_only=True)
class Settings(ReportSettings):
    upto: int = field(default=3, metadata={"help": "how far to count", "flags": ("--upto", "-n")})
    words: tuple[str, ...] = field(default=(), metadata={"help": "a word to say; repeat"})


def run(settings: Settings) -> str:
    return f"Command: `{settings.command}`\\n\\n" + " ".join([*map(str, range(1, settings.upto + 1)), *settings.words])
''')
    monkeypatch.setattr(foresight.bench, "__path__", [*foresight.bench.__path__, str(tmp_path)])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "foresight.bench.count_words", raising=False)
    out = tmp_path / "report.md"
    assert cli.main(["bench", "count-words", "-n", "4", "--words", "go", "--words", "now", "--out", str(out)]) == 0
    text = out.read_text()
    assert "<!-- count-words:start -->" in text and "1 2 3 4 go now" in text
    assert f"`foresight bench count-words --upto 4 --words go --words now --out {out}`" in text
    assert cli.build_parser().parse_args(["bench", "count-words"]).upto == 3
    (
        tmp_path / "bare.py"
    ).write_text('''"""A benchmark whose settings extend nothing: the verb adds --out and --section."""
from dataclasses import dataclass, field

NAME = "bare"


@dataclass(frozen=True)
class Settings:
    seed: int = field(default=0, metadata={"help": "a seed"})


def run(settings: Settings) -> str:
    return f"seed {settings.seed}"
''')
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "bare", "--seed", "5"]) == 0
    assert "<!-- bare:start -->\nseed 5\n" in (tmp_path / "runs" / "bench" / "bare.md").read_text()
    assert cli.main(["bench", "bare", "--out", "elsewhere.md", "--section", "mine"]) == 0
    assert "<!-- mine:start -->\nseed 0\n" in (tmp_path / "elsewhere.md").read_text()


def varied(settings):
    """The settings with every option whose type allows it set away from its default (quoting included)."""
    hints = typing.get_type_hints(type(settings))
    changes = {}
    for option in options(type(settings)):
        kind, value = hints[option.name], getattr(settings, option.name)
        if kind is bool:
            changes[option.name] = not value
        elif kind is int and option.name not in ("budget", "interval"):
            changes[option.name] = value + 3
        elif kind in (float, float | None):
            changes[option.name] = 0.375
        elif kind == tuple[int, ...] and option.name == "fold":
            changes[option.name] = (0, 1)  # folds of the study, which has at least 2
        elif kind == tuple[int, ...] and option.name != "budgets":
            changes[option.name] = (96, 160)
        elif kind == Path | None:
            changes[option.name] = Path("runs/with space/x.md")
        elif option.name == "section":
            changes[option.name] = "my section"
    return dataclasses.replace(settings, **changes)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_the_reproduction_command_parses_back_into_the_same_settings(name):
    module = MODULES[name]
    required = [f for f in options(module.Settings) if f.default is dataclasses.MISSING or f.name == ONE_OF.get(name)]
    words = [*RUNNER[name].split(), name]
    for option in required:
        value = REQUIRED[option.name]
        for item in value if isinstance(value, tuple) else (value,):
            words += [flags(option)[0], str(item)]
    settings = parse(words)
    for candidate in (settings, varied(settings)):
        command = candidate.command
        assert command.startswith(f"{RUNNER[name]} {name} ")
        assert parse(shlex.split(command)) == candidate, command


def documented_commands() -> list[str]:
    """Every complete `foresight bench` and `python -m studies` command of the docs, README, model cards and
    studies (no placeholders; not docs/extending.md, whose walk-through adds a benchmark)."""
    paths = [
        *ROOT.glob("docs/**/*.md"),
        ROOT / "README.md",
        *ROOT.glob("configs/**/*.md"),
        *ROOT.glob("checkpoints/**/*.md"),
        *ROOT.glob("studies/**/*.md"),
    ]
    found = []
    for path in (path for path in paths if path.name != "extending.md"):
        for match in re.finditer(
            r"(?:foresight bench|python -m studies) [a-z][a-z-]*[^`\n|]*", path.read_text().replace("\\\n", " ")
        ):
            command = match.group(0).split("#")[0].strip()
            if not any(mark in command for mark in ("[", "...", "NAME")):
                found.append(command)
    return found


def test_documented_commands_parse_and_reproduce():
    commands = documented_commands()
    assert len({name_of(command) for command in commands}) >= 10
    parsed = 0
    for command in commands:
        try:
            settings = parse(shlex.split(command))
        except SystemExit:  # a name in prose (`foresight bench pipeline`) without its required options
            assert any(f.default is dataclasses.MISSING for f in options(MODULES[name_of(command)].Settings))
            continue
        assert parse(shlex.split(settings.command)) == settings, command
        parsed += 1
    assert parsed >= 20


def test_documented_commands_keep_their_meaning():
    """Commands as the docs give them read into what the flags always meant."""
    decode = parse(
        shlex.split(
            "foresight bench decode --model default --policies snapkv,rkv --budget 256 --interval 64 --max-new-tokens 1536 "
            "--batch-sizes 1,4 --dtype auto --out docs/benchmarks.md"
        )
    )
    assert (decode.policy_names, decode.batch_sizes, decode.max_new_tokens) == (["full", "snapkv", "rkv"], (1, 4), 1536)
    assert decode.run_device == "cpu" and decode.out == Path("docs/benchmarks.md") and decode.scorer == ()
    assert "foresight" not in parse(["bench", "decode"]).policy_names  # 'all' is what it was: no scorer given
    assert "foresight" in parse(["bench", "decode", "--scorer", "checkpoints/default"]).policy_names
    labels = parse(
        shlex.split("foresight bench labels-memory --lengths 2048 4096 --budget 128 --interval 32 --device cpu")
    )
    assert labels.lengths == (2048, 4096) and str(labels.run_dtype) == "torch.float32"
    heldout = parse(
        shlex.split(
            "python -m studies rl-heldout --traces runs/rl/traces --holdout 0.4 --exclude 0,4 --scorer supervised=checkpoints/default "
            "--scorer reinforced=runs/rl/t01/scorer"
        )
    )
    assert heldout.scorers == (("supervised", "checkpoints/default"), ("reinforced", "runs/rl/t01/scorer"))
    assert (heldout.holdout, heldout.excluded, heldout.resamples) == (0.4, {0, 4}, 10000)
    ablation = parse(
        [
            "python",
            "-m",
            "studies",
            "ablation",
            "--set",
            "unseen A=runs/a,runs/b",
            "--learned",
            "x=what it is",
            "-B",
            "256",
        ]
    )
    assert trace_sets(ablation.sets) == (("unseen A", (Path("runs/a"), Path("runs/b"))),) and ablation.budget == 256
    capacity = parse(["bench", "capacity", "--model", "configs/models/qwen3-4b.json"])
    assert (capacity.budget, capacity.interval, capacity.lengths, capacity.time_limit) == (  # the one default
        128,
        32,
        (8192, 16384, 32768),
        None,
    )


@pytest.mark.parametrize(
    "words, message",
    [
        (["bench", "decode", "--batch-sizes", "1,x"], "expected comma-separated integers such as 64,128, got '1,x'"),
        (["bench", "pipeline", "--traces", "t", "--fit-steps", "many"], "expected an int, got 'many'"),
        (["bench", "memory", "--dtype", "float8"], "invalid choice: 'float8'"),
    ],
)
def test_a_bad_value_is_one_line_naming_it(words, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(words)
    error = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and message in error and "\n" not in error


@pytest.mark.parametrize(
    "words, message",
    [
        (["bench", "decode", "--policies", "golden"], "policy 'golden' needs labels"),
        (["bench", "decode", "--device", "cuda:7"], "device 'cuda:7' is not available"),
        (["bench", "paged-reclaim", "--traces", "t", "--page-sizes", "16,0"], "page size 0 must be a positive number"),
        (["bench", "pipeline", "--traces", "t", "--policy", "full"], "--policy 'full' evicts nothing"),
    ],
)
def test_settings_refuse_bad_input_in_one_line(words, message, capsys):
    assert cli.main(words) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and "\n" not in error


@pytest.mark.parametrize(
    "words, message",
    [
        (["rl-heldout", "--traces", "t", "--scorer", "a=x"], "give exactly two --scorer NAME=DIR"),
        (["ablation", "--set", "nofolders", "--learned", "a=b"], "--set 'nofolders' must look like NAME=DIR,DIR,..."),
        (["ablation", "--spec", "s.yaml", "-B", "64"], "give --spec FILE alone, or the study's options without it"),
        (["ablation", "--spec", "missing.yaml"], "no spec file at missing.yaml"),
    ],
)
def test_studies_refuse_bad_input_in_one_line(words, message, capsys):
    assert studies_main(words) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and "\n" not in error


@pytest.mark.parametrize("name", MOVED_TO_STUDIES)
def test_a_study_spelled_as_a_benchmark_answers_with_its_new_spelling(name, capsys):
    assert cli.main(["bench", name, "--traces", "t"]) == 2
    error = capsys.readouterr().err.strip()
    assert f"`foresight bench {name}` is a study now: run `python -m studies {name}`" in error and "\n" not in error


@pytest.mark.parametrize("name", sorted(STUDIES))
def test_a_study_run_alone_runs_its_spec(name, tmp_path):
    """Each study's spec.yaml names only its options, and the study named alone parses into what it gives."""
    import yaml

    from studies.__main__ import spec_path, with_spec

    spec = yaml.safe_load(spec_path(STUDIES[name]).read_text())
    settings = parse(["python", "-m", "studies", *with_spec([name], STUDIES)])
    assert settings.command.startswith(f"python -m studies {name} ")
    for key, value in spec.items():
        option = next(
            o for o in options(type(settings)) if key.replace("-", "_") in (o.name, flags(o)[0][2:].replace("-", "_"))
        )
        read = getattr(settings, option.name)
        assert str(value) in (str(read), str(list(read)) if isinstance(read, tuple) else None) or read, (key, read)
    bad = tmp_path / "bad.yaml"
    bad.write_text("no_such_option: 1\n")
    with pytest.raises(ValueError, match="'no_such_option' is not an option here; the options are --"):
        with_spec([name, "--spec", str(bad)], STUDIES)


def test_no_document_spells_a_study_as_a_benchmark():
    """Docs, notes, cards and the studies' own files name a study by `python -m studies NAME` only."""
    paths = [
        *ROOT.glob("docs/**/*.md"),
        ROOT / "README.md",
        *ROOT.glob("checkpoints/**/*.md"),
        *(path for path in ROOT.glob("studies/**/*") if path.suffix in (".py", ".md", ".yaml")),  # not bytecode
    ]
    old = re.compile(rf"foresight bench ({'|'.join(MOVED_TO_STUDIES)})\b")
    assert [str(path) for path in paths if path.is_file() and old.search(path.read_text())] == []
