"""Shared test set-up: one torch thread (tiny models run faster without thread hand-offs) and the
fixtures several test modules use: a tiny Llama, and a tiny model folder with traces sampled from it.
Plain helpers live in modules named for their purpose (prompts, eviction_steps, policy_lists, scorers,
decoding) and the slow twins in reference_*.py; test modules import from those, never from one another.

Float tolerances follow the arithmetic behind the figure, so the suite passes on any CPU:
- A twin (a slow reference, another batching, a stored copy) run on the same machine may be compared
  bit-exactly only where both sides run the same kernels on the same inputs; otherwise float32 sums get
  ~1e-6 relative (more for long or cancelling sums: u = 6e-8 times sqrt(terms) times sum|terms| / |sum|).
- A constant computed once and pinned in a test is checked on other CPUs, whose BLAS sums in another
  order: its tolerance is the rounding of that arithmetic in any order (written beside the pin), or the
  pinned quantity is computed in float64 end to end where a tight pin is the point (test_features's
  older feature sets); never rel=1e-12 on a figure that passed through float32."""

import shutil
from pathlib import Path

import pytest
import torch

from foresight.models import tiny_model
from tests.prompts import CHAT_TEMPLATE, DATA, char_tokenizer, sampled_tiny_traces
from tests.rl_runs import L_, B
from tests.scorers import random_scorer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llama():
    """The tiny random Llama (GQA: 4 query heads, 2 KV heads), built once per test module."""
    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny Llama and a character tokenizer saved as a model folder, so `load_model(folder)` works."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(folder)
    char_tokenizer(CHAT_TEMPLATE).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def traces_dir(tmp_path_factory, tiny_dir) -> Path:
    """Ten sampled traces of the tiny model (about 60-120 tokens each), without labels. Tests that label
    them do so for B=16, L=4 only; a test that needs the folder as it was copies it first."""
    out = tmp_path_factory.mktemp("traces")
    sampled_tiny_traces(str(DATA / "arithmetic.jsonl"), out, num=10, model_name=str(tiny_dir))
    return out


@pytest.fixture
def fresh_traces(tmp_path, traces_dir) -> Path:
    """A copy of `traces_dir` without any labels, for a test that labels or damages files."""
    return Path(shutil.copytree(traces_dir, tmp_path / "traces", ignore=shutil.ignore_patterns("labels-*")))


@pytest.fixture(scope="module")
def peaked_llama():
    """The tiny Llama with peaked attention (a larger init), for tests where attention must discriminate:
    at the default init attention is near uniform, so thresholds pass everything and H2O, summing every
    query, keeps the oldest entries on every head."""
    return tiny_model("llama", initializer_range=0.1)


@pytest.fixture(scope="module")
def start_scorer(tmp_path_factory, tiny_dir) -> Path:
    """A random scorer of the tiny Llama saved as a folder: the reinforcement stage's starting point."""
    folder = tmp_path_factory.mktemp("start") / "scorer"
    random_scorer(tiny_model("llama"), B, L_, base_model=str(tiny_dir)).save_pretrained(folder)
    return folder
