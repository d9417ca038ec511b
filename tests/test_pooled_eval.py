"""The pooled layout as rows of `foresight eval` (`-o ROW.layout=pooled`, `-o ROW.allocation=layer`): per head it is
its per-head twin's row, its memory column counts the owner tag, and a policy the pool does not run is refused
in one line before any replay."""

from __future__ import annotations

import json

import pytest

from foresight import cli
from tests.fit_configs import L_, B


def rows(folder) -> dict[str, dict]:
    return {row["policy"]: row for row in json.loads((folder / "results.json").read_text())}


def test_pooled_rows_of_eval(traces_dir, tiny_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    words = ["eval", "--traces", str(traces_dir), "--model", str(tiny_dir), "-B", str(B), "-L", str(L_)]
    words += ["--policies", "full,snapkv,snapkv-pool=snapkv,snapkv-ada=snapkv", "--out", str(out), "--max-traces", "4"]
    words += ["-o", "snapkv-pool.layout=pooled", "-o", "snapkv-ada.layout=pooled", "-o", "snapkv-ada.allocation=layer"]
    assert cli.main(words) == 0
    found = rows(out)
    per_head, pooled, ada = found["snapkv"], found["snapkv-pool"], found["snapkv-ada"]
    assert pooled["loss_ratio"] == pytest.approx(per_head["loss_ratio"], abs=1e-5)
    assert pooled["kv_mib"] > per_head["kv_mib"] == pytest.approx(pooled["kv_mib"], rel=0.01)  # one byte a slot
    assert ada["kv_mib"] == pooled["kv_mib"] and ada["loss_ratio"] != pooled["loss_ratio"]
    refused = [*words[:-10], "--policies", "h2o", "--out", str(tmp_path / "no"), "-o", "h2o.layout=pooled"]
    assert cli.main(refused) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "layout='pooled' does not run policy 'h2o' yet" in error
    assert not (tmp_path / "no" / "replays").exists()
