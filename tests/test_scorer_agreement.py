"""Kept-set agreement of scorers on one trajectory (`python -m studies scorer-agreement`): a scorer agrees with itself
entirely, two scorers by a loop over their top-k sets, and scorers that read other inputs are refused in one line."""

from __future__ import annotations

import itertools

import pytest
import torch

from foresight.data.trace_store import TraceStore
from foresight.labels import future_score_table
from foresight.models import load_model, tiny_model
from foresight.scorer.ensemble import ensemble
from foresight.scorer.model import load_scorer
from studies.scorer_agreement.run import GOLDEN, Settings, run, trace_agreement
from tests.fit_configs import L_, B
from tests.scorers import random_scorer
from trainers.examples import scorer_steps


@pytest.fixture(scope="module")
def scorers(tmp_path_factory, tiny_dir) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("scorers")
    for seed in (0, 1):
        random_scorer(tiny_model("llama"), B, L_, seed=seed, feature_set="standardised").save_pretrained(
            folder / f"s{seed}"
        )
    return {"a": str(folder / "s0"), "again": str(folder / "s0"), "b": str(folder / "s1")}


def loop_agreement(first: torch.Tensor, second: torch.Tensor, kept: int) -> float:
    """Mean over problems of |top-k(first) ∩ top-k(second)| / k, one problem at a time."""
    shares = []
    for index in itertools.product(*(range(size) for size in first.shape[:-1])):
        mine = set(first[index].topk(kept).indices.tolist())
        theirs = set(second[index].topk(kept).indices.tolist())
        shares.append(len(mine & theirs) / kept)
    return sum(shares) / len(shares)


def test_agreement_equals_a_loop_and_a_scorer_agrees_with_itself(scorers, traces_dir, tiny_dir, tmp_path):
    loaded = {name: load_scorer(folder) for name, folder in scorers.items()}
    model, _ = load_model(str(tiny_dir))
    trace = next(t for t in TraceStore(traces_dir) if t.input_ids.numel() >= B + 3 * L_)
    table = future_score_table(model, trace.input_ids, B, L_, regime="decode", prompt_length=trace.prompt_length)
    (steps,) = scorer_steps(model, [trace], [table], loaded["a"], torch.float32, "decode")
    found = trace_agreement(loaded, steps, B - L_)
    assert found[("a", "again")] == 1.0
    inputs = [steps[name].transpose(0, 1) for name in ("keys", "values", "features")]
    scores = {name: scorer(*inputs).transpose(0, 1) for name, scorer in loaded.items()}
    assert found[("a", "b")] == pytest.approx(loop_agreement(scores["a"], scores["b"], B - L_), abs=1e-6)
    assert found[("a", "b")] < 1.0
    golden = loop_agreement(scores["b"], steps["alpha"], B - L_)
    assert found[("b", GOLDEN)] == pytest.approx(golden, abs=1e-6)
    report = run(Settings(traces=traces_dir, scorer=tuple(f"{n}={f}" for n, f in scorers.items()), max_traces=3))
    assert "| a · again | 1.000 [1.000, 1.000] |" in report and "| b · golden |" in report


def test_fewer_than_two_or_unlike_scorers_are_refused_in_one_line(scorers, traces_dir, tmp_path):
    with pytest.raises(ValueError, match="compare at least two scorers, got 1"):
        Settings(traces=traces_dir, scorer=(f"a={scorers['a']}",))
    random_scorer(tiny_model("llama"), 2 * B, L_, feature_set="standardised").save_pretrained(tmp_path / "wide")
    settings = Settings(traces=traces_dir, scorer=(f"a={scorers['a']}", f"wide={tmp_path / 'wide'}"))
    with pytest.raises(ValueError, match=r"scorer wide reads other inputs than a \(budget differ\)") as error:
        run(settings)
    assert "\n" not in str(error.value)


def test_a_split_ensembles_members_agree_with_the_scorers_it_averaged(scorers, traces_dir, tmp_path):
    ensemble([load_scorer(scorers["a"]), load_scorer(scorers["b"])]).save_pretrained(tmp_path / "ens")
    settings = Settings(
        traces=traces_dir, scorer=(f"ens={tmp_path / 'ens'}", f"a={scorers['a']}"), split="ens=2", max_traces=2
    )
    report = run(settings)
    assert "| a · ens.member-0 | 1.000 [1.000, 1.000] |" in report
    assert "| a · ens.member-1 | 1.000" not in report
    with pytest.raises(ValueError, match=r"--split 'a=x' must be NAME=K with NAME one of the scorers \(ens, a\)"):
        Settings(traces=traces_dir, scorer=settings.scorer, split="a=x")
