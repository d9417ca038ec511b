"""Rollouts of the reinforcement stage, their rewards, group advantages and the GRPO objective
(ForesightKV §3.3 Eqs. 7-10, App. E.1; docs/algorithms.md §7).

A rollout is a teacher-forced replay of a stored trace through the frozen model in the eviction
runtime, the learned policy sampling its evictions (Eq. 2: L of the 2L lowest-scoring candidates,
without replacement) at every eviction step and (layer, KV head). The G rollouts of one trace replay
together as the G rows of one batch, so one forward per chunk serves the whole group, and the groups of
several traces can share one replay (`roll_out_together`: every row prefills B + L tokens, so all rows
evict at the same tokens); each row draws from its own seeded generator, so a rollout is the same
whichever process, group or pack replays it.

Each rollout records, per step and layer, the scorer's inputs over its eviction pool (keys, values,
attention features) and the sampled order (`SampledEviction`), stacked here as `EvictionActions`:
the Plackett-Luce log-probability of every recorded eviction under any scorer (the current one, the
one that sampled, the frozen reference) is recomputed from them without running the model again.

The reward, loss ratio and low-entropy damage of a rollout come from `foresight.metrics`, the very
functions `foresight eval` reports, over the same tokens (those predicted after the first eviction).

Size: the GRPO objective's parts (rollouts, rewards, advantages, the clipped loss) as small functions over
one recorded layout (`EvictionActions`), which every part reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from foresight.cadence import eviction_steps, regime_prefill, regime_shift
from foresight.choices import Choice
from foresight.data.trace_store import Trace
from foresight.metrics import (
    DAMAGE_EXPONENT,
    DAMAGE_THRESHOLD,
    LOW_ENTROPY_SHARE,
    DamageTerms,
    TokenDamage,
    loss_ratio,
    scored_tokens,
    thresholded_terms,
    token_damage,
)
from foresight.policies import make_policy
from foresight.policies.foresight import SampledEviction
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.runtime.prefix import ReplayPrefix
from foresight.scorer.eviction_sampling import plackett_luce_logprob
from foresight.scorer.model import ForesightScorer, ScorerConfig

CLIP_EPSILON = 0.2
"""ε of Eq. 10 (App. E.1)."""
LOG_RATIO_CLAMP = 10.0
"""The log-ratio is clamped to ±10 before exponentiating (the authors' code)."""
ADVANTAGE_EPSILON = 1e-8
"""Added to the group's standard deviation in Eq. 9 (a group of equal rewards gets 0 apart: `group_advantages`)."""


class LossReference(Choice):
    """What a rollout's token losses are compared with (ΔL of the reward, the loss ratio): the full-cache
    losses stored with the trace, or the frozen model's own full-cache losses in the dtype it runs in
    (`full_cache_losses`). The stored ones were made in the sampler's dtype; a rollout in another one (a
    bfloat16 model on a CPU with bfloat16 matmuls, docs/notes/pipeline.md) would count the
    rounding of its dtype as damage. Which tokens count (the bottom share by entropy) is read from the
    stored entropies either way."""

    STORED = "stored"
    REPLAY = "replay"


class Rollout(Choice):
    """How the reinforcement stage rolls out a trace: G episodes sampling every eviction step (the paper's),
    or step-level branch groups off one deterministic replay (`trainers.reinforcement.branches`)."""

    EPISODE = "episode"
    BRANCH = "branch"


class Credit(Choice):
    """What an eviction step's advantage is computed from: its rollout's reward (Eq. 9, the paper's),
    or its reward-to-go, the damage to the tokens predicted after the step only."""

    ROLLOUT = "rollout"
    REWARD_TO_GO = "reward_to_go"


@dataclass(frozen=True)
class EvictionActions:
    """The sampled evictions of one trace's group of rows in a replay, stacked over layers and eviction steps.

    keys, values [layers, steps, rows, Hkv, P, D], features [..., P, F*G]: the scorer inputs of each
    step's pool P = 2L (`SampledEviction`); eligible [..., P]; order [..., L]: the pool indices in
    sampled order; evicted [..., L]: their sequence positions; after [steps]: the position of the
    newest token when the step ran (the eviction changes the cache of every later token); temperature:
    the τ the policy sampled at (Eq. 2 reads the keep scores divided by it); layers: the model layers
    the records hold, in order on the first dim (None: all; a subset when only some layers sampled,
    `trainers.reinforcement.branches`).
    """

    keys: torch.Tensor
    values: torch.Tensor
    features: torch.Tensor
    eligible: torch.Tensor
    order: torch.Tensor
    evicted: torch.Tensor
    after: torch.Tensor
    temperature: float = 1.0
    layers: tuple[int, ...] | None = None

    @classmethod
    def stack(
        cls,
        records: Sequence[SampledEviction],
        num_layers: int,
        before: int,
        rows: slice,
        dtype: torch.dtype = torch.float32,
        layers: Sequence[int] | None = None,
    ) -> EvictionActions:
        """Stack a sampled policy's records (step by step, layers in order within a step) of `rows` (one
        trace's group of a replay) that evict together, keeping the steps that ran after a position <
        `before` (a later one changes no prediction of the trace). Scorer inputs are stored in `dtype`.
        `layers`: the layers every step recorded (None: all `num_layers`)."""
        recorded = list(range(num_layers)) if layers is None else list(layers)
        per_step = len(recorded)
        if not records or len(records) % per_step:
            raise ValueError(f"expected the records of whole eviction steps of {per_step} layers, got {len(records)}")
        steps = [records[i : i + per_step] for i in range(0, len(records), per_step)]
        if any(record.layer != layer for step in steps for layer, record in zip(recorded, step)):
            raise ValueError(f"records must hold the layers {recorded} of every step, in order")
        temperatures = {record.temperature for record in records}
        if len(temperatures) != 1:
            raise ValueError(
                f"the records were sampled at several temperatures {sorted(temperatures)}; stack one run's"
            )
        newest = torch.stack([step[0].query_positions[rows, -1] for step in steps])  # [steps, rows]
        if not torch.equal(newest, newest[:, :1].expand_as(newest)):
            raise ValueError("the rows of a rollout group must evict together (replay one trace per group)")
        kept = newest[:, 0] < before
        steps = [step for step, keep in zip(steps, kept.tolist()) if keep]
        if not steps:
            raise ValueError(f"no eviction step ran before position {before}: nothing to learn from this replay")

        def stacked(name: str, as_dtype: torch.dtype | None = None) -> torch.Tensor:
            def value(record: SampledEviction) -> torch.Tensor:
                tensor = getattr(record, name)[rows]
                return tensor if as_dtype is None else tensor.to(as_dtype)

            return torch.stack([torch.stack([value(record) for record in step]) for step in steps], 1)

        return cls(
            keys=stacked("keys", dtype),
            values=stacked("values", dtype),
            features=stacked("features", dtype),
            eligible=stacked("eligible"),
            order=stacked("order"),
            evicted=torch.stack(
                [torch.stack([r.positions[rows].gather(-1, r.order[rows]) for r in step]) for step in steps], 1
            ),
            after=newest[kept, 0],
            temperature=temperatures.pop(),
            layers=None if layers is None else tuple(recorded),
        )

    @property
    def num_rows(self) -> int:
        return self.order.shape[2]

    def scores(self, scorer: ForesightScorer) -> torch.Tensor:
        """Keep scores [layers, steps, rows, Hkv, P] of every pool entry under `scorer` (differentiable)."""
        layers, steps, rows = self.keys.shape[:3]
        inputs = [tensor.flatten(1, 2) for tensor in (self.keys, self.values, self.features)]
        return scorer(*inputs, layers=self.layers).unflatten(1, (steps, rows))

    def logprob(self, scores: torch.Tensor, rule: Callable[..., torch.Tensor] = plackett_luce_logprob) -> torch.Tensor:
        """Log-probability [rows, layers, steps, Hkv] of every recorded eviction (the action probability of
        Eq. 10) under the keep scores `scores` of `self.scores`, at the sampling temperature, by `rule`
        (`trainers.reinforcement.estimators.LOGPROB_RULES`; the default is Plackett-Luce of the sampled order)."""
        pool = torch.arange(scores.shape[-1], device=scores.device).expand_as(scores)
        order, eligible = self.order.to(scores.device), self.eligible.to(scores.device)
        logprob = rule(scores, pool, order, eligible, self.temperature)
        return logprob.movedim(2, 0)

    def first_draw_entropy(self, scores: torch.Tensor) -> torch.Tensor:
        """Entropy [rows, layers, steps, Hkv] of the first draw of Eq. 2 (softmax of the negated scores
        over the pool's eligible entries, at the sampling temperature): how spread the policy is, in nats
        (at most log 2L)."""
        logits = (-scores.float() / self.temperature).masked_fill(
            ~self.eligible.to(scores.device), torch.finfo(torch.float32).min
        )
        return torch.distributions.Categorical(logits=logits).entropy().movedim(2, 0)


@dataclass(frozen=True)
class RolloutScores:
    """Per rollout row: the reward R (docs/algorithms.md §7, or the training reward's damage term), the loss
    ratio and the share of low-entropy tokens damaged (docs/algorithms.md §8), all over the predictions after
    the first eviction; the reward-to-go [rows, steps] of every recorded eviction step (`rewards_to_go`); and
    the reward by the paper's damage term whatever the training reward (`paper_reward`: for an episode R of
    §7, what `foresight eval` reports as −R; for a branch group its d_k, `trainers.reinforcement.branches`)."""

    reward: torch.Tensor
    loss_ratio: torch.Tensor
    damage_share: torch.Tensor
    reward_to_go: torch.Tensor
    paper_reward: torch.Tensor | None = None

    def credited(self, credit: Credit) -> torch.Tensor:
        """The rewards the advantages normalise: [rows] per rollout, or [rows, steps] per eviction step."""
        return self.reward if credit is Credit.ROLLOUT else self.reward_to_go


def score_rollouts(
    nll: Sequence[torch.Tensor],
    first_eviction: Sequence[int | None],
    trace: Trace,
    after: torch.Tensor,
    share: float = LOW_ENTROPY_SHARE,
    threshold: float = DAMAGE_THRESHOLD,
    exponent: float = DAMAGE_EXPONENT,
    reference_nll: torch.Tensor | None = None,
    terms: DamageTerms = thresholded_terms,
) -> RolloutScores:
    """Reward, loss ratio, damage share and rewards-to-go of replays of `trace` (`nll` per row [T - 1])
    against its stored full-cache loss and entropy: R = −(1/|S|) Σ_{t∈S} ΔL_t^p·1[ΔL_t > η] over the
    tokens S predicted after the first eviction whose full-cache entropy is in their bottom `share`
    (`token_damage`); `after` [steps]: the position of each recorded eviction step. `reference_nll` [T - 1]:
    the full-cache losses to compare with (`LossReference`; None: the trace's stored ones). `terms`: the
    reward's damage term per token (`trainers.reinforcement.estimators.REWARD_RULES`; the default is the paper's, above);
    the damage share counts ΔL > η whatever it is, and the paper reward is the paper's."""
    reference = trace.token_nll if reference_nll is None else reference_nll
    rewards, ratios, shares, to_go, paper = [], [], [], [], []
    for row_nll, first in zip(nll, first_eviction, strict=True):
        scored = scored_tokens(row_nll.numel(), first)
        evicted, full, entropy = row_nll[scored], reference[scored], trace.token_entropy[scored]
        damage = token_damage(evicted, full, entropy, share=share, threshold=threshold, exponent=exponent, terms=terms)
        counts = damage.counts()
        rewards.append(-counts.penalty)
        paper.append(
            -counts.penalty
            if terms is thresholded_terms
            else -token_damage(evicted, full, entropy, share, threshold, exponent).counts().penalty
        )
        ratios.append(loss_ratio(evicted, full))
        shares.append(counts.share)
        to_go.append(rewards_to_go(damage, scored, after))
    return RolloutScores(
        *(torch.tensor(values) for values in (rewards, ratios, shares)), torch.stack(to_go).float(), torch.tensor(paper)
    )


def rewards_to_go(damage: TokenDamage, scored: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """[steps] the reward-to-go of each eviction step s of one rollout: minus the damage terms of the
    low-entropy tokens predicted after the step (positions > after_s, the predictions its eviction can
    change), over |S| as the rollout reward, R_s = −(1/|S|) Σ_{t∈S, t > after_s} ΔL_t^p·1[ΔL_t > η].
    The first step's is the rollout reward R: every scored token follows it."""
    terms = torch.zeros(scored.numel(), dtype=damage.terms.dtype)
    terms[scored] = damage.terms
    later = terms.flip(0).cumsum(0).flip(0)  # later[j] = Σ_{t >= j} terms[t]
    low = int(damage.low_entropy.sum())
    return -later[after.cpu() + 1] / low if low else torch.zeros(after.numel(), dtype=terms.dtype)


@dataclass(frozen=True)
class Backbone:
    """A branch group's deterministic replay over its whole trace (the policy users deploy), by the paper's
    figures whatever the training reward: R of §3.3 (η = 1.5, p = 2; minus −R) and the loss ratio."""

    reward: float
    loss_ratio: float


@dataclass(frozen=True)
class GroupRollout:
    """The rollouts of one trace on this process (or one branch group of it, `trainers.reinforcement.branches`): their
    recorded evictions and scores, the eviction steps and tokens the model ran for them (`forward_tokens`,
    row by row), and timings (seconds of the frozen model's forward passes, and of the whole replay).
    `backbone`: a branch group's deterministic replay's figures over its whole trace (None for episodes)."""

    trace_index: int
    actions: EvictionActions
    scores: RolloutScores
    eviction_steps: int
    forward_seconds: float
    seconds: float
    forward_tokens: int = 0
    backbone: Backbone | None = None


def rollout_seeds(seed: int, round_index: int, trace_index: int, rows: Sequence[int]) -> tuple[int, ...]:
    """The sampling seed of each rollout row: a function of (seed, round, trace, row) only."""
    return tuple(
        int(np.random.SeedSequence([seed, round_index, trace_index, row]).generate_state(1)[0]) for row in rows
    )


def roll_out(
    model: torch.nn.Module,
    scorer: ForesightScorer,
    trace: Trace,
    row_seeds: Sequence[int],
    reference_nll: torch.Tensor | None = None,
    **options: Any,
) -> GroupRollout:
    """The rollouts of one trace, one per seed: `roll_out_together` of a single group, with its `options`."""
    return roll_out_together(model, scorer, [trace], [row_seeds], reference_nll=[reference_nll], **options)[0]


@torch.no_grad()
def roll_out_together(
    model: torch.nn.Module,
    scorer: ForesightScorer,
    traces: Sequence[Trace],
    row_seeds: Sequence[Sequence[int]],
    share: float = LOW_ENTROPY_SHARE,
    threshold: float = DAMAGE_THRESHOLD,
    storage_dtype: torch.dtype = torch.float32,
    temperature: float = 1.0,
    exponent: float = DAMAGE_EXPONENT,
    share_prefix: bool = True,
    reference_nll: Sequence[torch.Tensor | None] | None = None,
    step_observer: AbstractContextManager | None = None,
    terms: DamageTerms = thresholded_terms,
) -> list[GroupRollout]:
    """Replay each trace once per seed of its group (`row_seeds[i]`, the same count for every trace), every
    group as consecutive rows of one batch, `scorer` sampling every eviction (Eq. 2) at the B and L it was
    trained for and at `temperature`; record the evictions and score each row. A group's rollouts are
    those it would have alone: its rows draw from their own generators and see only their own tokens.

    Every row prefills the first B + L tokens of its trace (the streaming cadence of §1 from the first token on,
    as in the supervised stage and `foresight eval`), or in the scorer's decode regime its whole prompt when a
    compression follows it (`foresight.cadence.regime_prefill`), so the rows of every trace evict after the same
    tokens; a row past its trace's end replays padding, whose steps and losses its group drops. Until
    the first eviction the rows of a group hold the same tokens, so with `share_prefix` the model runs
    that prefill on one row per trace and the groups reuse it (`foresight.runtime.prefix`; the same
    figures up to float rounding: a one-row matmul may round differently from a G-row one).
    `reference_nll[i]`: the full-cache losses trace i is scored against (`score_rollouts`; None: its
    stored ones). Each group is credited an equal share of the replay's time (its padding steps past a
    shorter trace's end included; the prefill's recording is not counted as forward time).
    `step_observer`: entered around every eviction step of the replay (`EvictionEngine`). `terms`: the
    reward's damage term (`score_rollouts`)."""
    config = scorer.config
    groups = {len(seeds) for seeds in row_seeds}
    if len(row_seeds) != len(traces) or len(groups) != 1 or 0 in groups:
        raise ValueError(
            f"give one non-empty group of seeds per trace, all of one size: got sizes {[len(s) for s in row_seeds]} "
            f"for {len(traces)} traces"
        )
    references = [None] * len(traces) if reference_nll is None else list(reference_nll)
    if len(references) != len(traces):
        raise ValueError(f"give one reference (or None) per trace: got {len(references)} for {len(traces)} traces")
    prefills = [regime_prefill(trace.prompt_length, config.budget, config.interval, config.regime) for trace in traces]
    for trace, prefill in zip(traces, prefills):
        if trace.input_ids.numel() < prefill + 2:
            raise ValueError(
                f"trace {trace.index} has {trace.input_ids.numel()} tokens, too few for an eviction that changes a "
                f"prediction in the {config.regime.value} regime (needs at least {prefill + 2})"
            )
    started = time.perf_counter()
    size = groups.pop()
    seeds = tuple(seed for group in row_seeds for seed in group)
    policy = make_policy("foresight", scorer=scorer, mode="sampled", temperature=temperature, row_seeds=seeds)
    cadence = EvictionConfig(config.budget, config.interval, sinks=0, protect_prompt=False)
    prefix = _groups_prefix(model, traces, cadence, prefills) if share_prefix else None
    engine = EvictionEngine(model, policy, cadence, step_observer=step_observer)
    sequences = [trace.input_ids for trace in traces for _ in range(size)]
    output = engine.replay(sequences, [prefill for prefill in prefills for _ in range(size)], prefix=prefix)
    scored = []
    for index, (trace, reference) in enumerate(zip(traces, references, strict=True)):
        rows = slice(index * size, (index + 1) * size)
        length = trace.input_ids.numel()
        # A step after position T - 3 changes no prediction: the last one, of token T - 1, is made at T - 2.
        actions = EvictionActions.stack(
            policy.records, engine.num_layers, before=length - 2, rows=rows, dtype=storage_dtype
        )
        scores = score_rollouts(
            output.nll[rows],
            output.first_eviction[rows],
            trace,
            actions.after,
            share,
            threshold,
            exponent,
            reference,
            terms,
        )
        scored.append((trace, actions, scores))
    portion = 1 / len(traces)  # of the replay's time, padding past a shorter trace's end included
    seconds = time.perf_counter() - started
    return [
        GroupRollout(
            trace_index=trace.index,
            actions=actions,
            scores=scores,
            eviction_steps=_evictions(trace, config),
            forward_seconds=output.stats.forward_seconds * portion,
            seconds=seconds * portion,
            forward_tokens=round(output.stats.tokens * portion),
        )
        for trace, actions, scores in scored
    ]


def packs(traces: Sequence[Trace], size: int) -> list[list[Trace]]:
    """The traces to replay together in runs of `size` (`roll_out_together`): in order of length, so that a
    pack's rows replay little padding past the shorter traces' ends; one at a time in the given order."""
    ordered = sorted(traces, key=lambda trace: trace.input_ids.numel()) if size > 1 else list(traces)
    return [ordered[start : start + size] for start in range(0, len(ordered), size)]


def full_cache_losses(model: torch.nn.Module, trace: Trace) -> torch.Tensor:
    """The frozen model's loss of every token of `trace` given the ones before it, with the full cache, in
    the dtype the model runs in: [T - 1] float32 on the CPU (`LossReference.REPLAY`). A replay in the
    eviction engine rather than `foresight.data.trace_generation.token_losses`: the rollout's rows run the
    engine's kernels and chunks, so the reference rounds as they do and ΔL is the eviction's alone."""
    engine = EvictionEngine(model, make_policy("full"), None)
    return engine.replay([trace.input_ids], [trace.prompt_length]).nll[0].float().cpu()


def _groups_prefix(
    model: torch.nn.Module, traces: Sequence[Trace], cadence: EvictionConfig, prefills: Sequence[int]
) -> ReplayPrefix:
    """The prefill after which each trace's replay first evicts (`prefills`), recorded on one row per trace. The
    policy is immaterial: before an eviction the forwards depend on the tokens only. One token more is
    fed, so the recorded forward's token losses read their true targets (nothing after the first
    eviction is recorded)."""
    prefix = ReplayPrefix()
    engine = EvictionEngine(model, make_policy("streaming"), cadence)
    engine.replay([trace.input_ids[: p + 1] for trace, p in zip(traces, prefills)], list(prefills), prefix=prefix)
    return prefix


def _evictions(trace: Trace, config: ScorerConfig) -> int:
    """Eviction steps of a trace's replay: the steps of its regime, plus a decode compression."""
    shift = regime_shift(trace.prompt_length, config.budget, config.interval, config.regime)
    return eviction_steps(trace.input_ids.numel(), config.budget, config.interval, shift) + bool(shift)


def equal_reward_groups(rewards: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Which groups (along `dim`) hold equal rewards only: their advantages are 0 and teach nothing."""
    return (rewards == rewards.narrow(dim, 0, 1)).all(dim)


def group_advantages(rewards: torch.Tensor, epsilon: float = ADVANTAGE_EPSILON, dim: int = -1) -> torch.Tensor:
    """Eq. 9 per group: Â = (R − mean R) / (std R + ε) along `dim`, the G rollouts of one trace (population
    std, as the authors' code). A group of equal rewards gets exactly 0, whatever its rounded mean."""
    if rewards.shape[dim] < 2:
        raise ValueError(f"a group needs at least 2 rollouts to normalise rewards, got {rewards.shape[dim]}")
    mean = rewards.mean(dim, keepdim=True)
    advantages = (rewards - mean) / (rewards.std(dim, unbiased=False, keepdim=True) + epsilon)
    return advantages.masked_fill(equal_reward_groups(rewards, dim).unsqueeze(dim), 0.0)


@dataclass(frozen=True)
class GRPOObjective:
    """The loss to minimise and what it is made of (means over every action of every rollout)."""

    loss: torch.Tensor
    surrogate: torch.Tensor
    kl: torch.Tensor
    clip_fraction: torch.Tensor
    kl_terms: torch.Tensor
    """k3 of every action (detached), shaped as logprob: `kl` is their mean, the KL per (layer, KV head) set
    when an action is one set's draw."""


def k3_kl(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL(π_θ ‖ π_ref) per sampled action: exp(x) − x − 1 with x = log π_ref − log π_θ
    (unbiased for actions drawn from π_θ, never negative)."""
    log_ratio = ref_logprob - logprob
    return log_ratio.exp() - log_ratio - 1


def grpo_objective(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    advantages: torch.Tensor,
    beta: float,
    clip: float = CLIP_EPSILON,
    clamp: float = LOG_RATIO_CLAMP,
) -> GRPOObjective:
    """Minus Eq. 10: −mean[min(r·Â, clip(r, 1 − ε, 1 + ε)·Â)] + β·mean[KL], r = exp(clamp(log π_θ − log π_old)).

    logprob, old_logprob, ref_logprob [rows, ...]: per action (step, layer, KV head) of each rollout
    row; advantages [rows] (one per rollout, §3.3) or [rows, ...] over the leading dims of logprob (one
    per eviction step with reward-to-go credit), broadcast over the trailing ones. Means run over every
    action of every row. clip_fraction: the share of actions whose ratio lies outside [1 − ε, 1 + ε] on the
    side where clipping takes the gradient away."""
    advantage = advantages.reshape(*advantages.shape, *([1] * (logprob.dim() - advantages.dim()))).to(logprob.dtype)
    ratio = (logprob - old_logprob).clamp(-clamp, clamp).exp()
    unclipped, clipped = ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage
    surrogate = torch.minimum(unclipped, clipped)
    kl = k3_kl(logprob, ref_logprob)
    loss = -surrogate.mean() + beta * kl.mean()
    clip_fraction = (clipped < unclipped).float().mean()
    return GRPOObjective(
        loss=loss,
        surrogate=surrogate.mean().detach(),
        kl=kl.mean().detach(),
        clip_fraction=clip_fraction,
        kl_terms=kl.detach(),
    )
