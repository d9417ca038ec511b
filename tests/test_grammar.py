"""One command-line grammar across every verb, benchmark and study (issue 43 §3), checked by walking their parsers.

The shared words live once in `foresight.bench.options` (flags, metavars, help), the defaults once in
`foresight.cadence` (B, L) and `foresight.policies` (the policy run when none is named):

- a learned scorer is `--scorer [NAME=]DIR_OR_HUB_ID`, repeatable, wherever one is loaded;
- a policy option is `-o [ROW.]KEY=VALUE`, ROW. left out where one policy runs;
- a budget is -B (`--budget`, or `--budgets` for a sweep) and an interval -L, defaulting to the one place or
  required where the command makes or reads an artifact of one B and L (labels, examples, an evaluation);
- old spellings answer with the new one in one line (exit status 2).

`--learned ROW` stays in the studies that table finished `foresight eval` folders (baselines, ablation) and in
`foresight bench equal-bytes`: it names a row of results already written, loads no scorer and runs nothing, so
it is not a scorer option and must not be spelled like one (`--scorer` there would promise a scorer is run).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from foresight import cli
from foresight.bench import options as words
from foresight.cadence import DEFAULT_BUDGET, DEFAULT_INTERVAL
from foresight.commands._policy import policy_from_args
from foresight.commands.bench import MOVED_TO_STUDIES
from foresight.eval.specs import options_by_row, resolve_policies
from foresight.policies import DEFAULT_POLICY
from foresight.runtime.sampling import REASONING_SAMPLING
from studies.__main__ import build_parser as studies_parser
from studies.__main__ import main as studies_main
from studies.__main__ import studies

ROOT = Path(__file__).resolve().parents[1]
ROW_NAMING = {"--learned"}
"""Options that name result rows of finished evaluations (see the module docstring), never a scorer to load."""


def all_parsers() -> dict[str, argparse.ArgumentParser]:
    """{prog: parser} of every verb, every `foresight bench` benchmark and every study (not the studies' old
    names under bench, which only answer with their new spelling)."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    if sub.prog.startswith("foresight bench") and name in MOVED_TO_STUDIES:
                        continue
                    found[sub.prog] = sub
                    walk(sub)

    walk(cli.build_parser())
    walk(studies_parser(studies()))
    return found


PARSERS = all_parsers()


def actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options a user sees (not --help, not the hidden old spellings)."""
    return [a for a in parser._actions if a.option_strings and a.dest != "help" and a.help is not argparse.SUPPRESS]


def option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action | None:
    return next((a for a in actions(parser) if flag in a.option_strings), None)


def test_the_walk_reaches_every_verb_benchmark_and_study():
    progs = set(PARSERS)
    assert {"foresight generate", "foresight eval", "foresight rl", "foresight demo"} <= progs
    assert {"foresight bench decode", "foresight bench capacity", "foresight bench paged-reclaim"} <= progs
    assert {f"python -m studies {name}" for name in studies()} <= progs
    assert not any(prog.endswith(f"bench {name}") for prog in progs for name in MOVED_TO_STUDIES)


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_a_scorer_is_spelled_one_way(prog):
    parser = PARSERS[prog]
    for action in actions(parser):
        loads_scorer = "scorer" in action.dest and action.dest != "sampled_seeds"
        if action.dest == "scorer" or loads_scorer:
            assert action.option_strings == list(words.SCORER_FLAGS), (prog, action.option_strings)
            assert action.metavar == words.SCORER_METAVAR, prog
            assert action.help.startswith(words.SCORER_HELP), prog
            assert isinstance(action, argparse._AppendAction), f"{prog}: --scorer is repeatable"
        if set(action.option_strings) & ROW_NAMING:
            assert action.metavar.startswith("ROW") and "row name" in action.help, prog


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_policy_options_are_one_grammar(prog):
    taken = option(PARSERS[prog], "-o")
    if taken is None:
        assert option(PARSERS[prog], "--option") is None, prog
        return
    assert (taken.option_strings, taken.metavar, taken.help) == (
        list(words.OPTION_FLAGS),
        words.OPTION_METAVAR,
        words.OPTION_HELP,
    ), prog
    assert isinstance(taken, argparse._AppendAction), prog


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_budgets_and_intervals_are_B_and_L_defaulting_to_the_one_place(prog):
    for action in actions(PARSERS[prog]):
        spelled = " ".join(action.option_strings)
        if action.dest in ("budget", "budgets") or "budget" in spelled:
            flags, help_text = (
                (words.BUDGETS_FLAGS, words.BUDGETS_HELP)
                if action.dest == "budgets"
                else (words.BUDGET_FLAGS, words.BUDGET_HELP)
            )
            from_config = action.help == f"{help_text} (default: the config's data.budget)"  # fit, rl
            assert tuple(action.option_strings) == flags and (action.help == help_text or from_config), prog
            default = action.default
            if action.dest == "budget":
                assert default in (DEFAULT_BUDGET, None) and (default is None) == (action.required or from_config), prog
            elif default is not None:  # a sweep: the default budget among its budgets
                assert DEFAULT_BUDGET in (int(b) for b in str(default).replace(",", " ").split()), prog
        if action.dest == "interval" or "interval" in spelled:
            from_config = f"{words.INTERVAL_HELP} (default: the config's data.interval)"  # fit, rl
            assert tuple(action.option_strings) == words.INTERVAL_FLAGS, prog
            assert action.help in (words.INTERVAL_HELP, from_config), prog
            required = action.required or action.help == from_config
            assert action.default in (DEFAULT_INTERVAL, None) and (action.default is None) == required, prog
            assert option(PARSERS[prog], "-B") is not None, f"{prog}: an interval without a budget"


@pytest.mark.parametrize(
    ("flag", "shared"),
    [
        ("--device", "where the model runs: cpu, cuda, cuda:N, mps, or auto"),
        ("--dtype", "dtype of the model's weights and activations; auto: bfloat16 on cuda, float32 elsewhere"),
        ("--temperature", None),
        ("--top-k", None),
        ("--top-p", None),
    ],
)
def test_the_same_option_says_the_same_words_everywhere(flag, shared):
    """Options that mean one thing in every command carry one help text; the sampling flags are declared once
    (`foresight/commands/_sampling.py`), at the runtime's sampling defaults. (`--sample-temperature` is τ of
    Eq. 2 where a study or eval samples evictions; `--temperature` is the token sampling's only.)"""
    helps = {prog: option(parser, flag) for prog, parser in PARSERS.items() if option(parser, flag) is not None}
    assert len(helps) >= 2, flag
    if shared is not None:
        assert all(action.help.startswith(shared) for action in helps.values()), flag
    else:
        assert len({action.help for action in helps.values()}) == 1, flag
        key = flag[2:].replace("-", "_")
        assert {action.default for action in helps.values()} == {getattr(REASONING_SAMPLING, key)}, flag


def test_every_verb_that_implies_a_policy_implies_the_same_one():
    for argv in (["generate", "hi"], ["replay", "f.txt"], ["demo"]):
        assert policy_from_args(cli.build_parser().parse_args(argv))[0].name == DEFAULT_POLICY, argv
    assert option(PARSERS["foresight bench pipeline"], "--policy").default == DEFAULT_POLICY


def test_a_policy_option_names_its_row_or_the_one_policy():
    """[ROW.] may be left out exactly where one row runs: the same option either way there, a one-line error
    where several rows could take it."""
    replay = cli.build_parser().parse_args
    for texts in (["window=4"], ["snapkv.window=4"]):
        policy, _ = policy_from_args(replay(["replay", "f.txt", *(w for t in texts for w in ("-o", t))]))
        assert (policy.name, policy.window) == ("snapkv", 4)
    (one,), _ = resolve_policies("snapkv", options_by_row(["window=4"]))
    assert dict(one.options) == {"window": 4}
    with pytest.raises(ValueError, match=r"-o window=\.\.\.: name its row, -o ROW.window=\.\.\. \(rows: h2o, snapkv\)"):
        resolve_policies("h2o,snapkv", options_by_row(["window=4"]))


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["generate", "-o", "scorer=checkpoints/default", "hi"], "use --scorer checkpoints/default"),
        (["replay", "-o", "scorer=runs/x/scorer", "f.txt"], "use --scorer runs/x/scorer"),
        (["generate", "--policy", "foresight", "-o", "foresight.scorer=DIR", "hi"], "use --scorer DIR"),
        (["eval", "--traces", "t", "-B", "128", "-L", "32", "--out", "o", "-o", "scorer=DIR"], "use --scorer DIR"),
        (["demo", "--replay-budget", "64"], "--replay-budget is spelled -B/--budget"),
        (["demo", "--replay-interval", "16"], "--replay-interval is spelled -L/--interval"),
        (["bench", "rl-step"], "run `python -m studies rl-step`"),
        (["labels", "--traces", "t", "-B", "16", "-L", "4", "--kind", "value"], "--kind is spelled --label-kind"),
        (["export", "--checkpoint", "a.ckpt", "--out", "o"], "--checkpoint is spelled --scorer"),
        (["fit", "--config", "c.yaml", "--out", "o", "--trainer.devices", "2"], "--set trainer.devices=2"),
        (
            ["rl", "--config", "c.yaml", "--scorer", "s", "--out", "o", "--trainer.strategy=ddp"],
            "--set trainer.strategy=ddp",
        ),
        (["python -m studies", "rl-signal", "--temperature", "0.005"], "--temperature is spelled --sample-temperature"),
    ],
)
def test_old_spellings_answer_with_the_new_one_in_one_line(capsys, argv, hint):
    run = studies_main if argv[0] == "python -m studies" else cli.main
    try:
        status = run(argv[1:] if run is studies_main else argv)
    except SystemExit as exit:  # refused while parsing
        status = exit.code
    error = capsys.readouterr().err.strip()
    assert status == 2 and hint in error and "\n" not in error and "Traceback" not in error, error


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_every_hidden_option_is_an_old_spelling_that_answers(prog, capsys):
    parser = PARSERS[prog]
    for action in parser._actions:
        if action.option_strings and action.help is argparse.SUPPRESS:
            with pytest.raises(SystemExit) as exit:
                parser.parse_args([action.option_strings[0], "1"])
            error = capsys.readouterr().err.strip()
            assert exit.value.code == 2 and "is spelled" in error and "\n" not in error, error


@pytest.mark.parametrize("prog", ["foresight generate", "foresight replay", "foresight eval", "foresight bench decode"])
def test_help_of_each_verb_uses_the_shared_words(prog):
    text = " ".join(PARSERS[prog].format_help().split())
    for phrase in (words.SCORER_METAVAR, " ".join(words.SCORER_HELP.split())):
        assert phrase in text, (prog, phrase)


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_a_switch_states_no_default(prog):
    """A switch is off unless given: `--no-shared-prefix` printed "(default: True)", the opposite of its meaning."""
    assert (
        "(default: True)" not in PARSERS[prog].format_help() and "(default: False)" not in PARSERS[prog].format_help()
    )


def test_argparse_lives_in_the_command_layer_only():
    """The grammar's home is `foresight.commands._grammar`: the benchmarks declare their options as fields."""
    library = Path(__file__).resolve().parents[1] / "foresight"
    importing = [
        str(path.relative_to(library))
        for path in sorted(library.rglob("*.py"))
        if re.search(r"^\s*import argparse|^\s*from argparse", path.read_text(), re.MULTILINE)
    ]
    assert importing and all(name.startswith("commands/") or name == "cli.py" for name in importing), importing


def test_eval_help_comes_in_parts_that_hold_every_option(capsys):
    """`foresight eval --help` is the common options (under 60 lines); each part shows its own; together with
    the common ones they are every option of the verb."""
    from foresight.commands.eval import HELP_PARTS

    shown = {}
    for part in (None, *HELP_PARTS):
        with pytest.raises(SystemExit) as exit:
            cli.main(["eval", "--help", *([part] if part else [])])
        assert exit.value.code == 0
        shown[part] = capsys.readouterr().out
    assert len(shown[None].splitlines()) < 60 and "--help traces" in shown[None]
    assert "--max-traces" in shown["traces"] and "--samples" in shown["prompts"] and "--scorer" in shown["policies"]
    parser = PARSERS["foresight eval"]
    flags = {action.option_strings[0] for action in actions(parser)}
    assert all(any(flag in text for text in shown.values()) for flag in flags), flags
