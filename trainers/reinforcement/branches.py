"""Step-level branch groups of the reinforcement stage (docs/algorithms.md §7, last bullet), in the spirit of
TRPO's "vine" rollouts and VinePPO: credit for one eviction decision from rollouts that differ only there.

A trace is replayed once under the current scorer in deterministic mode: the backbone, the policy that
users deploy and `foresight eval` ranks. At a few of its eviction steps s (`BranchSettings.steps` per
trace, drawn uniformly without replacement among the steps whose eviction changes a prediction of the
trace), the backbone pauses before the step and its state is copied into K rows
(`foresight.runtime.engine.Replay.select_rows`: the cache and its per-entry state, the query ring
buffers, the cadence and the policy's run state), so no forward before s runs again. Each row draws step
s's eviction by Eq. 2 (on `BranchSettings.layers` layers drawn for the group, the others evicting their L
lowest as the backbone does), then continues deterministically for W chunks of L tokens. Branch k's reward
is the backbone's damage minus its own over the same W·L predictions,

    d_k = R_k − R_backbone,  R = −(1/|S_w|) Σ_{t∈S_w} term(ΔL_t),

S_w being the window's low-entropy tokens (the trace's bottom share of scored tokens by full-cache entropy,
the rollout reward's S), term the run's reward rule (`trainers.reinforcement.estimators`; ΔL^p·1[ΔL > η] by default).
The rows differ only at step s, so d_k is step s's own effect, and only step s's sampled actions carry a
log-probability: a group is an `EvictionActions` of one step.

Why: a rollout of the paper samples every step, layer and KV head (~1,000 actions for the default model)
and credits one scalar to all of them; here the K rewards of a group answer for one step's actions, the
backbone's damage cancels in any group-relative advantage, and the deterministic policy's own states
are the ones trained on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from foresight.cadence import regime_prefill, regime_shift
from foresight.data.trace_store import Trace
from foresight.labels import GoldenLabels
from foresight.metrics import (
    DAMAGE_EXPONENT,
    DAMAGE_THRESHOLD,
    LOW_ENTROPY_SHARE,
    DamageTerms,
    loss_ratio,
    low_entropy_tokens,
    scored_tokens,
    thresholded_terms,
    token_damage,
)
from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine, Replay
from foresight.scorer.model import ForesightScorer
from trainers.ranking import spearman
from trainers.reinforcement.rollouts import Backbone, EvictionActions, GroupRollout, RolloutScores


@dataclass(frozen=True)
class BranchSettings:
    """rows: K, branches per group. chunks: W, the chunks of L tokens each branch continues for after its
    step (None: to the trace's end, so a decision whose cost comes late, a prompt fact needed at the answer,
    is rewarded too). steps: branch groups per trace and round. layers: layers that sample a group's step
    (drawn per group; None: every layer). golden_swaps: how many of the K rows (the last ones) do not sample
    but evict, in the sampled layers, what golden keeps least among the same pool (golden's kept set of that
    step decides, the scorer's order within it): the counterfactual a draw at a small τ never makes. They
    need the traces' golden labels."""

    rows: int = 8
    chunks: int | None = 4
    steps: int = 2
    layers: int | None = None
    golden_swaps: int = 0

    def tokens(self, interval: int) -> int | None:
        """Predictions a branch continues for after its step (None: to the trace's end)."""
        return None if self.chunks is None else self.chunks * interval

    def __post_init__(self) -> None:
        short = self.chunks is not None and self.chunks < 1
        if self.rows < 2 or short or self.steps < 1 or (self.layers is not None and self.layers < 1):
            raise ValueError(
                f"need branch_rows >= 2, branch_chunks >= 1 (or null), branch_steps >= 1 and branch_layers >= 1 (or null), got "
                f"branch_rows={self.rows}, branch_chunks={self.chunks}, branch_steps={self.steps}, branch_layers={self.layers}"
            )
        if not 0 <= self.golden_swaps < self.rows:
            raise ValueError(
                f"branch_golden_swaps={self.golden_swaps} must be 0..{self.rows - 1}: at least one of the "
                f"branch_rows={self.rows} rows samples"
            )

    def guided_rows(self, rows: Sequence[int]) -> tuple[int, ...]:
        """The positions in `rows` (this process's rows of the K) that are golden-swap rows."""
        return tuple(at for at, row in enumerate(rows) if row >= self.rows - self.golden_swaps)


@dataclass(frozen=True)
class RewardSettings:
    """What a branch row's reward d_k reads, bundled: the low-entropy share of the scored tokens, the damage
    threshold η, the exponent p and the per-token damage term (`trainers.reinforcement.estimators.REWARD_RULES`;
    the default is the paper's thresholded ΔL^p·1[ΔL > η])."""

    share: float = LOW_ENTROPY_SHARE
    threshold: float = DAMAGE_THRESHOLD
    exponent: float = DAMAGE_EXPONENT
    terms: DamageTerms = thresholded_terms


def changing_steps(length: int, first: int, interval: int) -> int:
    """Eviction steps of a replay of `length` tokens whose first eviction runs after position `first`
    (B + L − 1, or P − 1 before a decode compression) that change a prediction: step j runs after position
    first + jL, and the last prediction is made at T − 2."""
    return max(0, (length - 3 - first) // interval + 1)


def _generator(*keys: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(list(keys)))


def branch_points(steps: int, count: int, seed: int, round_index: int, trace_index: int) -> list[int]:
    """The eviction steps a trace branches at in a round: `count` of its `steps` (all when fewer), uniformly
    without replacement, in order; a function of (seed, round, trace) only, so every process picks the same."""
    picked = _generator(seed, round_index, trace_index).choice(steps, size=min(count, steps), replace=False)
    return sorted(int(step) for step in picked)


def branch_layers(
    num_layers: int, count: int | None, seed: int, round_index: int, trace_index: int, step: int
) -> tuple[int, ...] | None:
    """The layers that sample a group's step: `count` of them uniformly without replacement (None: all)."""
    if count is None or count >= num_layers:
        return None
    picked = _generator(seed, round_index, trace_index, step, num_layers).choice(num_layers, size=count, replace=False)
    return tuple(sorted(int(layer) for layer in picked))


def branch_seeds(seed: int, round_index: int, trace_index: int, step: int, rows: Sequence[int]) -> tuple[int, ...]:
    """The sampling seed of each branch row of a group: a function of (seed, round, trace, step, row) only."""
    return tuple(int(_generator(seed, round_index, trace_index, step, row).integers(2**63)) for row in rows)


@torch.no_grad()
def roll_out_branches(
    model: torch.nn.Module,
    scorer: ForesightScorer,
    trace: Trace,
    settings: BranchSettings,
    rows: Sequence[int],
    seed: int = 0,
    round_index: int = 0,
    temperature: float = 1.0,
    reward: RewardSettings = RewardSettings(),
    storage_dtype: torch.dtype = torch.float32,
    reference_nll: torch.Tensor | None = None,
    labels: GoldenLabels | None = None,
) -> list[GroupRollout]:
    """The branch groups of one trace in one round (module docstring), one `GroupRollout` per branch step, of
    this process's `rows` of the K (all of `range(settings.rows)` on one process): their step's recorded
    evictions and the rewards d_k. `reference_nll`: the full-cache losses ΔL compares with (None: the
    trace's stored ones). `labels`: the trace's golden labels, which golden-swap rows need. The backbone's time
    is shared equally among the groups."""
    config = scorer.config
    started = time.perf_counter()
    if settings.golden_swaps and labels is None:
        raise ValueError(
            f"branch_golden_swaps={settings.golden_swaps} needs golden labels for trace {trace.index}: make them "
            f"with `foresight labels -B {config.budget} -L {config.interval} --regime {config.regime.value}`"
        )
    branched, backbone, num_layers = _branched(
        model, scorer, trace, settings, rows, seed, round_index, temperature, settings.tokens(config.interval), labels
    )
    length = trace.input_ids.numel()
    branched = [
        (
            step,
            branch,
            forked,
            EvictionActions.stack(
                policy.records, num_layers, before=length - 2, rows=slice(None), dtype=storage_dtype, layers=layers
            ),
        )
        for step, branch, forked, policy, layers in branched
    ]
    reference = trace.token_nll if reference_nll is None else reference_nll
    window_scores = _WindowScores(backbone, trace, reference, reward)
    forward_seconds = backbone.run.stats.forward_seconds + sum(
        branch.run.stats.forward_seconds - forked[0] for _, branch, forked, _ in branched
    )
    tokens = backbone.run.stats.tokens + sum(branch.run.stats.tokens - forked[1] for _, branch, forked, _ in branched)
    portion, seconds = 1 / len(branched), time.perf_counter() - started
    return [
        GroupRollout(
            trace_index=trace.index,
            actions=actions,
            scores=window_scores.of(branch, int(actions.after[0]), settings.tokens(config.interval)),
            eviction_steps=branch.evictions - step,
            forward_seconds=forward_seconds * portion,
            seconds=seconds * portion,
            forward_tokens=round(tokens * portion),
            backbone=window_scores.backbone,
        )
        for step, branch, _, actions in branched
    ]


def _branched(
    model: torch.nn.Module,
    scorer: ForesightScorer,
    trace: Trace,
    settings: BranchSettings,
    rows: Sequence[int],
    seed: int,
    round_index: int,
    temperature: float,
    tokens: int | None,
    labels: GoldenLabels | None = None,
) -> tuple[list[tuple], Replay, int]:
    """The backbone's replay of `trace` to its end and, at each branch point, its state copied into the
    `rows`, step s sampled, then `tokens` more fed deterministically (None: to the trace's end). Returns
    (step, branch replay, its (forward seconds, tokens) when forked, the sampling policy, its sampled
    layers) per branch point, the backbone and the model's layer count. Golden-swap rows read `labels`."""
    config = scorer.config
    length = trace.input_ids.numel()
    prefill = regime_prefill(trace.prompt_length, config.budget, config.interval, config.regime)
    compressed = int(regime_shift(trace.prompt_length, config.budget, config.interval, config.regime) > 0)
    steps = changing_steps(length, prefill - 1, config.interval) - compressed  # a compression is never sampled
    if steps < 1:
        raise ValueError(
            f"trace {trace.index} has {length} tokens, too few for an eviction that changes a prediction "
            f"in the {config.regime.value} regime (needs at least {prefill + 2})"
        )
    cadence = EvictionConfig(config.budget, config.interval, sinks=0, protect_prompt=False)
    engine = EvictionEngine(model, make_policy("foresight", scorer=scorer, record=False), cadence)
    backbone = engine.start_replay([trace.input_ids], [prefill])
    guided = settings.guided_rows(rows)
    guide = make_policy("golden", labels=[labels] * len(rows)) if guided else None
    branched = []
    for step in (compressed + point for point in branch_points(steps, settings.steps, seed, round_index, trace.index)):
        engine.advance(backbone, stop_before_step=step)
        layers = branch_layers(engine.num_layers, settings.layers, seed, round_index, trace.index, step)
        policy = make_policy(
            "foresight",
            scorer=scorer,
            mode="sampled",
            temperature=temperature,
            sampled_layers=layers,
            row_seeds=branch_seeds(seed, round_index, trace.index, step, rows),
            guide=guide,
            guided_rows=guided,
        )
        branch = backbone.select_rows([0] * len(rows))
        forked = (branch.run.stats.forward_seconds, branch.run.stats.tokens)
        EvictionEngine(model, policy, cadence).advance(branch, tokens=0)  # step s, sampled
        engine.advance(branch, tokens=tokens)  # then deterministic: W chunks, or to the end
        branched.append((step, branch, forked, policy, layers))
    engine.advance(backbone)
    return branched, backbone, engine.num_layers


@dataclass(frozen=True)
class WindowAgreement:
    """One branch group's d_k by one reward rule over a window of W chunks and over the whole rest of the
    trace (`window`, `rest`, [K] each), and their Spearman correlation across the K rows (NaN where either
    is constant: no ranking to compare)."""

    trace_index: int
    step: int
    rule: str
    chunks: int
    window: torch.Tensor
    rest: torch.Tensor

    @property
    def spearman(self) -> float:
        return float(spearman(self.window, self.rest))


@torch.no_grad()
def window_agreement(
    model: torch.nn.Module,
    scorer: ForesightScorer,
    trace: Trace,
    settings: BranchSettings,
    chunks: Sequence[int],
    rules: dict[str, DamageTerms],
    seed: int = 0,
    round_index: int = 0,
    temperature: float = 1.0,
    reward: RewardSettings = RewardSettings(),
) -> list[WindowAgreement]:
    """Whether W chunks see what a branch decision costs: the branch groups of one trace and round (those
    `roll_out_branches` makes), each row continued to the trace's end, and its d_k by each reward rule of
    `rules` over the W·L predictions after its step (each W of `chunks`) and over every prediction after it.
    Where the two rank the K rows alike the window is wide enough; where not, damage the decision causes
    later (long-range copies) falls outside it and W should grow (docs/rl.md: widen where below 0.5)."""
    branched, backbone, _ = _branched(
        model, scorer, trace, settings, range(settings.rows), seed, round_index, temperature, None
    )
    agreements = []
    for name, terms in rules.items():
        scores = _WindowScores(backbone, trace, trace.token_nll, replace(reward, terms=terms))
        for step, branch, _, policy, _ in branched:
            after = int(policy.records[0].query_positions[0, -1])  # the step ran after this position
            rest = scores.of(branch, after, trace.input_ids.numel()).reward
            agreements += [
                WindowAgreement(
                    trace.index,
                    step,
                    name,
                    width,
                    scores.of(branch, after, width * scorer.config.interval).reward,
                    rest,
                )
                for width in chunks
            ]
    return agreements


class _WindowScores:
    """The rewards of branch rows over a window of predictions against the backbone's (module docstring)."""

    def __init__(
        self,
        backbone: Replay,
        trace: Trace,
        reference: torch.Tensor,
        reward: RewardSettings,
    ) -> None:
        output = backbone.output()
        self.nll, self.reference, self.settings = output.nll[0], reference, reward
        scored = scored_tokens(self.nll.numel(), output.first_eviction[0])
        paper = token_damage(self.nll[scored], reference[scored], trace.token_entropy[scored])  # η = 1.5, p = 2
        self.backbone = Backbone(  # the reported R and loss ratio, whatever the training reward
            reward=-paper.counts().penalty, loss_ratio=loss_ratio(self.nll[scored], reference[scored])
        )
        self.low = torch.zeros(self.nll.numel(), dtype=torch.bool)
        self.low[scored] = low_entropy_tokens(trace.token_entropy[scored], reward.share)

    def reward(self, nll: torch.Tensor, window: slice, terms: DamageTerms | None = None) -> float:
        """−(1/|S_w|) Σ_{t∈S_w} term(ΔL_t) of one row's losses over `window` (0 without low-entropy tokens), by
        the run's reward rule or `terms`."""
        low = self.low[window]
        if not low.any():
            return 0.0
        delta = nll[window].double() - self.reference[window].double()
        rule = self.settings.terms if terms is None else terms
        return -float(rule(delta, self.settings.threshold, self.settings.exponent)[low].mean())

    def of(self, branch: Replay, after: int, size: int | None) -> RolloutScores:
        """d_k, loss ratio and damaged share of the low-entropy tokens of each branch row over the `size`
        predictions after position `after` (fewer at the trace's end; None: to the end), and d_k by the paper's
        damage term."""
        end = self.nll.numel() if size is None else min(after + 1 + size, self.nll.numel())
        window = slice(after + 1, end)
        backbone = self.reward(self.nll, window)
        rows = branch.output().nll
        low = self.low[window]
        rewards = torch.tensor([self.reward(row, window) - backbone for row in rows])
        ratios = torch.tensor([loss_ratio(row[window], self.reference[window]) for row in rows])
        damaged = torch.tensor(
            [
                float(((row[window] - self.reference[window] > self.settings.threshold) & low).sum())
                / max(int(low.sum()), 1)
                for row in rows
            ]
        )
        paper = torch.tensor(
            [
                self.reward(row, window, thresholded_terms) - self.reward(self.nll, window, thresholded_terms)
                for row in rows
            ]
        )
        return RolloutScores(rewards, ratios, damaged, rewards[:, None].float(), paper)
