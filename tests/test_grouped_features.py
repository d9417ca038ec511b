"""The grouped standardised set (issue 41's state lever): the standardised seven of the attention the query heads
of a group pay together, against the loop reference of the group-summed block; one set of sums per KV head in
the cache (G times fewer state bytes); and, in the engine, the streamed observation keeping what the ring keeps."""

from __future__ import annotations

from dataclasses import replace

import torch

from foresight.models import describe
from foresight.policies import make_policy
from foresight.policies.foresight import observe_features
from foresight.runtime.held_memory import held_bytes
from foresight.runtime.policy import EvictionContext
from foresight.scorer.attention_features import FeatureSet, feature_width
from foresight.scorer.standardised_features import PER_QUERY_HEAD_STATE
from tests.reference_features import STANDARDISED_NAMES, loop_standardise, loop_standardised_features
from tests.scorers import random_scorer
from trainers.export import export_scorer

GROUPED = "standardised-grouped"


def test_grouped_features_are_the_standardised_seven_of_the_groups_summed_attention():
    """One eviction step of 2 rows, 2 KV heads of 3 query heads, 24 entries and 12 queries: the features of the
    6 candidates (7 per KV head, not 21) and the new sums ([batch, Hkv, N]) equal the loop reference run on the
    block attention summed over the group, within float32 rounding."""
    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, group, entries, rows, dim, candidates = 2, 2, 3, 24, 12, 8, 6
    positions = torch.arange(entries).repeat(batch, kv_heads, 1)
    positions[1, :, :2] = -1  # two invalid slots in row 1
    query_positions = torch.arange(entries - rows, entries).repeat(batch, 1)
    state = {name: torch.rand(batch, kv_heads, entries, generator=generator) for name in PER_QUERY_HEAD_STATE}
    context = EvictionContext(
        layer_idx=0,
        num_layers=1,
        keys=torch.randn(batch, kv_heads, entries, dim, generator=generator),
        values=torch.randn(batch, kv_heads, entries, dim, generator=generator),
        positions=positions,
        num_candidates=candidates,
        scaling=dim**-0.5,
        state=state,
        queries=torch.randn(batch, kv_heads * group, rows, dim, generator=generator),
        query_positions=query_positions,
        first_observed=torch.tensor([3, 12]),
    )
    features, new_state = observe_features(context, GROUPED)
    assert features.shape == (batch, kv_heads, candidates, feature_width(GROUPED, group)) == (2, 2, 6, 7)
    summed = context.attention.sum(2, keepdim=True).double()
    want, want_state = loop_standardised_features(
        summed,
        {name: value[..., None].double() for name, value in state.items()},
        positions,
        query_positions,
        STANDARDISED_NAMES,
        context.first_observed,
    )
    valid = positions[..., :candidates] >= 0
    expected = loop_standardise(want[..., :candidates, :], valid)
    # standardised logs of float32 sums of 12 terms: a relative error of ~1e-6, over a std of at least 0.01
    torch.testing.assert_close(features.double(), expected, rtol=0, atol=1e-3)
    for name in PER_QUERY_HEAD_STATE:
        assert new_state[name].shape == (batch, kv_heads, entries)
        torch.testing.assert_close(new_state[name].double(), want_state[name][..., 0], rtol=1e-5, atol=1e-7)
    per_head_state = {name: value[..., None].expand(-1, -1, -1, group) for name, value in state.items()}
    per_head, _ = observe_features(replace(context, state=per_head_state), "standardised")
    assert per_head.shape[-1] == 3 * features.shape[-1]  # what the grouped set divides by G


def test_the_grouped_set_holds_one_set_of_sums_per_kv_head(llama):
    """Held bytes: the grouped scorer's state is the standardised scorer's divided by G; nothing else changes."""
    shape = describe(llama)
    group = shape.num_query_heads // shape.num_kv_heads
    assert group > 1 and not FeatureSet.parse(GROUPED).per_query_head
    held = {
        name: held_bytes(
            shape, make_policy("foresight", scorer=random_scorer(llama, feature_set=name)), 12, 4, torch.float32
        )
        for name in ("standardised", GROUPED)
    }
    assert held[GROUPED].state * group == held["standardised"].state > 0
    assert held[GROUPED].total - held[GROUPED].state == held["standardised"].total - held["standardised"].state


def test_a_grouped_scorers_card_says_its_features_are_per_kv_head(llama, tmp_path):
    export_scorer(random_scorer(llama, feature_set=GROUPED), tmp_path)
    (row,) = [line for line in (tmp_path / "README.md").read_text().splitlines() if line.startswith("| features")]
    assert "(per KV head, the group's summed attention;" in row
    export_scorer(random_scorer(llama, feature_set="standardised"), tmp_path / "per-head")
    assert "(per query head, log(x + 1e-6)" in (tmp_path / "per-head" / "README.md").read_text()
