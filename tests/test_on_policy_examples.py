"""On-policy examples (`trainers.examples.scorer_steps`): the learned scorer's own trajectory, each
candidate labelled with its future score from the full-cache table (`future_score_table`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from foresight.bench.common import random_scorer
from foresight.data.trace_store import TraceStore
from foresight.labels import compute_golden_labels, future_score_table
from foresight.models import describe, tiny_model
from foresight.policies import make_policy
from foresight.runtime.policy import EvictionContext, Policy
from foresight.scorer.model import ForesightScorer
from trainers.example_cache import GOLDEN_TRAJECTORY, ExampleCache, ExampleKey
from trainers.examples import FutureTargets, StepRecorder, _replay, golden_steps, scorer_steps
from trainers.preparation import scorer_trajectory

B, L_ = 16, 4


def _scorer(model, feature_set: str = "standardised", seed: int = 0) -> ForesightScorer:
    return random_scorer(model, B, L_, seed=seed, base_model="tiny", feature_set=feature_set)


def _longest(traces_dir, count: int):
    return sorted(TraceStore(traces_dir), key=lambda trace: trace.input_ids.numel())[-count:]


def test_future_table_holds_the_labels_alpha_at_the_golden_candidates(traces_dir):
    model = tiny_model("llama")
    (trace,) = _longest(traces_dir, 1)
    labels = compute_golden_labels(model, trace.input_ids, B, L_)
    table = future_score_table(model, trace.input_ids, B, L_)
    assert table.shape[:3] == labels.alpha.shape[:3]
    torch.testing.assert_close(table.gather(-1, labels.candidates.long()), labels.alpha, rtol=0, atol=0)


def test_future_targets_on_the_golden_trajectory_equal_the_golden_examples(traces_dir):
    """The same golden replay labelled from the tables instead of the labels records the same examples."""
    model = tiny_model("llama")
    traces = _longest(traces_dir, 2)
    labels = [compute_golden_labels(model, trace.input_ids, B, L_) for trace in traces]
    tables = [future_score_table(model, trace.input_ids, B, L_) for trace in traces]
    expected = golden_steps(model, traces, labels, "standardised", torch.float32)
    recorder = StepRecorder(
        make_policy("golden", labels=labels), FutureTargets(tables, B, L_), "standardised", torch.float32
    )
    for got, want in zip(_replay(model, traces, recorder), expected):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


@dataclass
class _PositionSpy(Policy):
    """The learned policy, noting each step's candidate positions (the slow reference of what it saw)."""

    name = "spy"
    summary = "records candidate positions"
    needs_attention = True
    inner: Policy = None
    seen: list = field(default_factory=list)

    @property
    def state_fields(self):
        return self.inner.state_fields

    @property
    def buffered_query_dtype(self):
        return self.inner.buffered_query_dtype

    @property
    def observed_queries(self):
        return self.inner.observed_queries

    @property
    def stream_block(self):
        return self.inner.stream_block

    def stream_observe(self, contexts):
        return self.inner.stream_observe(contexts)

    def reset(self) -> None:
        self.inner.reset()

    def observe(self, context: EvictionContext):
        return self.inner.observe(context)

    def keep_scores(self, context: EvictionContext):
        features = self.inner.observed_features(context).clone()
        self.seen.append((context.layer_idx, context.candidate_positions.clone(), features))
        return self.inner.keep_scores(context)


def test_scorer_steps_follow_the_scorer_and_read_alpha_at_its_candidates(traces_dir):
    model = tiny_model("llama")
    (trace,) = _longest(traces_dir, 1)
    scorer = _scorer(model)
    table = future_score_table(model, trace.input_ids, B, L_)
    (example,) = scorer_steps(model, [trace], [table], scorer, torch.float32)
    labels = compute_golden_labels(model, trace.input_ids, B, L_)
    assert example["alpha"].shape == labels.alpha.shape

    from foresight.runtime.engine import EvictionConfig, EvictionEngine

    spy = _PositionSpy(inner=make_policy("foresight", scorer=scorer))
    EvictionEngine(model, spy, EvictionConfig(B, L_, sinks=0, protect_prompt=False)).replay(
        [trace.input_ids], [min(B + L_, trace.prompt_length)]
    )
    layers = describe(model).num_layers
    assert len(spy.seen) == labels.num_steps * layers
    off_golden = 0
    for index, (layer, positions, features) in enumerate(spy.seen):
        step = index // layers
        want = table[step, layer].gather(-1, positions[0].long())
        torch.testing.assert_close(example["alpha"][step, layer], want, rtol=0, atol=0)
        torch.testing.assert_close(example["features"][step, layer], features[0], rtol=0, atol=0)  # what it scored
        off_golden += int((positions[0].long() != labels.candidates[step, layer].long()).any())
    assert off_golden > 0  # a random scorer leaves the golden trajectory, so the states are new


def test_scorer_steps_refuse_a_table_of_another_cadence(traces_dir):
    """The replay runs on the scorer's (B, L); tables made for another cadence are refused."""
    model = tiny_model("llama")
    (trace,) = _longest(traces_dir, 1)
    with pytest.raises(ValueError, match="steps"):
        scorer_steps(model, [trace], [future_score_table(model, trace.input_ids, B, 2 * L_)], _scorer(model))


def test_the_trajectory_names_the_weights():
    model = tiny_model("llama")
    one, same, other = _scorer(model, seed=0), _scorer(model, seed=0), _scorer(model, seed=1)
    assert scorer_trajectory(one) == scorer_trajectory(same) != scorer_trajectory(other)
    assert scorer_trajectory(one).startswith("scorer:")


def test_a_cache_keeps_the_trajectory_it_was_made_for(tmp_path, traces_dir):
    key = ExampleKey("tiny", "float32", B, L_, "standardised", "float32")
    assert key.trajectory == GOLDEN_TRAJECTORY
    on_policy = ExampleCache(tmp_path / "round", traces_dir, key.__class__(**{**vars(key), "trajectory": "scorer:ab"}))
    on_policy.claim()
    opened = ExampleCache.of_trajectory(tmp_path / "round", traces_dir, key)
    assert opened.key.trajectory == "scorer:ab"
    with pytest.raises(ValueError, match="trajectory 'scorer:ab'"):
        ExampleCache(tmp_path / "round", traces_dir, key).check_key()
    with pytest.raises(ValueError, match="holds no examples"):
        ExampleCache.of_trajectory(tmp_path / "missing", traces_dir, key)


def test_a_learned_driver_is_recorded_with_the_features_it_computed(traces_dir, monkeypatch):
    """The recorder reads the learned policy's own features (computed once per step and layer), and
    refuses a scorer whose feature set is not the recorded one."""
    import trainers.examples as examples

    model = tiny_model("llama")
    (trace,) = _longest(traces_dir, 1)
    table = future_score_table(model, trace.input_ids, B, L_)
    calls = []
    monkeypatch.setattr(examples, "observe_features", lambda *args: calls.append(args))
    scorer_steps(model, [trace], [table], _scorer(model), torch.float32)
    assert calls == []
    with pytest.raises(ValueError, match="reads standardised features; it cannot drive a recording of paper"):
        StepRecorder(make_policy("foresight", scorer=_scorer(model)), FutureTargets([table], B, L_), "paper")
