"""`foresight bench interleaved`'s instrument: strict turns between decoders in one thread (a fake clock times them)
and the paired throughput ratio (its run on a model built from a config: tests/test_bench.py)."""

from __future__ import annotations

import numpy as np
import pytest

from foresight.bench.interleaved import paired_ratio, take_turns
from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from tests.prompts import prompts
from tests.scorers import random_scorer


class FakeDecoders:
    """Decoders that cost `cost[name]` fake seconds a token and log who decoded each token."""

    def __init__(self, cost: dict[str, float], tokens: dict[str, int]):
        self.cost, self.tokens, self.now, self.log = cost, tokens, 0.0, []

    def clock(self) -> float:
        return self.now

    def decoder(self, name: str):
        for count in range(1, self.tokens[name] + 1):
            self.now += self.cost[name]
            self.log.append(name)
            yield count


def test_decoders_take_strict_turns_and_one_that_ends_leaves_the_rotation():
    fake = FakeDecoders({"a": 1.0, "b": 1.25, "c": 2.0}, {"a": 24, "b": 26, "c": 8})
    slices = take_turns({name: fake.decoder(name) for name in "abc"}, slice_tokens=4, clock=fake.clock)
    blocks = ["".join(fake.log[i : i + 4]) for i in range(0, len(fake.log), 4)]
    assert blocks == ["aaaa", "bbbb", "cccc", "aaaa", "bbbb", "cccc"] + ["aaaa", "bbbb"] * 4 + ["bb"]
    assert slices == {"a": [4.0] * 6, "b": [5.0] * 6, "c": [8.0] * 2}  # b's last 2 tokens make no turn
    assert paired_ratio(slices["a"], slices["b"]).value == pytest.approx(0.8)


def test_an_error_in_one_decoder_stops_the_turns():
    fake = FakeDecoders({"a": 1.0, "b": 1.0}, {"a": 12, "b": 12})

    def broken():
        yield 1
        raise RuntimeError("broken decoder")

    with pytest.raises(RuntimeError, match="broken decoder"):
        take_turns({"a": fake.decoder("a"), "b": broken()}, slice_tokens=3, clock=fake.clock)
    assert fake.log == ["a"] * 3  # a's first turn, then b's failed


def test_generations_in_turns_decode_what_each_decodes_alone(llama):
    """Engines of one model advanced in turns in one thread (a learned policy observing in the forward among them)
    share nothing: each decodes the tokens it decodes alone, with as many evictions."""
    policies = {
        "snapkv": make_policy("snapkv"),
        "foresight": make_policy("foresight", scorer=random_scorer(llama), observation="forward", record=False),
        "h2o": make_policy("h2o"),
    }
    engines = {name: EvictionEngine(llama, policy, EvictionConfig(12, 4)) for name, policy in policies.items()}
    batch = prompts([5, 9], seed=3)
    alone = {name: engine.generate(batch, 30) for name, engine in engines.items()}
    generations = {name: engine.generation(batch, 30) for name, engine in engines.items()}
    outputs = {}

    def finished(name: str):
        outputs[name] = yield from generations[name]

    slices = take_turns({name: finished(name) for name in engines}, slice_tokens=4)
    assert {name: len(times) for name, times in slices.items()} == dict.fromkeys(engines, 7)  # 30 // 4
    for name, output in alone.items():
        assert outputs[name].tokens == output.tokens
        assert outputs[name].stats.evictions == output.stats.evictions > 0


def test_the_paired_ratio_resolves_a_few_percent_under_drift():
    """A machine whose speed drifts by ±30% from round to round hits both decoders of a round alike: a 3% slower
    decoder is placed within a point, its interval excluding 1; a different count of turns is refused."""
    rng = np.random.default_rng(0)
    drift = 1 + 0.3 * np.sin(np.arange(60) / 5)
    reference = drift * (1 + 0.01 * rng.standard_normal(60))
    slower = 1.03 * drift * (1 + 0.01 * rng.standard_normal(60))
    estimate = paired_ratio(reference, slower)
    assert estimate.value == pytest.approx(1 / 1.03, abs=0.01) and estimate.low < 1 / 1.03 < estimate.high < 1
    with pytest.raises(ValueError, match="need two equally long series of at least 2 turns, got 3 and 2"):
        paired_ratio([1.0, 1.0, 1.0], [1.0, 1.0])
