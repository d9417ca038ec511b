"""The static decode step (issue 41 §4, `foresight.runtime.static_decode`): a decode forward of fixed shapes over
every slot, its counters on the device. On the CPU it must give the eager engine's tokens, logits and evictions,
and consecutive decode forwards, eviction steps between them included, must run the same operations with the same
shapes and scalars on the same input tensors (what a CUDA graph replays), reading nothing back."""

from __future__ import annotations

import pytest
import torch

from foresight.cache_argument import cache_argument
from foresight.policies import make_policy
from foresight.runtime.device_ops import OpTrace
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.host_reads import HostReads
from foresight.runtime.static_decode import StaticDecode
from tests.prompts import random_prompts
from tests.scorers import random_scorer

B, L = 12, 4
PROMPTS = random_prompts([7, 19, 12], seed=1)  # ragged: rows evict at different forwards


def policy(llama, name: str, **options):
    if name == "foresight":
        options = {"scorer": random_scorer(llama, feature_set="standardised"), **options}
    return make_policy(name, **options)


CASES = [
    ("snapkv", {}),
    ("tova", {}),
    ("streaming", {}),
    ("full", {}),
    ("foresight", {}),
    ("foresight", {"observation": "window"}),
    ("foresight", {"stream_block": 1}),
]


@pytest.mark.parametrize("name, options", CASES, ids=lambda value: str(value))
def test_static_decode_gives_the_eager_engines_tokens_logits_and_kept_entries(llama, name, options):
    """Ragged prompts, 40 tokens (each row evicts 6-7 times): the same greedy tokens, the same eviction steps and
    kept positions, and logits within float32 rounding (the static attention sums masked slots' zeros besides)."""
    runs = {}
    for step in ("eager", "static"):
        engine = EvictionEngine(llama, policy(llama, name, **options), EvictionConfig(B, L), decode_step=step)
        runs[step] = (engine.generate(PROMPTS, 40, return_logits=True), engine.last_cache)
    (eager, eager_cache), (static, static_cache) = runs["eager"], runs["static"]
    assert static.tokens == eager.tokens
    assert static.stats.evictions == eager.stats.evictions and static.stats.row_evictions == eager.stats.row_evictions
    torch.testing.assert_close(static.logits, eager.logits, rtol=0, atol=1e-5)
    assert torch.equal(static_cache.stacked("positions"), eager_cache.stacked("positions"))
    assert torch.equal(static_cache.lengths, eager_cache.lengths)


def traced_steps(monkeypatch, engine: EvictionEngine, prompts, tokens: int) -> list[OpTrace]:
    """Generate, tracing every static decode forward on its own; every trace also counts the host reads."""
    traces = []
    step = StaticDecode.step

    def traced(self):
        trace, reads = OpTrace(), HostReads()
        with trace, reads:
            logits = step(self)
        trace.reads = reads.total
        traces.append(trace)
        return logits

    monkeypatch.setattr(StaticDecode, "step", traced)
    engine.generate(prompts, tokens)
    return traces


@pytest.mark.parametrize("name", ["foresight", "snapkv"])
def test_consecutive_static_steps_run_the_same_operations_on_the_same_tensors(monkeypatch, llama, name):
    """30 decode forwards with eviction steps (and, for the learned scorer, streamed blocks) between them: one trace
    of operations, shapes, scalars and input addresses, and no host read."""
    engine = EvictionEngine(llama, policy(llama, name), EvictionConfig(B, L), decode_step="static")
    traces = traced_steps(monkeypatch, engine, PROMPTS, 31)
    assert len(traces) == 30 and engine.last_stats.evictions >= 6
    assert len(traces[0].ops) > 100
    for index, trace in enumerate(traces[1:], start=1):
        assert trace.ops == traces[0].ops, f"decode forward {index} differs from the first"
    assert all(trace.reads == 0 for trace in traces)


def test_the_trace_tells_eager_steps_apart(llama):
    """The control: eager decode forwards attend over a growing cache, and the trace sees it."""
    engine = EvictionEngine(llama, policy(llama, "snapkv"), EvictionConfig(B, L))
    engine.generate(PROMPTS, 2)
    cache = engine.last_cache
    traces = []
    for _ in range(2):
        tokens = torch.ones(len(PROMPTS), 1, dtype=torch.long)
        with OpTrace() as trace:
            engine.model(input_ids=tokens, **cache_argument(llama, cache), use_cache=True, eviction_cache=cache)
        traces.append(trace)
    assert traces[0].ops != traces[1].ops


def test_static_decode_refuses_what_it_cannot_hold(llama):
    with pytest.raises(ValueError, match="'h2o' observes every query"):
        EvictionEngine(llama, make_policy("h2o"), EvictionConfig(B, L), decode_step="static")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="captures CUDA graphs; the model is on cpu"):
            EvictionEngine(llama, make_policy("snapkv"), EvictionConfig(B, L), decode_step="graph")
    with pytest.raises(ValueError, match="unknown decode step 'compiled'; allowed: 'eager', 'static', 'graph'"):
        EvictionEngine(llama, make_policy("snapkv"), EvictionConfig(B, L), decode_step="compiled")


def test_a_batch_of_one_decodes_alike(llama):
    """One row (no padding at all): the static step still masks the slots not yet written."""
    prompt = random_prompts([5], seed=3)
    outputs = [
        EvictionEngine(llama, make_policy("snapkv"), EvictionConfig(B, L), decode_step=step).generate(
            prompt, 30, return_logits=True
        )
        for step in ("eager", "static")
    ]
    assert outputs[0].tokens == outputs[1].tokens
    torch.testing.assert_close(outputs[1].logits, outputs[0].logits, rtol=0, atol=1e-5)
