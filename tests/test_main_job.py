"""scripts/main.sh reads its traces from data/corpus/gsm-main: the recipe its `foresight fit` line asks for
(configs/default.yaml's `traces` section under the script's `--set traces.*` overrides) must find that
folder complete, or the job would sample its traces again (or refuse the folder as made otherwise)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from foresight.data.trace_store import finished_run
from trainers.data_stage import TraceRecipe

REPO = Path(__file__).resolve().parents[1]


def test_the_main_jobs_recipe_finds_the_shipped_traces_complete():
    script = (REPO / "scripts" / "main.sh").read_text()
    assert "cp -r data/corpus/gsm-main" in script
    recipe = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())["traces"]
    overrides = dict(re.findall(r"--set traces\.(\w+)=(\S+)", script))
    assert set(overrides) == {"num", "max_new_tokens", "batch_size"}
    recipe.update({name: yaml.safe_load(value) for name, value in overrides.items()})
    summary = finished_run(REPO / "data" / "corpus" / "gsm-main", TraceRecipe(**recipe).settings("default", "cpu"))
    assert summary is not None and summary.shards_written == 0
    assert (summary.counts.generated, summary.counts.kept, summary.counts.tokens) == (24, 19, 8578)
