"""The pooled layout as rows of `foresight eval` (`-o ROW.layout=pooled`, `-o ROW.allocation=layer`), a heuristic's or
a learned scorer's: per head it is its per-head twin's row, its memory column counts the owner tag, and what the pool
does not run is refused in one line before any replay."""

from __future__ import annotations

import json

import pytest

from foresight import cli
from foresight.models import tiny_model
from tests.fit_configs import L_, B
from tests.scorers import random_scorer


def rows(folder) -> dict[str, dict]:
    return {row["policy"]: row for row in json.loads((folder / "results.json").read_text())}


def assert_pooled_rows(found: dict[str, dict], per_head: str, pooled: str, ada: str) -> None:
    """A row per head, its pooled twin (allocation 'head') and AdaKV's allocation on the pool: the twin has the same
    loss ratio and golden overlap and one byte a slot more memory; AdaKV's row the same memory, other evictions."""
    per_head, pooled, ada = found[per_head], found[pooled], found[ada]
    assert pooled["loss_ratio"] == pytest.approx(per_head["loss_ratio"], abs=1e-5)
    assert per_head["golden_overlap"] is not None
    assert pooled["golden_overlap"] == pytest.approx(per_head["golden_overlap"], abs=1e-12)
    assert pooled["kv_mib"] > per_head["kv_mib"] == pytest.approx(pooled["kv_mib"], rel=0.01)
    assert ada["kv_mib"] == pooled["kv_mib"] and ada["loss_ratio"] != pooled["loss_ratio"]


def test_pooled_rows_of_eval(fresh_traces, tiny_dir, tmp_path, capsys):
    """With golden's labels made, so the golden-overlap column reads each head's entries of the pool too."""
    assert (
        cli.main(["labels", "--traces", str(fresh_traces), "--model", str(tiny_dir), "-B", str(B), "-L", str(L_)]) == 0
    )
    out, traces_dir = tmp_path / "eval", fresh_traces
    words = ["eval", "--traces", str(traces_dir), "--model", str(tiny_dir), "-B", str(B), "-L", str(L_)]
    words += ["--policies", "full,snapkv,snapkv-pool=snapkv,snapkv-ada=snapkv", "--out", str(out), "--max-traces", "4"]
    words += ["-o", "snapkv-pool.layout=pooled", "-o", "snapkv-ada.layout=pooled", "-o", "snapkv-ada.allocation=layer"]
    assert cli.main(words) == 0
    assert_pooled_rows(rows(out), "snapkv", "snapkv-pool", "snapkv-ada")
    refused = [*words[:-10], "--policies", "h2o", "--out", str(tmp_path / "no"), "-o", "h2o.layout=pooled"]
    assert cli.main(refused) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "layout='pooled' does not run policy 'h2o' yet" in error
    assert not (tmp_path / "no" / "replays").exists()


def test_pooled_rows_of_a_learned_scorer(fresh_traces, tiny_dir, tmp_path, capsys):
    """Three --scorer rows of one calibrated scorer: per head, pooled (its twin: the same loss ratio, the owner tag's
    bytes on top) and pooled at allocation 'layer' (other evictions, the same bytes). An ordinal scorer at allocation
    'layer' and the sampled rows of a pooled row are refused in one line before any replay."""
    folders = {}
    for scale in ("log-target", "ordinal"):
        folders[scale] = tmp_path / scale
        scorer = random_scorer(
            tiny_model("llama"), B, L_, base_model=str(tiny_dir), feature_set="standardised", scale=scale
        )
        scorer.save_pretrained(folders[scale])
    assert (
        cli.main(["labels", "--traces", str(fresh_traces), "--model", str(tiny_dir), "-B", str(B), "-L", str(L_)]) == 0
    )
    words = ["eval", "--traces", str(fresh_traces), "--model", str(tiny_dir), "-B", str(B), "-L", str(L_)]
    words += ["--policies", "full", "--max-traces", "4"]
    out = tmp_path / "eval"
    given = [word for row in ("mine", "pool", "ada") for word in ("--scorer", f"{row}={folders['log-target']}")]
    given += ["-o", "pool.layout=pooled", "-o", "ada.layout=pooled", "-o", "ada.allocation=layer"]
    assert cli.main([*words, *given, "--out", str(out)]) == 0
    assert_pooled_rows(rows(out), "mine", "pool", "ada")
    for index, (scale, extra, message) in enumerate(
        (
            (
                "ordinal",
                ["-o", "x.allocation=layer"],
                "-o x.layout=pooled: allocation='layer' ranks keep scores across ",
            ),
            (
                "log-target",
                ["--sampled-seeds", "2"],
                "--sampled-seeds: row 'x' runs on layout='pooled', which does not",
            ),
        )
    ):
        refused = tmp_path / f"refused-{index}"
        given = ["--scorer", f"x={folders[scale]}", "-o", "x.layout=pooled", *extra, "--out", str(refused)]
        assert cli.main([*words, *given]) == 2
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert message in error
        assert not (refused / "replays").exists()
