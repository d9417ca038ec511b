"""Replays paused and copied into other rows mid-run (`EvictionEngine.start_replay`, `advance`,
`Replay.select_rows`) against replays that run through on their own."""

from __future__ import annotations

import pytest
import torch

from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine, ReplayOutput
from tests.policy_lists import constructible_policies
from tests.scorers import random_scorer

B, L = 12, 4
LENGTH, PROMPT = 50, 5
SEEDS = (11, 12, 13, 14)


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(1, 128, (LENGTH,), generator=torch.Generator().manual_seed(seed))


def engine_for(model, name: str, seeds=None) -> EvictionEngine:
    if name == "foresight":
        policy = make_policy("foresight", scorer=random_scorer(model))
    elif name == "foresight-sampled":
        policy = make_policy("foresight", scorer=random_scorer(model), mode="sampled", row_seeds=seeds, temperature=0.5)
    else:
        policy = make_policy(name)
    return EvictionEngine(model, policy, EvictionConfig(B, L, sinks=0, protect_prompt=False))


def assert_same_replay(mine: ReplayOutput, theirs: ReplayOutput, mine_engine, theirs_engine) -> None:
    assert mine.first_eviction == theirs.first_eviction
    assert mine.stats.evictions == theirs.stats.evictions
    for row, (a, b) in enumerate(zip(mine.nll, theirs.nll, strict=True)):
        assert torch.equal(a, b), row
    for a, b in zip(mine_engine.last_cache.layers, theirs_engine.last_cache.layers, strict=True):
        assert torch.equal(a.entry_positions(), b.entry_positions())
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        for name in a.state:  # NaN marks an entry a policy has not scored yet (lagkv)
            torch.testing.assert_close(a.state[name], b.state[name], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", [*constructible_policies(), "foresight", "foresight-sampled"])
def test_rows_copied_mid_replay_continue_as_those_rows_run_through(llama, name):
    """Rows A, C, B, D paused before eviction step 3, rows 0 and 2 each copied twice, then run on (with
    another replay run by the same engine in between): bit for bit the replay of A, A, B, B run through,
    held entries, their state and every token loss, also for a sampled policy whose rows draw from their
    own generators. Both batches have 4 rows, so the same kernels run the same inputs row by row."""
    names = [tokens(seed) for seed in range(4)]  # A, C, B, D
    forked_engine = engine_for(llama, name, seeds=SEEDS)
    replay = forked_engine.start_replay(names, [PROMPT] * 4)
    forked_engine.advance(replay, stop_before_step=3)
    assert (replay.evictions, replay.pending_eviction) == (3, True)
    copied = replay.select_rows([0, 0, 2, 2])
    forked_engine.replay([tokens(9)] * 4, [PROMPT] * 4)  # the engine's policy runs another replay meanwhile
    forked = forked_engine.advance(copied).output()
    assert copied.finished and not replay.finished  # the original is left where it paused

    plain_engine = engine_for(llama, name, seeds=(SEEDS[0], SEEDS[0], SEEDS[2], SEEDS[2]))
    plain = plain_engine.replay([names[0], names[0], names[2], names[2]], [PROMPT] * 4)
    assert plain.stats.evictions > 5
    assert_same_replay(forked, plain, forked_engine, plain_engine)


@pytest.mark.parametrize("name", ["h2o", "foresight"])
def test_a_replay_paused_by_steps_and_tokens_ends_as_one_run_through(llama, name):
    """A prefill of B + L tokens, paused before step 0 (right after it), after 8 more tokens (2 chunks of L:
    step 1 runs, step 2 is left pending) and before step 5, the copy of the paused replay run on: the
    replay run through."""
    rows, prompts = [tokens(0), tokens(1)], [B + L] * 2
    engine = engine_for(llama, name)
    replay = engine.start_replay(rows, prompts)
    engine.advance(replay, stop_before_step=0)
    assert (replay.evictions, replay.pending_eviction, replay.done) == (0, True, 0)
    engine.advance(replay, tokens=8)
    assert (replay.done, replay.evictions, replay.pending_eviction) == (8, 2, True)
    engine.advance(replay, stop_before_step=5)
    assert replay.evictions == 5
    engine.advance(replay, stop_before_step=5)  # already there: nothing runs
    assert (replay.evictions, replay.pending_eviction) == (5, True)
    out = engine.advance(replay.select_rows([0, 1])).output()
    plain_engine = engine_for(llama, name)
    assert_same_replay(out, plain_engine.replay(rows, prompts), engine, plain_engine)
    with pytest.raises(ValueError, match="has run 5 eviction steps, past step 4"):
        engine.advance(replay, stop_before_step=4)


def test_one_row_copied_into_k_rows_equals_k_rows_run_through_up_to_rounding(llama):
    """The reinforcement stage's branch: a one-row replay copied into 4 rows before step 2. The forwards
    before the copy ran on 1 row, those of the plain replay on 4: a matmul may block its sums by the
    batch's size, so the token losses agree to float32 rounding (1e-5 absolute on losses of a few nats)
    rather than bit for bit; the evictions, which compare scores far apart, are the same."""
    engine = engine_for(llama, "foresight")
    replay = engine.start_replay([tokens(0)], [PROMPT])
    engine.advance(replay, stop_before_step=2)
    forked = engine.advance(replay.select_rows([0] * 4)).output()
    plain_engine = engine_for(llama, "foresight")
    plain = plain_engine.replay([tokens(0)] * 4, [PROMPT] * 4)
    assert forked.first_eviction == plain.first_eviction and forked.stats.evictions == plain.stats.evictions
    for a, b in zip(forked.nll, plain.nll, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for a, b in zip(engine.last_cache.layers, plain_engine.last_cache.layers, strict=True):
        assert torch.equal(a.entry_positions(), b.entry_positions())


def test_a_replay_run_to_its_end_runs_the_eviction_step_its_last_forward_made_due(llama):
    """A sequence ending where the cache reaches B + L: the step that last forward makes due still runs
    (only a pause asked for by `tokens` leaves it pending), so an observer of the step, such as the
    example recorder, sees every step of the golden schedule."""
    sequence = tokens(0)[: B + 2 * L]  # steps due after B + L and B + 2L entries
    engine = engine_for(llama, "snapkv")
    output = engine.replay([sequence], [PROMPT])
    assert output.stats.evictions == 2
    paused = engine.start_replay([sequence], [PROMPT])
    engine.advance(paused, tokens=len(sequence) - PROMPT)
    assert (paused.evictions, paused.pending_eviction) == (1, True)
