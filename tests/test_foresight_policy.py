"""The learned `foresight` policy: keep scores against independent MLPs on loop-computed features, batched
generation, the sampled mode (Eq. 2) against the engine's evictions and a loop Plackett-Luce, and its errors."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from foresight.models import describe, tiny_model
from foresight.policies import foresight as foresight_policy
from foresight.policies import make_policy
from foresight.policies.foresight import CUMULATIVE, DECAYED, Foresight
from foresight.runtime import policy as policy_module
from foresight.runtime.cache import EvictionCache
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.policy import EvictionContext
from foresight.scorer.attention_features import DECAY, FEATURE_NAMES, FeatureSet
from tests import reference_policies as ref
from tests.eviction_steps import standardised_step
from tests.prompts import random_prompts
from tests.reference_features import independent_mlp, loop_standardise, loop_standardised_features
from tests.scorers import random_scorer

B, L = 12, 4


# -- keep scores --------------------------------------------------------------------------------
def test_keep_scores_equal_independent_mlps_on_loop_features(llama):
    """A hand-built step of layer 1 (two rows, one with padding slots): the new state and the keep scores
    of the candidates equal the per-(layer, head) MLP of [k || v || a] with loop-computed features."""
    scorer = random_scorer(llama)
    shape = describe(llama)
    generator = torch.Generator().manual_seed(5)
    rows, kv_heads, group, dim, entries = 2, shape.num_kv_heads, shape.group_size, shape.head_dim, B + L
    positions = torch.arange(entries).repeat(rows, kv_heads, 1)
    positions[1, :, :3] = -1  # padding in front of row 1
    context = EvictionContext(
        layer_idx=1,
        num_layers=shape.num_layers,
        keys=torch.randn(rows, kv_heads, entries, dim, generator=generator),
        values=torch.randn(rows, kv_heads, entries, dim, generator=generator),
        positions=positions,
        num_candidates=B,
        scaling=dim**-0.5,
        state={
            CUMULATIVE: torch.rand(rows, kv_heads, entries, group, generator=generator) * 3,
            DECAYED: torch.rand(rows, kv_heads, entries, group, generator=generator),
        },
        queries=torch.randn(rows, shape.num_query_heads, L, dim, generator=generator),
        query_positions=torch.arange(B, B + L).repeat(rows, 1),
    )
    policy = make_policy("foresight", scorer=scorer)
    state = policy.observe(context)
    received = context.attention.sum(3).transpose(-1, -2)  # [rows, Hkv, N, G]
    torch.testing.assert_close(state[CUMULATIVE], context.state[CUMULATIVE] + received)
    torch.testing.assert_close(state[DECAYED], DECAY * context.state[DECAYED] + received)
    scores = policy.keep_scores(context)
    assert scores.shape == (rows, kv_heads, B)
    for row, head in itertools.product(range(rows), range(kv_heads)):
        expected = ref.foresight(
            scorer,
            1,
            head,
            context.keys[row, head],
            context.values[row, head],
            context.attention[row, head],
            context.state[CUMULATIVE][row, head],
            context.state[DECAYED][row, head],
            B,
        )
        torch.testing.assert_close(scores[row, head], expected, rtol=0, atol=1e-5)


def default_checkpoint_step() -> EvictionContext:
    """A fixed random step of layer 5 at the shipped default scorer's shape (B = 128, L = 32)."""
    generator = torch.Generator().manual_seed(21)
    rows, kv_heads, group, dim, budget, interval = 1, 3, 3, 64, 128, 32
    entries = budget + interval
    return EvictionContext(
        layer_idx=5,
        num_layers=30,
        keys=torch.randn(rows, kv_heads, entries, dim, generator=generator),
        values=torch.randn(rows, kv_heads, entries, dim, generator=generator),
        positions=torch.arange(entries).repeat(rows, kv_heads, 1),
        num_candidates=budget,
        scaling=dim**-0.5,
        state={
            CUMULATIVE: torch.rand(rows, kv_heads, entries, group, generator=generator) * 30,
            DECAYED: torch.rand(rows, kv_heads, entries, group, generator=generator) * 3,
        },
        queries=torch.randn(rows, kv_heads * group, interval, dim, generator=generator) * 3,
        query_positions=torch.arange(budget, entries).repeat(rows, 1),
    )


def test_an_existing_scorer_loads_and_scores_as_before_the_standardised_set():
    """The "paper" scorer shipped before this round (checkpoints/default-paper), its keep scores at a fixed step
    pinned before issue 21's changes: an older feature set keeps its features, its two state fields and its raw
    keys and values."""
    policy = make_policy("foresight", scorer=str(Path(__file__).resolve().parents[1] / "checkpoints" / "default-paper"))
    assert [field.name for field in policy.state_fields] == [CUMULATIVE, DECAYED]
    context = default_checkpoint_step()
    policy.observe(context)
    scores = policy.keep_scores(context)
    pinned = [
        [-0.18144123256206512, -0.1775178760290146, -0.1807316243648529, -0.1914985626935959],
        [0.020522043108940125, -0.030811762437224388, -0.05059858784079552, 0.019973136484622955],
        [0.16529583930969238, 0.12302331626415253, 0.1444603055715561, 0.1160782128572464],
    ]
    # Float32 scores pinned on one CPU, checked on any: tolerance from float32 rounding (u = 6e-8) in another
    # summation order. With errors growing as sqrt(n) * u (Higham & Mary's probabilistic bound), a logit of 64
    # products (sum|q k| * scaling <= 26) moves a weight by <= 2.6e-5 relative, and the MLP's 146-input and
    # 16-input sums carry it to <= 8e-6 per score on average (2.9e-5 at most; the float64 replay of this step
    # is 1.3e-7 from this CPU's float32 one): atol = 1e-5, and sqrt(480) * 1e-5 = 2.2e-4 < 1e-3 for the sum of
    # 480 scores.
    torch.testing.assert_close(scores[0, :, :4], torch.tensor(pinned), rtol=0, atol=1e-5)
    assert scores.double().sum().item() == pytest.approx(-18.79833535850048, abs=1e-3)


@pytest.mark.parametrize("feature_set", ["standardised", "standardised-heuristic"])
def test_standardised_keep_scores_equal_independent_mlps_on_loop_features(llama, feature_set):
    """A standardised policy's state and keep scores equal the per-(layer, head) MLP of
    [k/|k| || v/|v| || a] with loop-computed features standardised over each row's valid candidates."""
    scorer = random_scorer(llama, feature_set=feature_set)
    policy = make_policy("foresight", scorer=scorer, observation="window")
    assert [field.name for field in policy.state_fields] == ["cumulative", "decayed", "recent"]
    context = standardised_step(scorer)
    state = policy.observe(context)
    scores = policy.keep_scores(context)
    features, expected_state = loop_standardised_features(
        context.attention,
        context.state,
        context.positions,
        context.query_positions,
        FEATURE_NAMES[FeatureSet.parse(feature_set)],
        context.first_observed,
    )
    for name, value in expected_state.items():
        torch.testing.assert_close(state[name].double(), value, rtol=1e-5, atol=1e-6)
    valid = context.candidate_positions >= 0
    features = loop_standardise(features[..., :B, :], valid).float()
    unit = [torch.nn.functional.normalize(tensor[..., :B, :], dim=-1) for tensor in (context.keys, context.values)]
    for row, head in itertools.product(range(2), range(scorer.config.num_kv_heads)):
        inputs = torch.cat([unit[0][row, head], unit[1][row, head], features[row, head]], -1)
        expected = independent_mlp(scorer, 1, head)(inputs).squeeze(-1)
        torch.testing.assert_close(scores[row, head], expected, rtol=0, atol=1e-4)


def test_standardised_keep_scores_ignore_a_constant_factor_on_attention(llama):
    """Ten times every attention sum: log shifts by ln 10, which the standardisation removes."""
    scorer = random_scorer(llama, feature_set="standardised")
    scores = []
    for scale in (1.0, 10.0):
        policy, context = make_policy("foresight", scorer=scorer), standardised_step(scorer, scale)
        policy.observe(context)
        scores.append(policy.keep_scores(context))
    valid = standardised_step(scorer).candidate_positions >= 0
    torch.testing.assert_close(scores[1][valid], scores[0][valid], rtol=0, atol=1e-3)


# -- in the engine --------------------------------------------------------------------------------
class EvictionLog:
    """Records every compaction, layer after layer and step after step: (positions before
    [b, Hkv, N], keep mask), in the order the policy scored them."""

    def __init__(self, monkeypatch):
        self.steps: list[tuple[torch.Tensor, torch.Tensor]] = []
        compact = EvictionCache.compact

        def recording(cache, keep, width):
            for layer, layer_keep in zip(cache.layers, keep):
                self.steps.append((layer.entry_positions().clone(), layer_keep.clone()))
            compact(cache, keep, width)

        monkeypatch.setattr(EvictionCache, "compact", recording)

    def evicted(self, index: int) -> list[list[set[int]]]:
        """Positions evicted at compaction `index`, per row and head."""
        positions, keep = self.steps[index]
        dropped = positions.masked_fill(keep | (positions < 0), -1)
        return [[set(p for p in head.tolist() if p >= 0) for head in row] for row in dropped]


@pytest.fixture
def eviction_log(monkeypatch):
    return EvictionLog(monkeypatch)


@pytest.mark.parametrize("feature_set", ["paper", "standardised"])
def test_batched_generation_holds_the_budget_and_equals_each_row_alone(llama, feature_set):
    scorer = random_scorer(llama, feature_set=feature_set)
    batch = random_prompts([5, 11, 20], seed=1)  # the 20-token prompt evicts right after prefill
    engine = EvictionEngine(llama, make_policy("foresight", scorer=scorer), EvictionConfig(B, L))
    together = engine.generate(batch, 30, return_logits=True)
    assert together.stats.evictions > 5
    assert bool((engine.last_cache.lengths < B + L).all())
    for row, prompt in enumerate(batch):
        alone = engine.generate([prompt], 30, return_logits=True)
        assert together.tokens[row] == alone.tokens[0]
        torch.testing.assert_close(together.logits[row], alone.logits[0], atol=1e-4, rtol=0)


def test_deterministic_mode_evicts_the_lowest_scores(llama, eviction_log):
    scorer = random_scorer(llama)
    policy = make_policy("foresight", scorer=scorer)
    seen = []
    step_keep_scores = policy.step_keep_scores

    def spy(contexts):
        scores = step_keep_scores(contexts)
        seen.extend(  # a copy: the contexts' tensors are the cache's, which the step's compaction rewrites
            (context.candidate_positions.clone(), layer_scores) for context, layer_scores in zip(contexts, scores)
        )
        return scores

    policy.step_keep_scores = spy
    EvictionEngine(llama, policy, EvictionConfig(B, L)).generate(random_prompts([6, 6], seed=2), 24)
    assert len(seen) == len(eviction_log.steps) > 4
    for index, (candidates, scores) in enumerate(seen):
        lowest = scores.argsort(-1)[..., :L]
        expected = candidates.gather(-1, lowest)
        for row, head in itertools.product(range(2), range(candidates.shape[1])):
            assert eviction_log.evicted(index)[row][head] == set(expected[row, head].tolist())


def loop_plackett_luce(scores: torch.Tensor, order: list[int], eligible: list[bool]) -> float:
    """log P(order) of sequential softmax draws over the negated scores of the eligible pool entries."""
    remaining = [i for i in range(len(scores)) if eligible[i]]
    total = 0.0
    for pick in order:
        logits = torch.stack([-scores[i] for i in remaining])
        total += float(-scores[pick] - torch.logsumexp(logits, 0))
        remaining.remove(pick)
    return total


@pytest.mark.parametrize("feature_set", ["paper", "standardised"])
def test_sampled_mode_evicts_exactly_the_sampled_entries_and_records_them(llama, eviction_log, feature_set):
    scorer = random_scorer(llama, feature_set=feature_set)
    policy = make_policy("foresight", scorer=scorer, mode="sampled", seed=3)
    EvictionEngine(llama, policy, EvictionConfig(B, L)).generate(random_prompts([7, 7], seed=4), 30)
    assert len(policy.records) == len(eviction_log.steps) > 4
    for index, record in enumerate(policy.records):
        assert record.order.shape == (2, scorer.config.num_kv_heads, L) and record.positions.shape[-1] == 2 * L
        sampled = record.positions.gather(-1, record.order)
        evicted = eviction_log.evicted(index)
        with torch.no_grad():
            scores = scorer.score_layer(record.layer, record.keys, record.values, record.features)
            recomputed = record.logprob_under(scorer)
        torch.testing.assert_close(recomputed, record.logprob, rtol=0, atol=1e-5)
        for row, head in itertools.product(range(2), range(scorer.config.num_kv_heads)):
            assert evicted[row][head] == set(sampled[row, head].tolist())
            expected = loop_plackett_luce(
                scores[row, head], record.order[row, head].tolist(), record.eligible[row, head].tolist()
            )
            assert abs(float(record.logprob[row, head]) - expected) < 1e-4
    # Reproducible from the seed, and another seed samples other evictions.
    again = make_policy("foresight", scorer=scorer, mode="sampled", seed=3)
    EvictionEngine(llama, again, EvictionConfig(B, L)).generate(random_prompts([7, 7], seed=4), 30)
    assert all(torch.equal(a.order, b.order) for a, b in zip(policy.records, again.records))
    other = make_policy("foresight", scorer=scorer, mode="sampled", seed=4)
    EvictionEngine(llama, other, EvictionConfig(B, L)).generate(random_prompts([7, 7], seed=4), 30)
    assert any(not torch.equal(a.order, b.order) for a, b in zip(policy.records, other.records))
    # record=false draws the same evictions and keeps nothing.
    steps, before = len(policy.records), len(eviction_log.steps)
    unrecorded = make_policy("foresight", scorer=scorer, mode="sampled", seed=3, record=False)
    EvictionEngine(llama, unrecorded, EvictionConfig(B, L)).generate(random_prompts([7, 7], seed=4), 30)
    assert unrecorded.records == [] and len(eviction_log.steps) == before + steps
    assert all(eviction_log.evicted(before + index) == eviction_log.evicted(index) for index in range(steps))


class _OneLayerAtATime(Foresight):
    """The learned policy observing, scoring and sampling each layer on its own, as the engine's step ran
    it before the layers went through it together: the reference of `step_observe` and `step_keep_scores`."""

    def step_observe(self, contexts):
        return [Foresight.step_observe(self, [context])[0] for context in contexts]

    def step_keep_scores(self, contexts):
        return torch.stack([Foresight.step_keep_scores(self, [context])[0] for context in contexts])


@pytest.mark.parametrize("layers_per_pass", [1, 2, 5])
@pytest.mark.parametrize("options", [{}, {"mode": "sampled", "row_seeds": (5, 9)}, {"mode": "sampled", "seed": 2}])
def test_a_step_scoring_every_layer_at_once_evicts_as_one_layer_at_a_time(monkeypatch, options, layers_per_pass):
    """Same evictions, losses and sampled records (on a CPU a generator's draws for all layers at once are
    its draws layer after layer), with the block attention of 1, 2 (passes of 2, 2 and 1) or all 5 layers
    per pass (`STEP_LOGITS` sized to fit that many)."""
    llama = tiny_model("llama", num_hidden_layers=5)
    logits_per_layer = 2 * llama.config.num_attention_heads * L * (B + L)  # rows × Hq × queries × entries
    monkeypatch.setattr(foresight_policy, "STEP_LOGITS", layers_per_pass * logits_per_layer)
    passes = []  # the rows (layers × batch rows) of each pass
    block_attention = policy_module.block_attention
    monkeypatch.setattr(
        policy_module,
        "block_attention",
        lambda queries, *args: passes.append(queries.shape[0]) or block_attention(queries, *args),
    )
    scorer = random_scorer(llama, feature_set="standardised")
    sequences = [torch.tensor(prompt) for prompt in random_prompts([40, 40], seed=6)]
    runs = []
    for policy in (Foresight(scorer=scorer, **options), _OneLayerAtATime(scorer=scorer, **options)):
        engine = EvictionEngine(llama, policy, EvictionConfig(B, L, sinks=0, protect_prompt=False))
        output = engine.replay(sequences, [B + L] * 2)
        runs.append((output, policy.records, [layer.entry_positions() for layer in engine.last_cache.layers]))
        passes.append(None)  # the end of a run's passes
    (together, records, held), (alone, reference, held_alone) = runs
    sizes = [2 * min(layers_per_pass, 5 - first) for first in range(0, 5, layers_per_pass)]
    assert passes[: passes.index(None)] == sizes * together.stats.evictions
    assert together.stats.evictions == alone.stats.evictions >= 5
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(held, held_alone, strict=True))
    for row in range(2):
        torch.testing.assert_close(together.nll[row], alone.nll[row], rtol=0, atol=1e-5)
    assert len(records) == len(reference) == (together.stats.evictions * describe(llama).num_layers if options else 0)
    for record, expected in zip(records, reference):
        assert record.layer == expected.layer and torch.equal(record.order, expected.order)
        assert torch.equal(record.positions, expected.positions) and torch.equal(record.eligible, expected.eligible)
        for name in ("keys", "values", "features", "logprob"):
            torch.testing.assert_close(getattr(record, name), getattr(expected, name), rtol=0, atol=1e-5)


# -- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "scorer_overrides, config, message",
    [
        (
            dict(num_layers=3),
            EvictionConfig(B, L),
            "scorer trained for tiny-llama (layers=3, query heads=4, KV heads=2, head dim=16) does not fit the model "
            "(layers=2, query heads=4, KV heads=2, head dim=16)",
        ),
        (
            dict(),
            EvictionConfig(B + 4, L),
            "scorer trained for tiny-llama with B=12, L=4 does not fit this cache (B=16, L=4)",
        ),
        (
            dict(),
            EvictionConfig(B - 4, L),
            "scorer trained for tiny-llama with B=12, L=4 does not fit this cache (B=8, L=4)",
        ),
        (dict(), EvictionConfig(B, L - 1), "with B=12, L=4 does not fit this cache (B=12, L=3)"),
        (dict(), EvictionConfig(B, L, protect_prompt=True), "with B=12, L=4 does not fit this cache (B=17, L=4)"),
    ],
)
def test_another_model_or_cadence_is_a_one_line_error(llama, scorer_overrides, config, message):
    policy = make_policy("foresight", scorer=random_scorer(llama, **scorer_overrides))
    with pytest.raises(ValueError) as error:
        EvictionEngine(llama, policy, config).generate(random_prompts([5])[0:1], 40)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_sampled_mode_takes_a_compression_step_deterministically_and_records_only_the_later_steps(llama):
    """A prompt longer than B + L is compressed right after its prefill (the decode regime's step): the sampled mode
    keeps there what the deterministic one keeps and records no draw of it; its later steps sample and record."""
    ids = torch.tensor(random_prompts([20 + 2 * L + 1])[0])
    held = {}
    for mode in ("deterministic", "sampled"):
        policy = make_policy("foresight", scorer=random_scorer(llama), mode=mode, seed=3)
        engine = EvictionEngine(llama, policy, EvictionConfig(B, L, sinks=0, protect_prompt=False))
        engine.replay([ids[:21]], [20])  # the compression only
        held[mode] = [layer.entry_positions()[0] for layer in engine.last_cache.layers]
        if mode == "sampled":
            assert policy.records == []
            engine.replay([ids], [20])  # two more steps, sampled
            assert len(policy.records) == 2 * llama.config.num_hidden_layers
    assert all(torch.equal(a, b) for a, b in zip(held["deterministic"], held["sampled"]))


def test_policy_loads_a_saved_scorer_and_refuses_bad_input(llama, tmp_path):
    scorer = random_scorer(llama)
    scorer.save_pretrained(tmp_path / "scorer")
    loaded = make_policy("foresight", scorer=str(tmp_path / "scorer"))
    batch = random_prompts([9], seed=5)
    expected = EvictionEngine(llama, make_policy("foresight", scorer=scorer), EvictionConfig(B, L)).generate(batch, 20)
    assert EvictionEngine(llama, loaded, EvictionConfig(B, L)).generate(batch, 20).tokens == expected.tokens
    with pytest.raises(TypeError):  # a learned policy cannot be built by name alone
        make_policy("foresight")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty is not a scorer folder \(no config.json or model.safetensors\)"):
        make_policy("foresight", scorer=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="unknown eviction mode 'greedy'; allowed: 'deterministic', 'sampled'"):
        make_policy("foresight", scorer=scorer, mode="greedy")


@pytest.mark.slow
def test_the_shipped_default_scorer_runs_on_the_default_model():
    from foresight.models import load_model

    model, tokenizer = load_model("default")
    policy = make_policy("foresight", scorer=str(Path(__file__).resolve().parents[1] / "checkpoints" / "default-paper"))
    assert (policy.scorer.config.budget, policy.scorer.config.interval) == (128, 32)
    prompt = tokenizer.encode("Count from one to one hundred in words: one, two, three, four, five," * 3)
    output = EvictionEngine(model, policy, EvictionConfig(128, 32)).generate([prompt], 200)
    assert output.stats.evictions >= 3 and output.stats.max_entries <= 128 + 32
    with pytest.raises(ValueError, match="scorer trained for default with B=128, L=32 does not fit this cache"):
        EvictionEngine(model, policy, EvictionConfig(256, 32)).generate([prompt], 300)  # caught at its 2nd step
