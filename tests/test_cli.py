"""The `foresight` command: listings, typed policy options, model placement, help texts, one-line
errors, and runs on the default model."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import torch

from foresight.bench.common import random_scorer
from foresight.choices import Choice
from foresight.cli import ALLOCATOR_VARIABLES, ArgumentParser, HelpFormatter, _verbs, main, owns_help
from foresight.commands._model import model_options
from foresight.commands._policy import policy_from_args, policy_options
from foresight.commands.bench import MOVED_TO_STUDIES
from foresight.commands.eval import policy_specs
from foresight.models import tiny_model
from foresight.policies import POLICIES, Policy
from foresight.policies.options import settable_options
from tests.prompts import DATA, arithmetic_traces, char_tokenizer

B, L = 16, 4


def test_policies_lists_every_constructible_policy_with_needs(capsys):
    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = {line.split()[0]: line for line in lines[1:]}
    assert set(listed) == set(POLICIES)
    assert "block attention" in listed["snapkv"] and "nothing" in listed["knorm"]
    assert "sinks=4" in listed["streaming"]


@pytest.mark.parametrize(
    ("preset", "expected"),
    [({}, "expandable_segments:True"), ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}, "max_split_size_mb:64")],
)
def test_the_cuda_allocator_grows_segments_unless_the_user_configured_it(monkeypatch, capsys, preset, expected):
    environment = {name: value for name, value in os.environ.items() if name not in ALLOCATOR_VARIABLES}
    monkeypatch.setattr(os, "environ", {**environment, **preset})  # main's setting ends with the test
    assert main(["policies"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == expected


ROOT = Path(__file__).resolve().parents[1]
FIT_DEFAULT = ["fit", "--config", str(ROOT / "configs/default.yaml"), "--out", "/nonexistent/run"]
RL_DEFAULT = ["rl", "--config", str(ROOT / "configs/default-rl.yaml"), "--scorer", str(ROOT / "checkpoints/default")]
RL_DEFAULT += ["--out", "/nonexistent/run"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--policy", "h3o", "hi"], "unknown policy 'h3o'"),
        (["generate", "--budget", "32", "--interval", "32", "hi"], "budget B=32 must be larger than the interval L=32"),
        (["generate", "--interval", "0", "hi"], "interval L=0 must be at least 1"),
        (["generate", "--model", "no/such-model-anywhere", "hi"], "no/such-model-anywhere"),
        (["generate", "-o", "seed", "--policy", "random", "hi"], "KEY=VALUE"),
        (["replay", "/no/such/file.txt"], "does not exist"),
        (FIT_DEFAULT + ["--set", "trainer.max_stepz=5"], "--set trainer.max_stepz: not a key of the config"),
        (FIT_DEFAULT + ["--set", "trainer.max_steps=abc"], "--set trainer.max_steps: takes an integer, not 'abc'"),
        (RL_DEFAULT + ["--set", "model.betta=0.1"], "--set model.betta: not a key of the config"),
    ],
)
def test_bad_input_is_one_line_with_exit_status_2(capsys, monkeypatch, argv, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and "\n" not in error


def exit_status(argv: list[str]) -> int:
    """main's status, whether the error was found while parsing (SystemExit) or while running."""
    try:
        return main(argv)
    except SystemExit as exit_info:
        return exit_info.code


# -- policy options typed from the policy's dataclass fields ---------------------------------------
class Speed(Choice):
    FAST = "fast"
    SLOW = "slow"


@dataclass
class Knobs(Policy):
    """A policy with one option of every type the command line reads (not registered)."""

    name = "knobs"
    count: int = 1
    ratio: float = 0.5
    flag: bool = False
    label: str = "a"
    speed: Speed = Speed.FAST
    side: Literal["left", "right"] = "left"
    size: int | None = None
    folder: Path | None = None
    tensor: torch.Tensor | None = None  # not readable from text


def test_options_take_the_types_of_the_dataclass_fields():
    texts = {
        "count": "3",
        "ratio": "0.25",
        "flag": "yes",
        "label": "none",
        "speed": "slow",
        "side": "right",
        "size": "none",
        "folder": "runs/x",
    }
    options = policy_options(Knobs, texts)
    assert options == {
        "count": 3,
        "ratio": 0.25,
        "flag": True,
        "label": "none",
        "speed": Speed.SLOW,
        "side": "right",
        "size": None,
        "folder": Path("runs/x"),
    }
    assert type(options["count"]) is int and type(options["ratio"]) is float and type(options["flag"]) is bool
    assert policy_options(Knobs, {"size": "8", "flag": "False"}) == {"size": 8, "flag": False}
    assert "tensor" not in settable_options(Knobs)


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        ({"count": "abc"}, "policy 'knobs' option count expects an int, got 'abc'"),
        ({"count": "1.5"}, "policy 'knobs' option count expects an int, got '1.5'"),
        ({"ratio": "half"}, "policy 'knobs' option ratio expects a float, got 'half'"),
        ({"flag": "maybe"}, "policy 'knobs' option flag expects a bool (true or false), got 'maybe'"),
        ({"speed": "warp"}, "policy 'knobs' option speed expects one of 'fast', 'slow', got 'warp'"),
        ({"side": "up"}, "policy 'knobs' option side expects one of 'left', 'right', got 'up'"),
        ({"size": "big"}, "policy 'knobs' option size expects an int or none, got 'big'"),
        (
            {"colour": "red"},
            "policy 'knobs' has no option 'colour'; its options are: count, ratio, flag, label, "
            "speed, side, size, folder",
        ),
        ({"tensor": "1"}, "policy 'knobs' has no option 'tensor'"),
    ],
)
def test_bad_option_values_name_the_option_the_value_and_the_type(texts, message):
    with pytest.raises(ValueError) as error:
        policy_options(Knobs, texts)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_registered_option_reads_back_its_own_default(name):
    """What `foresight policies` prints as KEY=VALUE is accepted by -o KEY=VALUE as the same value."""
    cls = POLICIES[name]
    try:
        defaults = cls().options()
    except TypeError:  # needs labels or a scorer
        return
    assert set(settable_options(cls)) == set(defaults)
    assert policy_options(cls, {key: str(value) for key, value in defaults.items()}) == defaults


def test_an_option_reaches_the_policy_with_its_type():
    from foresight.commands._policy import policy_from_args

    args = build_args(["generate", "--policy", "lagkv", "-o", "lag_size=8", "--sinks", "2", "hi"])
    policy, config = policy_from_args(args)
    assert policy.lag_size == 8 and type(policy.lag_size) is int and config.sinks == 2


def build_args(argv: list[str]) -> argparse.Namespace:
    from foresight.cli import build_parser

    return build_parser().parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["-o", "lag_size=abc", "--policy", "lagkv"],
            "policy 'lagkv' option lag_size expects an int or none, got 'abc'",
        ),
        (["-o", "mix_lambda=high", "--policy", "rkv"], "policy 'rkv' option mix_lambda expects a float, got 'high'"),
        (
            ["-o", "windw=4", "--policy", "snapkv"],
            "policy 'snapkv' has no option 'windw'; its options are: window, kernel_size",
        ),
        (["--policy", "foresight"], "policy 'foresight' needs a trained scorer: give --scorer [NAME=]DIR_OR_HUB_ID"),
        (["--policy", "golden"], "policy 'golden' needs labels, which cannot be given on the command line"),
        (["--device", "gpu"], "argument --device: unknown device 'gpu'; choose cpu, cuda, cuda:N, mps or auto"),
        (["--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
    ],
)
def test_bad_policy_and_model_arguments_are_one_line_with_status_2(capsys, argv, message):
    assert exit_status(["generate", *argv, "hi"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"foresight generate: error: {message}") and error.count("\n") == 1


# -- --model, --device and --dtype reach load_model ------------------------------------------------
class Loaded(Exception):
    """Raised by the stand-in load_model once it has recorded its arguments."""


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", initializer_range=0.2)


@pytest.fixture(scope="module")
def traces_dir(tmp_path_factory, model) -> Path:
    out = tmp_path_factory.mktemp("traces")
    return arithmetic_traces(model, out, num=2, max_new_tokens=16)


@pytest.fixture(scope="module")
def scorer_dir(tmp_path_factory, model) -> Path:
    folder = tmp_path_factory.mktemp("scorer")
    random_scorer(model, B, L, base_model="tiny").save_pretrained(folder)
    return folder


MODEL_VERBS = ("generate", "replay", "demo", "bench", "traces", "labels", "examples", "eval", "calibrate")
PIPELINE_VERBS = ("traces", "labels", "examples")
"""The verbs that run a step of the data stage (`trainers.data_stage`), which loads the model for them."""


def model_verb_args(traces_dir: Path, tmp_path: Path) -> dict[str, list[str]]:
    """Arguments that take each model-running verb as far as loading the model."""
    text = tmp_path / "doc.txt"
    text.write_text("Some text to replay.")
    return {
        "generate": ["generate", "hi"],
        "replay": ["replay", str(text)],
        "demo": ["demo"],
        "bench": ["bench", "decode", "--out", str(tmp_path / "bench.md")],
        "traces": [
            "traces",
            "--prompts",
            str(DATA / "arithmetic.jsonl"),
            "--num",
            "1",
            "--max-new-tokens",
            "4",
            "--out",
            str(tmp_path / "traces"),
        ],
        "labels": ["labels", "--traces", str(traces_dir), "-B", "8", "-L", "4"],
        "examples": [
            "examples",
            "--traces",
            str(tmp_path / "labelled"),
            "-B",
            "8",
            "-L",
            "4",
            "--out",
            str(tmp_path / "examples"),
        ],
        "eval": [
            "eval",
            "--traces",
            str(traces_dir),
            "--policies",
            "h2o",
            "-B",
            "8",
            "-L",
            "4",
            "--out",
            str(tmp_path / "eval"),
        ],
        "calibrate": ["calibrate", "--traces", str(traces_dir), "--out", str(tmp_path / "stats")],
    }


@pytest.mark.parametrize("verb", MODEL_VERBS)
def test_device_and_dtype_reach_load_model(verb, model, traces_dir, tmp_path, monkeypatch):
    calls = []

    def load_model(name, **options):
        calls.append((name, options))
        raise Loaded

    if verb == "examples":  # the features step needs labelled traces
        shutil.copytree(traces_dir, tmp_path / "labelled")
        monkeypatch.setattr("trainers.data_stage.load_model", lambda name, **options: (model, None))
        assert main(["labels", "--traces", str(tmp_path / "labelled"), "-B", "8", "-L", "4"]) == 0
    if verb == "bench":  # benchmarks also build models from architecture configs
        monkeypatch.setattr("foresight.bench.common.load_for_benchmark", load_model)
    else:
        module = "trainers.data_stage" if verb in PIPELINE_VERBS else f"foresight.commands.{verb}"
        monkeypatch.setattr(f"{module}.load_model", load_model)
    argv = model_verb_args(traces_dir, tmp_path)[verb]
    with pytest.raises(Loaded):
        main([*argv, "--device", "cpu", "--dtype", "bfloat16"])
    if verb == "examples":  # the first run claimed its folder for bfloat16 features
        argv[-1] += "-float16"
    with pytest.raises(Loaded):
        main([*argv, "--device", "cpu", "--dtype", "float16"])
    model_name = "tiny" if verb in ("labels", "examples", "eval", "calibrate") else "default"
    assert calls == [
        (model_name, {"device": "cpu", "dtype": torch.bfloat16}),
        (model_name, {"device": "cpu", "dtype": torch.float16}),
    ]


def verb_parsers(verb: str) -> list[argparse.ArgumentParser]:
    """The parser of a verb and those of its sub-commands (bench decode, bench serve; not the studies' old names,
    which only answer with their new spelling)."""
    module = importlib.import_module(f"foresight.commands.{verb}")
    parser = ArgumentParser(prog=f"foresight {verb}", formatter_class=HelpFormatter, add_help=not owns_help(module))
    module.add_arguments(parser)
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    moved = tuple(f" {name}" for name in MOVED_TO_STUDIES)
    return [parser, *(sub for action in subparsers for sub in action.choices.values() if not sub.prog.endswith(moved))]


READ_ONLY_BENCHES = (" equal-bytes", " held-memory")


def test_model_verbs_are_the_verbs_with_device_and_dtype():
    """A new verb that loads a model must take --device and --dtype (and join MODEL_VERBS); a verb with
    sub-commands takes them in every sub-command that loads a model (`bench equal-bytes` reads evaluations only,
    `bench held-memory` counts bytes from a shape, running nothing)."""
    with_placement = set()
    for verb in _verbs():
        parsers = [p for p in verb_parsers(verb) if not p.prog.endswith(READ_ONLY_BENCHES)]
        options = [
            {option for action in p._actions for option in action.option_strings} for p in parsers[len(parsers) > 1 :]
        ]
        if all({"--device", "--dtype"} <= found for found in options):
            with_placement.add(verb)
    assert with_placement == set(MODEL_VERBS)


def test_auto_picks_cuda_and_bfloat16_when_cuda_is_there(monkeypatch):
    auto = argparse.Namespace(device="auto", dtype="auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert model_options(auto) == {"device": "cpu", "dtype": torch.float32}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert model_options(auto) == {"device": "cuda", "dtype": torch.bfloat16}
    assert model_options(argparse.Namespace(device="cuda:1", dtype="float32")) == {
        "device": "cuda:1",
        "dtype": torch.float32,
    }


def test_a_device_this_machine_lacks_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert build_args(["generate", "--device", "cuda:1", "hi"]).device == "cuda:1"
    assert exit_status(["generate", "--device", "cuda:2", "hi"]) == 2
    assert capsys.readouterr().err == (
        "foresight generate: error: argument --device: device 'cuda:2' is not available: this machine has 2 CUDA device(s)\n"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert exit_status(["generate", "--device", "cuda", "hi"]) == 2
    assert "device 'cuda' is not available: this machine has 0 CUDA device(s)" in capsys.readouterr().err


# -- the learned policy in eval --------------------------------------------------------------------
def test_policies_with_foresight_take_the_learned_policy_from_scorer(scorer_dir):
    specs, notes = policy_specs("foresight,h2o", [str(scorer_dir)])
    assert [spec.name for spec in specs] == ["h2o", "foresight"] and notes == []
    assert [spec.name for spec in policy_specs(" foresight ", [str(scorer_dir)])[0]] == ["foresight"]
    everything, notes = policy_specs("all", [str(scorer_dir)])
    assert [spec.name for spec in everything].count("foresight") == 1
    assert not any(note.startswith("foresight") for note in notes)
    assert any(note.startswith("foresight: skipped") and "--scorer DIR" in note for note in policy_specs("all", [])[1])
    with pytest.raises(ValueError, match="policy 'foresight' needs a trained scorer: give --scorer DIR"):
        policy_specs("h2o,foresight", [])


def test_a_scorer_row_takes_the_learned_policys_own_options(scorer_dir):
    """-o NAME.KEY=VALUE reaches the learned policy of that --scorer row, typed; its cadence keys, an unknown key and
    a bad value are refused in one line naming the row."""
    (spec,) = policy_specs("foresight", [f"mine={scorer_dir}"], ["mine.stream_block=1", "mine.observation=window"])[0]
    assert spec.settings() == {"stream_block": 1, "observation": "window"}
    policy = spec.build(None)
    assert (policy.stream_block, policy.observation) == (1, "window")
    (heuristic, learned) = policy_specs("foresight,h2o", [f"mine={scorer_dir}"], ["mine.stream_block=2"])[0]
    assert heuristic.options == () and learned.build(None).stream_block == 2
    for option, error in (
        ("mine.sinks=4", "-o mine.sinks: only a heuristic that evicts takes it"),
        ("mine.budget=4", "policy 'mine' has no option 'budget'"),
        ("mine.stream_block=four", "policy 'mine' option stream_block expects"),
        ("other.stream_block=1", "--policies names no heuristic to take options .* rows: mine"),
    ):
        with pytest.raises(ValueError, match=error):
            policy_specs("foresight", [f"mine={scorer_dir}"], [option])


def test_eval_runs_foresight_and_a_heuristic_from_a_scorer_folder(traces_dir, scorer_dir, model, tmp_path, monkeypatch):
    monkeypatch.setattr("foresight.commands.eval.load_model", lambda name, **options: (model, None))
    out = tmp_path / "eval"
    argv = [
        "eval",
        "--traces",
        str(traces_dir),
        "--policies",
        "foresight,h2o",
        "--scorer",
        str(scorer_dir),
        "-B",
        str(B),
        "-L",
        str(L),
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    rows = json.loads((out / "results.json").read_text())
    assert sorted(row["policy"] for row in rows) == ["foresight", "h2o"]


def test_generate_samples_the_learned_policy_through_its_options(scorer_dir, model, monkeypatch, capsys):
    """`--scorer DIR -o mode=sampled -o temperature=0.5 -o seed=3` reach the learned policy with their types, and a
    generation draws its evictions from them: the same seed the same draws, another seed others."""
    from foresight.commands._policy import policy_from_args
    from foresight.runtime.engine import EvictionEngine

    options = ["--scorer", str(scorer_dir), "-o", "mode=sampled", "-o", "temperature=0.5"]
    policy, config = policy_from_args(build_args(["generate", "--policy", "foresight", *options, "-o", "seed=3", "hi"]))
    assert (policy.mode, policy.temperature, policy.seed, policy.record) == ("sampled", 0.5, 3, True)
    assert type(policy.seed) is int and (config.sinks, config.protect_prompt) == (None, None)  # the policy's own: none
    engines = []

    class Kept(EvictionEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr("foresight.commands.generate.load_model", lambda name, **kw: (model, char_tokenizer()))
    monkeypatch.setattr("foresight.commands.generate.EvictionEngine", Kept)

    def generate(option: str) -> int:
        words = ["generate", "--policy", "foresight", *options, "-o", option, "-B", str(B), "-L", str(L)]
        return main([*words, "--max-new-tokens", "40", "--no-chat-template", "12+34="])

    for seed in (3, 3, 4):
        assert generate(f"seed={seed}") == 0
        assert " 0 eviction steps" not in capsys.readouterr().out.strip().splitlines()[-1]
    draws = [[record.order for record in engine.policy.records] for engine in engines]
    assert draws[0] and all(record.temperature == 0.5 for record in engines[0].policy.records)
    assert all(torch.equal(a, b) for a, b in zip(draws[0], draws[1], strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(draws[0], draws[2]))
    assert generate("record=false") == 0
    assert engines[-1].policy.records == []  # sampled, but nothing kept


# -- help texts ------------------------------------------------------------------------------------
@pytest.mark.parametrize("verb", _verbs())
def test_help_states_each_default_once(verb):
    for parser in verb_parsers(verb):
        options = [
            action
            for action in parser._actions
            if action.option_strings and action.dest != "help" and action.help is not argparse.SUPPRESS
        ]
        assert all(action.help for action in options), "every option explains itself"
        entries = re.split(r"\n(?=  -)", parser.format_help().split("\noptions:\n")[1])
        assert len(entries) == len(options) + 1  # --help, then one entry per option
        for entry in entries:
            text = " ".join(entry.split())
            assert text.count("(default") <= 1, text
            assert "(default: None)" not in text and "(default: [])" not in text and "(default: False)" not in text, (
                text
            )


def test_help_adds_a_default_only_where_the_text_has_none():
    parser = ArgumentParser(prog="foresight generate", formatter_class=HelpFormatter)
    importlib.import_module("foresight.commands.generate").add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "seed of the sampling (default: 0)" in text  # a falsy default is still stated
    assert "(default: the policy's own, see `foresight policies`) --protect-prompt" in text
    assert "encode the prompt as plain text --" not in text and text.endswith("encode the prompt as plain text")


@pytest.mark.slow
def test_generate_on_the_default_model_holds_the_budget(capsys):
    assert (
        main(["generate", "--policy", "snapkv", "-B", "32", "-L", "8", "--max-new-tokens", "48", "What is 17 * 23?"])
        == 0
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    held = int(last.split("largest cache held ")[1].split()[0])
    assert held <= 32 + 8 and "tokens/s" in last


@pytest.mark.slow
def test_short_generation_says_it_did_not_evict(capsys):
    assert main(["generate", "--policy", "h2o", "-B", "512", "-L", "32", "--max-new-tokens", "4", "Hi"]) == 0
    assert "no eviction" in capsys.readouterr().out


@pytest.mark.slow
def test_replay_reports_a_loss_ratio_against_the_full_cache(tmp_path, capsys):
    text = tmp_path / "doc.txt"
    text.write_text(
        " ".join(f"Step {i}: add {i} to the running total and write the new total down." for i in range(12))
    )
    assert main(["replay", "--policy", "streaming", "-B", "32", "-L", "8", str(text)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    ratio = float(last.split("loss ratio ")[1].split()[0])
    assert ratio > 1.0  # dropping most of a structured context must cost something


@pytest.mark.slow
def test_demo_generation_evicts_and_every_heuristic_gets_a_finite_loss_ratio(capsys):
    """The tour's prompt reasons long enough to evict at the given B and L, so no row of its comparison is nan."""
    assert main(["demo", "-B", "64", "-L", "16", "--max-new-tokens", "96"]) == 0
    printed = capsys.readouterr().out
    steps = int(printed.split(" eviction steps")[0].rsplit(", ", 1)[1])
    rows = printed.split("(1.0 = full cache):\n")[1].split("best heuristic")[0].strip().splitlines()
    ratios = [float(row.split()[1]) for row in rows]
    assert steps >= 1 and len(rows) >= 12 and all(math.isfinite(ratio) for ratio in ratios), printed


def test_generate_and_replay_take_the_pooled_layout_as_options():
    """`-o layout=pooled -o allocation=layer` reach the eviction config (they were parsed and dropped before)."""
    args = argparse.Namespace(
        verb="generate", scorer=(), policy="snapkv", option=["layout=pooled", "allocation=layer", "floor=3"]
    )
    args.budget, args.interval, args.sinks, args.protect_prompt = 32, 8, None, None
    _, config = policy_from_args(args)
    assert (config.layout.value, config.allocation.value, config.floor) == ("pooled", "layer", 3)
    args.option = ["layout=pools"]
    with pytest.raises(ValueError, match="unknown layout 'pools'; allowed: 'heads', 'pooled'"):
        policy_from_args(args)
