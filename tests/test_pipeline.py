"""The steps that make the supervised stage's data (`trainers.data_stage`, `trainers.preparation`) and their verbs: resuming,
replacing damaged files, refusing a example cache made with another key, and loading no model when
there is nothing to do."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from foresight import cli
from foresight.data.trace_store import TraceStore
from foresight.labels import LabelStore
from foresight.models import load_model
from tests.prompts import DATA
from trainers import data_stage
from trainers.data import GoldenDataModule
from trainers.data_stage import FrozenModel, TraceRecipe, make_labels
from trainers.example_cache import ExampleCache, ExampleKey
from trainers.examples import golden_steps
from trainers.preparation import make_examples

B, L_ = 16, 4


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """The names of the models the pipeline loads during a test."""
    names = []

    def counting(name, **options):
        names.append(str(name))
        return load_model(name, **options)

    monkeypatch.setattr(data_stage, "load_model", counting)
    return names


def key(tiny_dir: Path, **changes) -> ExampleKey:
    settings = (
        dict(
            model=str(tiny_dir),
            model_dtype="float32",
            budget=B,
            interval=L_,
            feature_set="paper",
            storage_dtype="float16",
        )
        | changes
    )
    return ExampleKey(**settings)


def data_module(traces: Path, tiny_dir: Path, features: Path | None, **changes) -> GoldenDataModule:
    settings = dict(model=str(tiny_dir), budget=B, interval=L_, holdout=0.2, batch_size=2) | changes
    return GoldenDataModule(str(traces), examples_dir=None if features is None else str(features), **settings)


def one_line_error(call) -> str:
    with pytest.raises(ValueError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message
    return message


def contents(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors (copied out of the memory map) and metadata of a safetensors file."""
    with safe_open(path, framework="pt") as handle:
        return {name: handle.get_tensor(name).clone() for name in handle.keys()}, handle.metadata()


def truncate(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Cut the file in half, as a killed copy would; return what it held."""
    held = contents(path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return held


def assert_same(path: Path, held: tuple[dict[str, torch.Tensor], dict[str, str]], **tolerance: float) -> None:
    tensors, metadata = contents(path)
    assert metadata == held[1] and tensors.keys() == held[0].keys()
    for name, tensor in tensors.items():
        torch.testing.assert_close(tensor, held[0][name], **tolerance)


def test_verbs_resume_and_replace_damaged_files(fresh_traces, tiny_dir, loads, capsys):
    labels_args = ["labels", "--traces", str(fresh_traces), "-B", str(B), "-L", str(L_)]
    assert cli.main(labels_args) == 0
    assert f"labelled {len(TraceStore(fresh_traces))} traces, skipped 0 too short" in capsys.readouterr().out
    store = LabelStore(fresh_traces, B, L_)
    trace = TraceStore(fresh_traces)[3]
    damaged = store.path(trace.index)
    original = truncate(damaged)
    error = one_line_error(lambda: store.load(trace.index, num_tokens=trace.input_ids.numel()))
    assert (
        f"{damaged} is damaged" in error
        and f"`foresight labels --traces {fresh_traces} --budget 16 --interval 4`" in error
    )
    assert cli.main(labels_args) == 0
    assert "labelled 1 traces (1 replacing damaged files)" in capsys.readouterr().out
    assert_same(damaged, original, rtol=0, atol=0)  # labelling is deterministic: the same file again

    features = fresh_traces.parent / "examples"
    cache = ExampleCache(features, fresh_traces, key(tiny_dir))
    assert (
        cli.main(["examples", "--traces", str(fresh_traces), "-B", str(B), "-L", str(L_), "--out", str(features)]) == 0
    )
    assert f"made the examples of {len(TraceStore(fresh_traces))} traces" in capsys.readouterr().out
    trace = TraceStore(fresh_traces)[5]
    original = truncate(cache.path(trace.index))
    error = one_line_error(lambda: data_module(fresh_traces, tiny_dir, features).setup())
    assert f"{cache.path(trace.index)} is damaged" in error and cache.remake_command in error
    assert cli.main(shlex.split(cache.remake_command.strip("`"))[1:]) == 0  # the command the error names
    assert "made the examples of 1 traces (1 replacing damaged files)" in capsys.readouterr().out
    assert_same(cache.path(trace.index), original)  # replayed alone now, in a batch of 4 before: float16 ulps
    module = data_module(fresh_traces, tiny_dir, features)
    module.setup()
    assert len(module.train) + len(module.val) == len(TraceStore(fresh_traces))
    assert loads == [str(tiny_dir)] * 4  # one load per verb run that had work to do


@pytest.fixture(scope="module")
def made(tmp_path_factory, traces_dir, tiny_dir) -> tuple[Path, ExampleCache]:
    """A labelled copy of the traces and its example cache (read-only for the tests that use it)."""
    traces = Path(
        shutil.copytree(
            traces_dir, tmp_path_factory.mktemp("made") / "traces", ignore=shutil.ignore_patterns("labels-*")
        )
    )
    frozen = FrozenModel(str(tiny_dir))
    make_labels(frozen, traces, B, L_, progress=False)
    cache = ExampleCache(traces.parent / "examples", traces, key(tiny_dir))
    make_examples(frozen, cache, replay_batch_size=3, progress=False)
    return traces, cache


def test_cached_examples_are_the_replayed_ones_in_the_storage_dtype(made, tiny_dir):
    traces, cache = made
    trace = TraceStore(traces)[2]
    labels = LabelStore(traces, B, L_).load(trace.index, num_tokens=trace.input_ids.numel())
    (replayed,) = golden_steps(load_model(tiny_dir)[0], [trace], [labels], storage_dtype=torch.float16)
    cached = load_file(cache.path(trace.index))
    assert cached.keys() == replayed.keys()
    for name, tensor in replayed.items():
        assert cached[name].dtype == (torch.float32 if name == "alpha" else torch.float16)
        torch.testing.assert_close(cached[name], tensor)  # replayed in a batch of 3 there, alone here: float16 ulps


@pytest.mark.parametrize(
    ("change", "stored"),
    [
        ({"storage_dtype": "float32"}, "storage_dtype 'float16' (asked: 'float32')"),
        ({"feature_set": "official-8"}, "feature_set 'paper' (asked: 'official-8')"),
        ({"budget": 20}, "budget '16' (asked: '20')"),
        ({"dtype": "bfloat16"}, "model_dtype 'float32' (asked: 'bfloat16')"),
    ],
)
def test_a_feature_cache_of_another_key_is_refused(made, tiny_dir, change, stored, loads):
    traces, cache = made
    before = {path.name: path.stat().st_mtime_ns for path in cache.directory.iterdir()}
    module = data_module(traces, tiny_dir, cache.directory, **change)
    error = one_line_error(module.setup)
    assert error.startswith(f"{cache.directory} holds features made with {stored}; remove that folder or pick another")
    assert module.examples.remake_command in error
    other = FrozenModel(str(tiny_dir), dtype=module.frozen.dtype)
    assert one_line_error(lambda: make_examples(other, module.examples, progress=False)) == error
    assert {path.name: path.stat().st_mtime_ns for path in cache.directory.iterdir()} == before
    assert loads == []  # the refused step loaded nothing


def test_features_need_labels_and_the_model_that_made_the_traces(fresh_traces, tiny_dir, loads):
    cache = ExampleCache(fresh_traces.parent / "examples", fresh_traces, key(tiny_dir))
    error = one_line_error(lambda: make_examples(FrozenModel(str(tiny_dir)), cache, progress=False))
    assert (
        "golden labels of trace" in error
        and f"`foresight labels --traces {fresh_traces} --budget 16 --interval 4`" in error
    )
    other = ExampleCache(cache.directory, fresh_traces, key(tiny_dir, model="another"))
    error = one_line_error(lambda: make_examples(FrozenModel("another"), other, progress=False))
    assert error == f"the traces in {fresh_traces} were made by {str(tiny_dir)!r}, not by the model 'another'"
    error = one_line_error(lambda: make_labels(FrozenModel("another"), fresh_traces, B, L_, progress=False))
    assert "not by the model 'another'" in error
    assert loads == []


def test_a_complete_traces_folder_loads_no_model(tmp_path, tiny_dir, loads, capsys):
    args = [
        "traces",
        "--model",
        str(tiny_dir),
        "--prompts",
        str(DATA / "arithmetic.jsonl"),
        "--num",
        "3",
        "--max-new-tokens",
        "8",
        "--shard-size",
        "2",
        "--out",
        str(tmp_path / "traces"),
    ]
    assert cli.main(args) == 0
    assert "2 shard(s) written, 0 already complete" in capsys.readouterr().out
    assert cli.main(args) == 0
    assert "0 shard(s) written, 2 already complete" in capsys.readouterr().out
    assert cli.main([*args, "--seed", "1"]) == 2  # other settings are refused, before any load
    assert "made with other settings (seed=0, not 1)" in capsys.readouterr().err
    assert loads == [str(tiny_dir)]
    recipe = TraceRecipe(str(DATA / "arithmetic.jsonl"), num=3, max_new_tokens=8, shard_size=2)
    assert recipe.settings(str(tiny_dir)).__dict__ == TraceStore(tmp_path / "traces").settings
