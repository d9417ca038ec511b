"""Labelling and example making that scale out: processes on one traces folder share its traces by per-trace
claims (`foresight.artifacts.claimed` in `trainers.data_stage.make_labels`), processes on one example cache its
replay batches (`trainers.preparation.make_examples`)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from foresight.artifacts import claimed
from foresight.commands.labels import rank_placement
from foresight.data.trace_store import TraceStore
from foresight.labels import LabelStore
from trainers.data_stage import FrozenModel, make_labels
from trainers.example_cache import ExampleCache, ExampleKey
from trainers.preparation import make_examples

B, L_ = 16, 4
HOLD_A_CLAIM = """
import sys, time
from pathlib import Path
from foresight.artifacts import claimed
from foresight.commands.labels import rank_placement
holding = claimed([0], lambda item: Path(sys.argv[1]), lambda item: False)
next(holding)
print("claimed", flush=True)
time.sleep(600)
"""


LABELLER = """
import json, sys, time
from pathlib import Path
from trainers import data_stage

traces, model, me, other = sys.argv[1:]
compute = data_stage.compute_golden_labels

def meeting_once(*args, **kwargs):
    # this process's first trace waits until the other has claimed one too: both hold a claim at once
    if not Path(me).exists():
        Path(me).touch()
        deadline = time.monotonic() + 120
        while not Path(other).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    return compute(*args, **kwargs)

data_stage.compute_golden_labels = meeting_once
summary = data_stage.make_labels(data_stage.FrozenModel(model), traces, 16, 4, progress=False)
print(json.dumps({"made": summary.made, "by_others": summary.by_others, "line": summary.describe()}))
"""


EXAMPLER = """
import json, sys, time
from pathlib import Path
from trainers import preparation
from trainers.example_cache import ExampleCache, ExampleKey

traces, model, out, me, other = sys.argv[1:]
replay, replayed = preparation.golden_steps, []

def meeting_once(frozen, group, *args, **kwargs):
    # this process's first batch waits until the other has claimed one too: both hold a claim at once
    if not Path(me).exists():
        Path(me).touch()
        deadline = time.monotonic() + 120
        while not Path(other).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    replayed.extend(trace.index for trace in group)
    return replay(frozen, group, *args, **kwargs)

preparation.golden_steps = meeting_once
cache = ExampleCache(out, traces, ExampleKey(model, "float32", 16, 4, "paper", "float16"))
preparation.make_examples(preparation.FrozenModel(model), cache, replay_batch_size=2, progress=False)
print(json.dumps(replayed))
"""


def meeting_pair(script: str, args: list[str], folder: Path, env: dict[str, str]) -> tuple:
    """The JSON that two processes of `script` print, started together on the same `args`, each also given its own
    meeting file and the other's (so that both hold a claim at once); both must exit with 0."""
    names = ("a", "b")
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", script, *args, str(folder / me), str(folder / other)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for me, other in (names, names[::-1])
    ]
    printed = [json.loads(process.communicate(timeout=300)[0]) for process in processes]
    assert all(process.returncode == 0 for process in processes)
    return tuple(printed)


def label_files(traces: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(LabelStore(traces, B, L_).directory.iterdir())}


def test_two_labelling_processes_split_a_folder_and_write_one_processs_files(
    fresh_traces, traces_dir, tmp_path, tiny_dir
):
    alone = Path(shutil.copytree(traces_dir, tmp_path / "alone", ignore=shutil.ignore_patterns("labels-*")))
    single = make_labels(FrozenModel(str(tiny_dir)), alone, B, L_, progress=False)
    env = {  # the same thread count as this process's labelling, so the files can be byte-identical
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
    }
    a, b = meeting_pair(LABELLER, [str(fresh_traces), str(tiny_dir)], tmp_path, env)
    assert a["made"] and b["made"] and not set(a["made"]) & set(b["made"])  # each labelled some, none twice
    assert sorted(a["made"] + b["made"]) == list(single.made) == [trace.index for trace in TraceStore(fresh_traces)]
    assert (a["by_others"], b["by_others"]) == (len(b["made"]), len(a["made"]))
    assert f"labelled {len(a['made'])} traces, {len(b['made'])} by other processes" in a["line"]
    together = label_files(fresh_traces)
    assert together == label_files(alone)
    assert not any(name.endswith(".claim") for name in together)  # claims are gone once their traces are done


def test_two_processes_on_one_example_cache_split_its_batches(fresh_traces, tmp_path, tiny_dir):
    frozen = FrozenModel(str(tiny_dir))
    make_labels(frozen, fresh_traces, B, L_, progress=False)
    key = ExampleKey(str(tiny_dir), "float32", B, L_, "paper", "float16")
    make_examples(frozen, ExampleCache(tmp_path / "alone", fresh_traces, key), replay_batch_size=2, progress=False)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    a, b = meeting_pair(EXAMPLER, [str(fresh_traces), str(tiny_dir), str(tmp_path / "shared")], tmp_path, env)
    assert a and b and not set(a) & set(b)  # each replayed some batches, no trace twice
    files = {path.name for path in (tmp_path / "alone").glob("trace-*.safetensors")}
    assert {f"trace-{index:06d}.safetensors" for index in a + b} == files
    assert {path.name for path in (tmp_path / "shared").glob("trace-*.safetensors")} == files
    assert not list((tmp_path / "shared").glob(".*.claim"))  # claims are gone once their batches are done


def test_a_killed_labellers_claim_is_taken_over(fresh_traces, tiny_dir):
    store = LabelStore(fresh_traces, B, L_)
    claim = store.claim_path(TraceStore(fresh_traces)[3].index)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_CLAIM, str(claim)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout.readline().strip() == "claimed"
        with open(claim, "rb") as handle, pytest.raises(BlockingIOError):
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while its process lives
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert claim.exists()  # a killed process leaves its claim file behind
    summary = make_labels(FrozenModel(str(tiny_dir)), fresh_traces, B, L_, progress=False)
    traces = [trace.index for trace in TraceStore(fresh_traces)]
    assert list(summary.made) == traces and summary.by_others == 0
    assert all(store.problem(t.index, num_tokens=t.input_ids.numel()) is None for t in TraceStore(fresh_traces))
    assert not claim.exists()


def test_claimed_skips_done_items_and_releases_a_claim_when_the_caller_fails(tmp_path):
    done = {1}
    claim_file = lambda item: tmp_path / f"{item}.claim"  # noqa: E731
    assert list(claimed(range(3), claim_file, lambda item: item in done)) == [0, 2]
    failing = claimed([5], claim_file, lambda item: False)
    next(failing)
    failing.close()  # the caller stopped (an exception) before making item 5: its claim is free, the file stays
    assert (tmp_path / "5.claim").exists()
    assert list(claimed([5], claim_file, lambda item: False)) == [5]


def test_a_torchrun_rank_labels_on_its_own_gpu(monkeypatch):
    options = {"device": "cuda", "dtype": "bfloat16"}
    assert rank_placement(options) == options
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_placement(options) == {"device": "cuda:3", "dtype": "bfloat16"}
    assert rank_placement({"device": "cuda:1"}) == {"device": "cuda:1"} and rank_placement({"device": "cpu"}) == {
        "device": "cpu"
    }
