"""docs/training.md's walk, run as written on a tiny Qwen3 built from a config: only its settings block is
replaced (the tiny model, B = 16, L = 4, short runs) and vLLM's rows are the ones it recorded from that model
(tests/data/vllm-tiny-qwen3.jsonl); then examples/train_evictor.py, the same steps from Python."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from foresight.models import tiny_model
from foresight.scorer.model import load_scorer
from tests.prompts import CHAT_TEMPLATE, char_tokenizer

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "training.md"
RECORDED_ROWS = REPO / "tests" / "data" / "vllm-tiny-qwen3.jsonl"
WALK = re.compile(r"<!-- walk(?:: (\w+))? -->\n```bash\n(.*?)```", re.DOTALL)


def walk_blocks(text: str) -> list[tuple[str | None, str]]:
    """(label, commands) of every block the doc marks as part of its walk, in order."""
    return [(match[1], match[2]) for match in WALK.finditer(text)]


def tiny_qwen3(folder: Path) -> Path:
    """The tiny Qwen3 the recorded vLLM rows were sampled from, saved as a model folder."""
    tiny_model("qwen3", seed=0, head_dim=32).save_pretrained(folder)
    char_tokenizer(CHAT_TEMPLATE).save_pretrained(folder)
    return folder


def shell_environment() -> dict[str, str]:
    """This interpreter's `foresight` first on PATH, one thread per process."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}


def test_the_walk_is_marked_and_its_settings_come_first():
    blocks = walk_blocks(DOC.read_text())
    assert [label for label, _ in blocks][:1] == ["settings"] and len(blocks) >= 6
    verbs = [line.split()[1] for _, text in blocks[1:] for line in text.splitlines() if line.startswith("foresight ")]
    assert verbs == ["traces", "traces", "labels", "labels", "fit", "rl", "eval", "export", "generate"]


@pytest.mark.slow
def test_docs_training_walk_runs_on_a_tiny_qwen3(tmp_path):
    model = tiny_qwen3(tmp_path / "tiny-qwen3")
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(RECORDED_ROWS, run / "train.jsonl")
    shutil.copy(RECORDED_ROWS, run / "heldout.jsonl")
    settings = f"""
MODEL={model} B=16 L=4 RUN={run}
FIT_CONFIG=configs/default.yaml RL_CONFIG=configs/default-rl.yaml
FIT_SET=(--ensemble 1 --set trainer.max_steps=4 --set data.holdout=0.25 --set trainer.enable_progress_bar=false)
RL_SET=(--set trainer.max_steps=1 --set model.group_size=2 --set data.batch_size=1 --set data.holdout=0.25
        --set trainer.enable_progress_bar=false)
"""
    blocks = walk_blocks(DOC.read_text())
    script = "set -euo pipefail\n" + settings + "\n".join(text for _, text in blocks[1:])
    done = subprocess.run(
        ["bash", "-c", script], cwd=REPO, env=shell_environment(), capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for stage in ("fit", "rl", "export"):
        scorer = load_scorer(run / stage / "scorer" if stage != "export" else run / "export")
        assert (scorer.config.budget, scorer.config.interval, scorer.config.base_model) == (16, 4, str(model))
    rows = json.loads((run / "eval" / "results.json").read_text())
    assert {"full", "golden", "snapkv", "fit", "rl"} <= {row["policy"] for row in rows}
    held = re.search(r"largest cache held (\d+) entries, (\d+) eviction steps", done.stdout)
    assert held and int(held[2]) >= 8, done.stdout[-1000:]  # the exported scorer evicts: 64 tokens, a step every L


@pytest.mark.slow
def test_the_example_script_trains_and_evaluates_from_python(tmp_path):
    model = tiny_qwen3(tmp_path / "tiny-qwen3")
    out = tmp_path / "example"
    words = ["--model", str(model), "-B", "16", "-L", "4", "--prompts", "data/arithmetic.jsonl"]
    words += ["--heldout-prompts", "data/arithmetic.jsonl", "--num", "6", "--max-new-tokens", "40", "--out", str(out)]
    words += ["--set", "trainer.max_steps=2", "--set", "data.holdout=0.2", "--set", "trainer.enable_progress_bar=false"]
    done = subprocess.run(
        [sys.executable, "examples/train_evictor.py", *words],
        cwd=REPO,
        env=shell_environment(),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert load_scorer(out / "fit" / "scorer").config.base_model == str(model)
    table = done.stdout
    assert all(re.search(rf"\| {name}\b", table) for name in ("full", "golden", "snapkv", "mine")), table[-2000:]
