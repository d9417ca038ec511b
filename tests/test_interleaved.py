"""`foresight bench interleaved`'s instrument: strict turns between decoders on threads (a fake clock times them)
and the paired throughput ratio (its run on a model built from a config: tests/test_bench.py)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from foresight.bench.interleaved import Turns, paired_ratio, take_turns


class FakeDecoders:
    """Decoders that cost `cost[name]` fake seconds a token and log who decoded each token."""

    def __init__(self, cost: dict[str, float], tokens: dict[str, int]):
        self.cost, self.tokens, self.now, self.log = cost, tokens, 0.0, []
        self.lock = threading.Lock()

    def clock(self) -> float:
        return self.now

    def decoder(self, name: str):
        def decode(tick) -> None:
            for count in range(1, self.tokens[name] + 1):
                with self.lock:
                    self.now += self.cost[name]
                    self.log.append(name)
                tick(count)

        return decode


def test_decoders_take_strict_turns_and_one_that_ends_leaves_the_rotation():
    fake = FakeDecoders({"a": 1.0, "b": 1.25, "c": 2.0}, {"a": 24, "b": 24, "c": 8})
    turns = Turns(["a", "b", "c"], slice_tokens=4, clock=fake.clock)
    take_turns({name: fake.decoder(name) for name in "abc"}, turns)
    blocks = ["".join(fake.log[i : i + 4]) for i in range(0, len(fake.log), 4)]
    assert blocks == ["aaaa", "bbbb", "cccc", "aaaa", "bbbb", "cccc"] + ["aaaa", "bbbb"] * 4
    assert turns.slices["a"] == [4.0] * 6 and turns.slices["b"] == [5.0] * 6 and turns.slices["c"] == [8.0] * 2
    assert paired_ratio(turns.slices["a"], turns.slices["b"]).value == pytest.approx(0.8)


def test_an_error_in_one_decoder_is_raised_after_the_others_end():
    fake = FakeDecoders({"a": 1.0, "b": 1.0}, {"a": 12, "b": 12})

    def broken(tick) -> None:
        tick(1)
        raise RuntimeError("broken decoder")

    turns = Turns(["a", "b"], slice_tokens=3, clock=fake.clock)
    with pytest.raises(RuntimeError, match="broken decoder"):
        take_turns({"a": fake.decoder("a"), "b": broken}, turns)
    assert fake.log.count("a") == 12  # a decoded to its end alone


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
