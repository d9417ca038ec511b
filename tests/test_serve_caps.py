"""scripts/serve_caps.py: each decoder's rows under a cap are the largest batch that ran to the end, its throughput
that run's, and the table lists every repeat's rows and the median throughput over them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("serve_caps", Path(__file__).parent.parent / "scripts" / "serve_caps.py")
serve_caps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve_caps)


def run(decoder: str, batch: int, fits: bool, seconds: float | None = None) -> dict:
    return {
        "decoder": decoder,
        "batch": batch,
        "new_tokens": 100,
        "fits": fits,
        "peak_bytes": 0,
        "peak_entries": 0,
        "seconds": seconds,
    }


def test_the_rows_served_are_the_largest_batch_that_ran_to_the_end():
    runs = [run("snapkv", 3, True, 10.0), run("snapkv", 4, True, 16.0), run("snapkv", 5, False), run("full", 1, False)]
    assert serve_caps.served(runs, "snapkv") == (4, 4 * 100 / 16.0)
    assert serve_caps.served(runs, "full") == (0, None)


def test_the_table_lists_every_repeat_and_the_median_throughput():
    repeats = [[run("snapkv", 2, True, 20.0)], [run("snapkv", 2, True, 10.0)], [run("snapkv", 3, True, 10.0)]]
    rows = serve_caps.table({16: repeats, 24: [[run("full", 1, False)]]}, ["full", "snapkv"])
    assert rows == [["16 MiB", "0 / 0 / 0", "–", "2 / 2 / 3", "20.0"], ["24 MiB", "0", "–", "0", "–"]]


def test_a_finished_run_is_read_back_not_run_again(tmp_path, monkeypatch):
    (tmp_path / "cap16-run1.json").write_text('[{"decoder": "snapkv", "batch": 2}]')
    monkeypatch.setattr(serve_caps.subprocess, "run", lambda *args, **kwargs: pytest.fail("ran the bench again"))
    assert serve_caps.serve(16, None, tmp_path / "cap16-run1") == [{"decoder": "snapkv", "batch": 2}]


def test_each_repeat_starts_with_another_policy(tmp_path, monkeypatch):
    commands = []

    def bench(command, check):
        commands.append(command[command.index("--policies") + 1])
        Path(command[command.index("--results") + 1]).write_text("[]")

    monkeypatch.setattr(serve_caps.subprocess, "run", bench)
    serve_caps.main(["--caps", "16", "--repeats", "3", "--policies", "snapkv,foresight,tova", "--out", str(tmp_path)])
    assert commands == ["snapkv,foresight,tova", "foresight,tova,snapkv", "tova,snapkv,foresight"]
