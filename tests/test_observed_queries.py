"""H2O, LazyEviction and RaaS in the engine against the written rule of docs/algorithms.md: the whole
attention history, one query at a time from position 0 (from the first decode query for LazyEviction
and RaaS), on a tiny model's teacher-forced replay whose prompt is longer than L, or longer than B + L
so that it evicts at prefill. The policies that read only the last L queries observe nothing else."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from foresight.policies import EvictionContext, make_policy
from foresight.runtime.capture import eviction_attention, register_attention
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from tests import reference_policies as ref

B, L, LENGTH = 16, 4, 64
RECORDING = "foresight-history"


class HistoryRecorder:
    """The runtime attention function, recording for every forward and layer what each query attended
    over: its vectors, its position and the entries (positions and keys) the cache held."""

    def __init__(self):
        self.forwards: list[tuple[int, torch.Tensor, list[int], list[list[int]], torch.Tensor]] = []

    def __call__(self, module, query, key, value, attention_mask, eviction_cache=None, **kwargs):
        layer = eviction_cache.layers[module.layer_idx]
        positions, entries = layer.pending_positions[0].tolist(), layer.entry_positions()[0].tolist()
        self.forwards.append((module.layer_idx, query[0].clone(), positions, entries, key[0].clone()))
        return eviction_attention(module, query, key, value, attention_mask, eviction_cache=eviction_cache, **kwargs)

    def history(self, layer: int, scaling: float) -> list[tuple[int, list[dict[int, list[float]]]]]:
        """[(query position, per KV head {entry position: [weight per query head]})] in position order,
        computed by loops from the recorded queries and keys."""
        out = []
        for layer_idx, query, query_positions, entry_positions, keys in self.forwards:
            if layer_idx != layer:
                continue
            group = query.shape[0] // keys.shape[0]
            for index, t in enumerate(query_positions):
                heads = []
                for h, (positions, head_keys) in enumerate(zip(entry_positions, keys.tolist())):
                    query_heads = [query[h * group + g, index].tolist() for g in range(group)]
                    weights = ref.group_attention(query_heads, head_keys, positions, t, scaling)
                    heads.append({positions[slot]: w for slot, w in weights.items()})
                out.append((t, heads))
        return out


def written_rule_scores(name, history, prompt_length: int, now: int, candidates, threshold: float) -> list:
    """Keep score of each candidate position [Hkv][C] at the step whose newest token is `now`: the policy's
    rule replayed over every query up to `now` (decode queries only for lazy and raas), one at a time."""
    scores = []
    for h, head in enumerate(candidates):
        steps = [(t, weights[h]) for t, weights in history if t <= now]
        if name == "h2o":
            cumulative = defaultdict(float)
            for _, weights in steps:
                ref.h2o_observe(cumulative, weights)
            scores.append([cumulative[p] for p in head])
        elif name == "lazy":
            t_last = {p: 0.0 if p < prompt_length else p - 1.0 for p in range(now + 1)}
            mri = dict.fromkeys(range(now + 1), 0.0)
            for t, weights in steps:
                if t >= prompt_length:
                    ref.lazy_observe(t_last, mri, weights, t, threshold)
            scores.append([ref.lazy_score(t_last[p], mri[p], now) for p in head])
        else:
            timestamps = {p: float(p) for p in range(now + 1)}
            for t, weights in steps:
                if t >= prompt_length:
                    ref.raas_observe(timestamps, weights, t, threshold)
            scores.append([timestamps[p] for p in head])
    return scores


def replay_recording(model, policy, sequence: torch.Tensor, prompt_length: int):
    """Replay one sequence; return the recorder and, in the order they happened, the policy's calls:
    ("observe", layer, query positions) and ("step", layer, positions [Hkv][N], candidates, scores)."""
    calls = []
    keep_scores, observe = policy.keep_scores, policy.observe

    def recording_keep_scores(context: EvictionContext) -> torch.Tensor:
        scores = keep_scores(context)
        step = (context.layer_idx, context.positions[0].tolist(), context.num_candidates, scores[0].tolist())
        calls.append(("step", *step))
        return scores

    def recording_observe(context: EvictionContext) -> dict[str, torch.Tensor]:
        if context.query_positions is not None:
            calls.append(("observe", context.layer_idx, context.query_positions[0].tolist()))
        return observe(context)

    policy.keep_scores, policy.observe = recording_keep_scores, recording_observe
    recorder = HistoryRecorder()
    register_attention(RECORDING, recorder)
    engine = EvictionEngine(model, policy, EvictionConfig(B, L), attention=RECORDING)
    output = engine.replay([sequence], [prompt_length])
    assert output.first_eviction[0] is not None
    return recorder, calls, engine.last_cache.layers[0].scaling


@pytest.fixture(scope="module")
def sequence():
    return torch.randint(3, 128, (LENGTH,), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("prompt_length", [10, 26])  # L < 10 < B + L; 26 > B + L evicts at prefill
@pytest.mark.parametrize("name, threshold", [("h2o", None), ("lazy", 1e-4), ("lazy", 0.05), ("raas", 0.05)])
def test_scores_follow_the_written_rule_over_the_whole_history(peaked_llama, sequence, name, threshold, prompt_length):
    policy = make_policy(name) if threshold is None else make_policy(name, threshold=threshold)
    recorder, calls, scaling = replay_recording(peaked_llama, policy, sequence, prompt_length)
    layers = range(peaked_llama.config.num_hidden_layers)
    histories = {layer: recorder.history(layer, scaling) for layer in layers}
    steps = [call[1:] for call in calls if call[0] == "step"]
    assert len(steps) >= 2 * len(histories)
    for layer, positions, num_candidates, scores in steps:
        now = positions[0][-1]
        candidates = [head[:num_candidates] for head in positions]
        expected = written_rule_scores(name, histories[layer], prompt_length, now, candidates, threshold)
        for head_positions, head_scores, head_expected in zip(candidates, scores, expected):
            valid = [n for n, p in enumerate(head_positions) if p >= 0]
            actual = torch.tensor([head_scores[n] for n in valid], dtype=torch.float64)
            wanted = torch.tensor([head_expected[n] for n in valid], dtype=torch.float64)
            torch.testing.assert_close(actual, wanted, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, first", [("h2o", 0), ("lazy", 26), ("raas", 26), ("snapkv", None)])
def test_each_query_is_observed_once_in_order_before_every_eviction_step(peaked_llama, sequence, name, first):
    """At each eviction step, an every-query policy has seen each query from position `first` to the
    newest exactly once and in order, in blocks of at most L; snapkv sees the last L queries at each
    eviction step of each layer and nothing else."""
    _, calls, _ = replay_recording(peaked_llama, make_policy(name), sequence, prompt_length=26)
    seen = defaultdict(list)
    steps = 0
    for kind, layer, *details in calls:
        if kind == "observe":
            assert len(details[0]) <= L
            seen[layer] += [t for t in details[0] if t >= 0]
            continue
        steps += 1
        newest = details[0][0][-1]
        if first is None:
            assert seen.pop(layer, None) == list(range(newest - L + 1, newest + 1))
        else:
            assert seen[layer] == list(range(first, newest + 1))
    assert steps >= 2 * peaked_llama.config.num_hidden_layers
    if first is None:
        assert not seen
