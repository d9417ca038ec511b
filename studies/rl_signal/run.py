"""Signal of the reinforcement stage's policy-gradient estimators: gradient noise scale per forward token, planted reward.

Every choice of `trainers.reinforcement.estimators.Estimator` (the log-probability of the drawn order or of the evicted
set, Eq. 9's advantages or leave-one-out ones, the thresholded or the dense damage term) is measured on the
same episode rollouts (`trainers.reinforcement.rollouts.roll_out`: G rows of a trace, every eviction sampled by Eq. 2),
and on the same step-level branch groups (`trainers.reinforcement.branches.roll_out_branches`: K rows off one
deterministic replay, differing at one eviction step):

- The gradient noise scale B_noise = tr(Σ) / |G|² (McCandlish et al. 2018, "An empirical model of
  large-batch training"), Σ the covariance of one sample's policy gradient over the scorer's trained
  weights and G its mean. A sample is one group (G episodes of a trace, or one branch group; its
  advantages need the whole group); its gradient is that of Eq. 10's surrogate at ratio 1 without the KL
  term, Σ_k Â_k ∇log π(row k) / (rows · actions per row). |G|² is estimated without bias as
  |ḡ|² − tr(Σ̂)/M over M samples. B_noise is the batch (in samples) at which the mean gradient's noise
  equals its signal; times the forward tokens one sample costs (`GroupRollout.forward_tokens`, row by row;
  a branch group's share of its backbone included) it is the tokens of rollouts one informative step
  needs: lower is better. Episodes and branch groups estimate different gradients (of the sampled
  policy's reward at every step, of one step's draw against the deterministic policy's), so each kind's
  B_noise is its own.
  Intervals: 95% bootstrap over the groups of each trace, paired across estimators.
- A planted reward: a penalty of 1 on a seeded share of the pool entries of the states the rollouts
  visited (the first rollout's recorded scorer inputs of each trace, held fixed), an episode drawing one
  eviction at every state and scoring −(planted entries evicted). Its true gradient is known up to a
  precision the report states: per state, many draws with the state's own penalty and a leave-one-out
  baseline. Each estimator's mean gradient over n episodes is compared with it (cosine), with the
  episodes (each standing for one rollout) it needs to reach cosines 0.5 and 0.9, and its B_noise.

Nothing is trained; the scorer's weights are those of `scorer`.

    python -m studies rl-signal --traces data/corpus/train52 --count 2 --out runs/bench.md

Size: one study, two measurements over the same rollouts (the noise scale, the planted reward) that share its
sampling, tables and report.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from foresight.bench.common import OneScorer, PlacedSettings, machine, scorer_field, threads_note
from foresight.data.trace_store import Trace, TraceStore
from foresight.models import describe, load_model
from foresight.scorer.eviction_sampling import draw_eviction, guided_eviction, plackett_luce_logprob
from foresight.scorer.model import ForesightScorer, load_scorer
from studies import COMMAND as COMMAND  # how its report names it, where it goes
from studies import REPORTS as REPORTS
from trainers.reinforcement.branches import BranchSettings, RewardSettings, roll_out_branches
from trainers.reinforcement.estimators import ADVANTAGE_RULES, LOGPROB_RULES, Estimator, LogprobRule
from trainers.reinforcement.rollouts import EvictionActions, GroupRollout, roll_out, rollout_seeds

NAME = "rl-signal"
PER_ROW = ("keys", "values", "features", "eligible", "order", "evicted")
"""The `EvictionActions` fields with a rollout-row dim (dim 2)."""
COSINES = (0.5, 0.9)
"""The cosines to the planted reward's true gradient whose sample counts the report gives."""
CHUNKS = 8
"""Independent parts the planted episodes are split into to estimate tr(Σ) from their means."""


@dataclass(frozen=True, kw_only=True)
class Settings(OneScorer, PlacedSettings):
    """The options of `python -m studies rl-signal`, each with its help text."""

    traces: str = field(default="data/corpus/train52", metadata={"help": "traces folder of the scorer's model"})
    count: int = field(default=2, metadata={"help": "traces measured: the first COUNT with at least TOKENS tokens"})
    tokens: int = field(default=320, metadata={"help": "each trace is cut to its first TOKENS tokens (rollout cost)"})
    scorer: tuple[str, ...] = scorer_field("the one whose policy gradient is measured", ("checkpoints/default",))
    groups: int = field(default=4, metadata={"help": "groups of episodes per trace (the samples of B_noise)"})
    group_size: int = field(default=8, metadata={"help": "episodes per group, G"})
    branch_rounds: int = field(default=2, metadata={"help": "rounds of branch groups per trace (0: none)"})
    branch_steps: int = field(default=2, metadata={"help": "branch groups per trace and round"})
    branch_rows: int = field(default=8, metadata={"help": "rows per branch group, K"})
    branch_chunks: int = field(default=2, metadata={"help": "chunks of L tokens a branch continues for, W"})
    sample_temperature: float = field(
        default=0.005, metadata={"help": "τ of Eq. 2 in the rollouts (docs/rl.md's third round)"}
    )
    damage_threshold: float = field(default=1.5, metadata={"help": "η of the thresholded reward"})
    damage_exponent: float = field(default=2.0, metadata={"help": "p of both rewards' damage term"})
    damage_offset: float = field(default=0.0, metadata={"help": "δ of the dense reward (ΔL − δ)₊^p"})
    planted_share: float = field(
        default=0.125, metadata={"help": "share of the pool entries that carry the planted penalty"}
    )
    planted_groups: int = field(
        default=32, metadata={"help": f"groups of G episodes per trace of the planted check (at least {CHUNKS})"}
    )
    reference_draws: int = field(
        default=512, metadata={"help": "draws per state for the planted reward's true gradient"}
    )
    resamples: int = field(default=2000, metadata={"help": "bootstrap resamples of the groups"})
    seed: int = field(default=0, metadata={"help": "seeds the rollouts, the planted entries and the bootstrap"})

    def __post_init__(self) -> None:
        super().__post_init__()
        counts = {
            "count": self.count,
            "groups": self.groups,
            "planted_groups": self.planted_groups,
            "reference_draws": self.reference_draws,
            "resamples": self.resamples,
        }
        if min(counts.values()) < 1 or self.group_size < 2 or self.groups < 2 or self.branch_rounds < 0:
            raise ValueError(
                f"need counts >= 1, groups >= 2, group_size >= 2 and branch_rounds >= 0, got {counts}, "
                f"group_size={self.group_size}, branch_rounds={self.branch_rounds}"
            )
        if self.planted_groups < CHUNKS:
            raise ValueError(
                f"planted_groups must be at least {CHUNKS} (its tr(Σ) comes from {CHUNKS} parts), "
                f"got {self.planted_groups}"
            )
        if not 0 < self.planted_share < 1:
            raise ValueError(f"planted_share must lie in (0, 1), got {self.planted_share}")


MEASURED_REWARDS = ("thresholded", "dense")
"""The reward rules measured: the two each rollout is scored by (`run`: reward is the dense one's,
paper_reward the thresholded one's)."""


def estimators(settings: Settings) -> list[Estimator]:
    """Every combination of the per-group rules, the paper's (order, group_normalised, thresholded) first."""
    return [
        Estimator(reward, advantage, logprob, settings.damage_offset)
        for logprob, advantage, reward in itertools.product(LOGPROB_RULES, ADVANTAGE_RULES, MEASURED_REWARDS)
    ]


def model_and_scorer(
    store: TraceStore, settings: PlacedSettings, scorer: str
) -> tuple[torch.nn.Module, ForesightScorer]:
    """The model that made `store`'s traces and `scorer`, placed as `settings` say, checked to fit each other."""
    model, _ = load_model(store.settings["model"], device=settings.run_device, dtype=settings.run_dtype)
    loaded = load_scorer(scorer).to(settings.run_device)
    loaded.check_compatible(describe(model))
    return model, loaded


def run(settings: Settings) -> str:
    """Roll out, measure every estimator, check the planted reward; the report's markdown section."""
    started = time.perf_counter()
    store = TraceStore(settings.traces)
    model, scorer = model_and_scorer(store, settings, settings.learned[1])
    traces = measured_traces(store, settings, scorer.config.budget + scorer.config.interval)
    scoring = {
        "temperature": settings.sample_temperature,
        "threshold": settings.damage_threshold,
        "exponent": settings.damage_exponent,
        "terms": Estimator("dense", offset=settings.damage_offset).damage_terms,
    }
    episodes = [
        [
            roll_out(
                model,
                scorer,
                trace,
                rollout_seeds(settings.seed, index, trace.index, range(settings.group_size)),
                **scoring,
            )
            for index in range(settings.groups)
        ]
        for trace in tqdm(traces, desc="episodes", leave=False)
    ]  # reward: the dense rule's; paper_reward: the thresholded one's
    branches = BranchSettings(settings.branch_rows, settings.branch_chunks, settings.branch_steps)
    branch_groups = [
        [
            group
            for index in range(settings.branch_rounds)
            for group in roll_out_branches(
                model,
                scorer,
                trace,
                branches,
                range(settings.branch_rows),
                seed=settings.seed,
                round_index=index,
                temperature=scoring["temperature"],
                reward=RewardSettings(
                    threshold=scoring["threshold"], exponent=scoring["exponent"], terms=scoring["terms"]
                ),
            )
        ]
        for trace in tqdm(traces if settings.branch_rounds else [], desc="branch groups", leave=False)
    ]
    kinds = [("episodes", episodes), *((("branch groups", branch_groups),) if settings.branch_rounds else ())]
    noise = {
        kind: noise_scales(scorer, groups, estimators(settings), settings.resamples, settings.seed)
        for kind, groups in kinds
    }
    tokens = {
        kind: float(np.mean([group.forward_tokens for trace_groups in groups for group in trace_groups]))
        for kind, groups in kinds
    }
    branch_tokens = tokens.get("branch groups", math.nan)
    planted = planted_check(scorer, [trace_groups[0].actions for trace_groups in episodes], settings, branch_tokens)
    seconds = time.perf_counter() - started
    return report(settings, traces, noise, tokens, planted, seconds)


def measured_traces(store: TraceStore, settings: Settings, prefill: int) -> list[Trace]:
    """The first `count` traces with at least `tokens` tokens, cut to `tokens` (equal lengths: the planted
    check stacks their states)."""
    if settings.tokens < prefill + 2:
        raise ValueError(
            f"tokens must be at least B + L + 2 = {prefill + 2} for an eviction to change a prediction, "
            f"got {settings.tokens}"
        )
    long = [trace for trace in store if trace.input_ids.numel() >= settings.tokens][: settings.count]
    if len(long) < settings.count:
        raise ValueError(
            f"{settings.traces} holds {len(long)} traces of {settings.tokens} tokens or more, fewer than "
            f"count={settings.count}"
        )
    end = settings.tokens
    return [
        dataclasses.replace(
            trace,
            input_ids=trace.input_ids[:end],
            token_nll=trace.token_nll[: end - 1],
            token_entropy=trace.token_entropy[: end - 1],
        )
        for trace in long
    ]


# -- the noise scale on the rollouts' own rewards ---------------------------------------------------------
def trained_parameters(scorer: ForesightScorer) -> list[torch.nn.Parameter]:
    """What the reinforcement stage trains: every weight but b2 (`trainers.scorer_module.UNTRAINED`)."""
    return [scorer.w1, scorer.b1, scorer.w2]


def row(actions: EvictionActions, index: int) -> EvictionActions:
    """One rollout row's recorded evictions."""
    return dataclasses.replace(actions, **{name: getattr(actions, name)[:, :, index : index + 1] for name in PER_ROW})


def score_vectors(scorer: ForesightScorer, actions: EvictionActions, rule: LogprobRule) -> torch.Tensor:
    """[rows, weights] ∇ Σ log π over every eviction of each rollout row, w.r.t. the trained weights (one
    backward per row)."""
    vectors = []
    for index in range(actions.num_rows):
        single = row(actions, index)
        logprob = single.logprob(single.scores(scorer), rule)
        grads = torch.autograd.grad(logprob.sum(), trained_parameters(scorer))
        vectors.append(torch.cat([grad.flatten() for grad in grads]).float().cpu())
    return torch.stack(vectors)


@dataclass(frozen=True)
class NoiseScale:
    """One estimator's figures: the share of groups whose advantages are all 0, |G|² / |ḡ|² (how much of the
    mean gradient's squared norm is signal), B_noise in groups with its interval, and each resample's
    B_noise (paired with the other estimators' resamples)."""

    estimator: Estimator
    zero_share: float
    signal_share: float
    groups: float
    resampled: np.ndarray


def noise_scales(
    scorer: ForesightScorer,
    groups: Sequence[Sequence[GroupRollout]],
    rules: Sequence[Estimator],
    resamples: int,
    seed: int,
) -> list[NoiseScale]:
    """B_noise of each estimator over the groups (`groups[trace][group]`), from the Gram matrices of the
    rollouts' score vectors (each sample's gradient is a combination of its rows' vectors)."""
    flat = [group for trace_groups in groups for group in trace_groups]
    grams = {}
    for name, rule in LOGPROB_RULES.items():
        vectors = torch.cat([score_vectors(scorer, group.actions, rule) for group in flat])
        grams[name] = (vectors @ vectors.T).double()
        del vectors
    actions = flat[0].actions.order[..., 0].numel() // flat[0].actions.num_rows  # evictions per rollout
    size = flat[0].actions.num_rows
    counts = [len(trace_groups) for trace_groups in groups]
    offsets = np.cumsum([0, *counts])[:-1]
    generator = np.random.default_rng(seed)
    picks = [
        np.concatenate([offset + generator.integers(0, n, n) for offset, n in zip(offsets, counts)])
        for _ in range(resamples)
    ]  # each trace's groups resampled on their own
    figures = []
    for rule in rules:  # the rewards: paper_reward is the thresholded one, reward the dense one (`run`)
        rewards = torch.stack(
            [group.scores.reward if rule.reward == "dense" else group.scores.paper_reward for group in flat]
        ).double()
        advantages = rule.advantages(rewards, dim=1)  # [M, G]
        combine = torch.zeros(len(flat), len(flat) * size, dtype=torch.float64)
        for index in range(len(flat)):
            combine[index, index * size : (index + 1) * size] = advantages[index] / (size * actions)
        gram = (combine @ grams[rule.logprob] @ combine.T).numpy()
        point = noise_scale(gram)
        zero = float((advantages == 0).all(1).double().mean())
        signal = max(point[1], 0.0) / point[2] if point[2] > 0 else 0.0
        figures.append(
            NoiseScale(rule, zero, signal, point[0], np.array([noise_scale(gram[np.ix_(p, p)])[0] for p in picks]))
        )
    return figures


def noise_scale(gram: np.ndarray) -> tuple[float, float, float]:
    """(B_noise, unbiased |G|², |ḡ|²) of M samples from their Gram matrix [M, M]: tr(Σ̂) with the M − 1
    divisor, |G|² = |ḡ|² − tr(Σ̂)/M; B_noise is inf where |G|² is not above 0 (no signal resolved)."""
    samples = gram.shape[0]
    mean_norm = gram.sum() / samples**2
    trace = (np.trace(gram) - samples * mean_norm) / (samples - 1)
    signal = mean_norm - trace / samples
    return (trace / signal if signal > 0 else math.inf), signal, mean_norm


# -- the planted reward ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlantedFigures:
    """One (log-probability, advantage) pair's planted check: cosine to the true gradient at each episode
    count of `episodes`, and B_noise in groups."""

    logprob: str
    advantage: str
    cosines: list[float]
    groups: float
    group_tokens: float | None = None  # forward tokens of one group, where not an episode group's


@dataclass(frozen=True)
class Planted:
    """The planted check: the episode counts, the true gradient's precision (cosine of two independent
    halves of its draws), the states per trace and each pair's figures."""

    episodes: list[int]
    reference_cosine: float
    states: int
    rows: list[PlantedFigures]


@dataclass(frozen=True)
class PlantedStates:
    """The planted check's states, held fixed: the keep scores of their pools [layers, steps, traces, Hkv, P] (no
    graph), which pool entries may be evicted and which carry the penalty, and the evictions a state draws."""

    scores: torch.Tensor
    eligible: torch.Tensor
    penalised: torch.Tensor
    num_evict: int


def planted_check(
    scorer: ForesightScorer, recorded: Sequence[EvictionActions], settings: Settings, branch_tokens: float
) -> Planted:
    """The planted reward's true gradient and each estimator's approach to it (module docstring), on the
    states of the first rollout row of each trace's `recorded` evictions, held fixed; then per-layer branch
    groups (`planted_branches`), with and without a golden-swap row, costed at `branch_tokens` a group."""
    states = dataclasses.replace(
        recorded[0],
        **{name: torch.cat([getattr(row(actions, 0), name) for actions in recorded], dim=2) for name in PER_ROW},
    )
    scores = states.scores(scorer)  # [layers, steps, traces, Hkv, P], a graph to the trained weights
    fixed, eligible = scores.detach(), states.eligible.to(scores.device)
    generator = torch.Generator(device=fixed.device).manual_seed(settings.seed)
    planted = (torch.rand(fixed.shape, generator=generator, device=fixed.device) < settings.planted_share) & eligible
    num_evict = states.order.shape[-1]

    def weights_of(gradient: torch.Tensor) -> torch.Tensor:  # score-space gradient -> trained weights
        grads = torch.autograd.grad(scores, trained_parameters(scorer), gradient, retain_graph=True)
        return torch.cat([grad.flatten() for grad in grads]).double()

    held = PlantedStates(fixed, eligible, planted, num_evict)
    halves = reference_gradient(held, settings, generator)
    true_a, true_b = (weights_of(half) for half in halves)
    truth = (true_a + true_b) / 2
    size = settings.group_size
    count = settings.planted_groups * size
    draw = draw_eviction(fixed.expand(count, *fixed.shape), num_evict, generator, eligible, settings.sample_temperature)
    rewards = (
        -planted.expand(count, *planted.shape).gather(-1, draw.order).sum((-1, -2, -4, -5)).double()
    )  # [n, traces]
    actions = math.prod(fixed.shape[:2]) * fixed.shape[3]  # evictions per episode and trace
    ladder = [size * 2**k for k in range(int(math.log2(settings.planted_groups)) + 1)]
    rows = []
    for logprob_name, rule in LOGPROB_RULES.items():
        leaf = fixed.expand(count, *fixed.shape).clone().requires_grad_()
        pool = torch.arange(fixed.shape[-1], device=fixed.device).expand_as(leaf)
        logprob = rule(leaf, pool, draw.order, eligible, settings.sample_temperature)
        (per_episode,) = torch.autograd.grad(logprob.sum(), leaf)  # [n, layers, steps, traces, Hkv, P]
        del leaf, logprob
        for advantage_name, advantages in ADVANTAGE_RULES.items():
            weight = advantages(rewards.reshape(-1, size, rewards.shape[-1]), dim=1).reshape(rewards.shape)
            weight = weight / (size * actions)  # one group's gradient: Σ_k Â_k ∇log π_k / (G · actions)

            def mean_gradient(episodes: torch.Tensor, weight: torch.Tensor, per_episode: torch.Tensor) -> torch.Tensor:
                """The mean over the groups of `episodes` (whole groups, every trace) of one group's gradient."""
                combined = torch.einsum(
                    "nt,nlsthp->lsthp", weight[episodes].to(per_episode.dtype), per_episode[episodes]
                )
                return weights_of(combined / (len(episodes) // size * rewards.shape[-1]))

            cosines = [
                float(
                    torch.nn.functional.cosine_similarity(
                        mean_gradient(torch.arange(n), weight, per_episode), truth, dim=0
                    )
                )
                for n in ladder
            ]
            group_index = torch.arange(count) // size
            used = settings.planted_groups // CHUNKS * CHUNKS  # equal parts: the groups past them are left out
            parts = [
                mean_gradient(
                    torch.nonzero((group_index % CHUNKS == part) & (group_index < used)).squeeze(-1),
                    weight,
                    per_episode,
                )
                for part in range(CHUNKS)
            ]
            rows.append(
                PlantedFigures(
                    logprob_name, advantage_name, cosines, chunk_noise_scale(parts, used * rewards.shape[-1])
                )
            )
        del per_episode
    for swaps in (0, 1):
        figures = planted_branches(held, settings, generator, swaps, weights_of, truth, ladder)
        rows.append(dataclasses.replace(figures, group_tokens=branch_tokens))
    reference = float(torch.nn.functional.cosine_similarity(true_a, true_b, dim=0))
    return Planted(ladder, reference, actions, rows)


def planted_branches(
    states: PlantedStates,
    settings: Settings,
    generator: torch.Generator,
    swaps: int,
    weights_of,
    truth: torch.Tensor,
    ladder: Sequence[int],
) -> PlantedFigures:
    """Per-layer branch groups on the planted reward: each group one state (a layer at a step) of every trace, its
    K rows drawing that layer's eviction (every KV head) by Eq. 2, the last `swaps` of them instead evicting the
    pool's unpenalised entries first (the golden swap: golden keeps what costs to evict); reward −(penalised
    entries evicted) at that state alone, group-normalised advantages, order log-probability. The cosine of the
    mean group gradient to the true one after n groups per trace, n on the episodes' `ladder`."""
    fixed, eligible, planted = states.scores, states.eligible, states.penalised
    layers, steps, traces = fixed.shape[:3]
    rows = settings.branch_rows
    every = torch.arange(traces, device=fixed.device)
    total = torch.zeros_like(fixed, dtype=torch.float64)
    parts = [torch.zeros_like(total) for _ in range(CHUNKS)]
    cosines = []
    for group in range(ladder[-1]):
        layer = torch.randint(layers, (traces,), generator=generator, device=fixed.device)
        step = torch.randint(steps, (traces,), generator=generator, device=fixed.device)
        scores, allowed, costly = (tensor[layer, step, every] for tensor in (fixed, eligible, planted))
        temperature = settings.sample_temperature
        expanded = scores.expand(rows - swaps, *scores.shape)
        orders = draw_eviction(expanded, states.num_evict, generator, allowed, temperature)
        order = orders.order
        if swaps:
            swap = guided_eviction(scores, states.num_evict, costly, allowed, temperature).order
            order = torch.cat([order, swap.expand(swaps, *swap.shape)])
        rewards = -costly.expand(rows, *costly.shape).gather(-1, order).sum((-1, -2)).double()  # [K, traces]
        weight = ADVANTAGE_RULES["group_normalised"](rewards[None], dim=1)[0]
        leaf = scores.expand(rows, *scores.shape).clone().requires_grad_()
        pool = torch.arange(scores.shape[-1], device=fixed.device).expand_as(leaf)
        logprob = plackett_luce_logprob(leaf, pool, order, allowed, temperature).sum(-1)  # [K, traces]
        (gradient,) = torch.autograd.grad((logprob * weight.to(logprob.dtype)).sum() / rows, leaf)
        contribution = torch.zeros_like(total)
        contribution[layer, step, every] = gradient.sum(0).double()
        total += contribution
        parts[group % CHUNKS] += contribution
        if group + 1 in ladder:
            mean = weights_of((total / ((group + 1) * traces)).to(fixed.dtype))
            cosines.append(float(torch.nn.functional.cosine_similarity(mean, truth, dim=0)))
    per_part = ladder[-1] // CHUNKS * traces
    means = [weights_of((part / per_part).to(fixed.dtype)) for part in parts]
    name = f"per-layer branch groups (K = {rows}" + (f", {swaps} golden swap)" if swaps else ")")
    return PlantedFigures("order", f"group_normalised, {name}", cosines, chunk_noise_scale(means, ladder[-1] * traces))


def reference_gradient(
    states: PlantedStates, settings: Settings, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent estimates (halves of the draws) of the planted reward's true gradient w.r.t. the keep
    scores: every state's own penalty −(planted entries evicted), its leave-one-out baseline over the draws
    at that state, and the order's log-probability (unbiased: the penalty reads the set only)."""
    fixed, eligible, planted, num_evict = states.scores, states.eligible, states.penalised, states.num_evict
    halves = []
    for _ in range(2):
        draws = max(2, settings.reference_draws // 2)
        draw = draw_eviction(
            fixed.expand(draws, *fixed.shape), num_evict, generator, eligible, settings.sample_temperature
        )
        penalty = -planted.expand(draws, *planted.shape).gather(-1, draw.order).sum(-1).double()  # [draws, states...]
        baseline = (penalty.sum(0, keepdim=True) - penalty) / (draws - 1)
        leaf = fixed.expand(draws, *fixed.shape).clone().requires_grad_()
        pool = torch.arange(fixed.shape[-1], device=fixed.device).expand_as(leaf)
        logprob = plackett_luce_logprob(leaf, pool, draw.order, eligible, settings.sample_temperature)
        (gradient,) = torch.autograd.grad((logprob * (penalty - baseline).to(logprob.dtype)).sum() / draws, leaf)
        halves.append(gradient.sum(0))
    return halves[0], halves[1]


def chunk_noise_scale(parts: Sequence[torch.Tensor], samples: int) -> float:
    """B_noise in samples from the means of K equal, independent parts of `samples` samples: tr(Σ) =
    (samples / K) · Σ_k |c_k − c̄|² / (K − 1), |G|² = |c̄|² − tr(Σ)/samples."""
    stacked = torch.stack(list(parts))
    mean = stacked.mean(0)
    trace = samples / len(parts) * float(((stacked - mean) ** 2).sum()) / (len(parts) - 1)
    signal = float(mean.square().sum()) - trace / samples
    return trace / signal if signal > 0 else math.inf


# -- the report -----------------------------------------------------------------------------------------
def number(value: float, form: str = ",.0f") -> str:
    return "∞" if math.isinf(value) else "n/a" if math.isnan(value) else format(value, form)


def tokens_text(groups: float, group_tokens: float) -> str:
    return "∞ (no signal resolved)" if math.isinf(groups) else number(groups * group_tokens)


def interval(values: np.ndarray, form: str = ",.0f") -> str:
    """The 95% bootstrap interval of `values` (inf allowed; undefined resamples, inf / inf, left out)."""
    kept = values[~np.isnan(values)]
    if not kept.size:
        return "[n/a]"
    low, high = (float(np.quantile(kept, q, method="inverted_cdf")) for q in (0.025, 0.975))
    return f"[{number(low, form)}, {number(high, form)}]"


def report(
    settings: Settings,
    traces: Sequence[Trace],
    noise: dict[str, list[NoiseScale]],
    tokens: dict[str, float],
    planted: Planted,
    seconds: float,
) -> str:
    today, today_tokens = noise["episodes"][0], tokens["episodes"]
    lines = [
        f"### Policy-gradient signal of the reinforcement stage's estimators ({torch.device(settings.run_device).type})",
        "",
        f"Command: `{settings.command}` {threads_note()}",
        "",
        (
            f"Scorer `{settings.learned[1]}`, traces {', '.join(str(trace.index) for trace in traces)} of `{settings.traces}` "
            f"({', '.join(sorted({trace.source for trace in traces}))}) cut to {settings.tokens} tokens; τ = "
            f"{settings.sample_temperature}; episodes: {settings.groups} groups of G = {settings.group_size} per trace; branch "
            f"groups: {settings.branch_rounds} rounds × {settings.branch_steps} groups of K = {settings.branch_rows} "
            f"rows, W = {settings.branch_chunks} chunks, per trace; forward tokens per group: "
            + ", ".join(f"{kind} {count:,.0f}" for kind, count in tokens.items())
            + f"; {machine(settings.run_device)}, {seconds:.0f} s."
        ),
        "",
        (
            "B_noise = tr(Σ) / |G|² of one group's policy gradient over the trained weights, in forward tokens (the "
            "rollout tokens at which the mean gradient's noise equals its signal: lower is better); signal share "
            "= |G|² / |ḡ|² of the measured mean; 95% bootstrap over each trace's groups (paired within a kind); "
            "ratio = the first row's B_noise / this row's."
        ),
        "",
        "| rollouts | log-prob / advantage / reward | groups with Â = 0 | signal share | B_noise (forward tokens) | ratio |",
        "|---|---|---:|---:|---|---|",
    ]
    with np.errstate(invalid="ignore", divide="ignore"):
        for kind, rows in noise.items():
            for figures in rows:
                scale = today_tokens / tokens[kind]
                ratio = today.groups / figures.groups * scale if figures.groups else math.inf
                lines.append(
                    f"| {kind} | {figures.estimator.name} | {figures.zero_share:.0%} | {figures.signal_share:.2f} | "
                    f"{tokens_text(figures.groups, tokens[kind])} {interval(figures.resampled * tokens[kind])} | "
                    f"{number(ratio, '.3g')} {interval(today.resampled / figures.resampled * scale, '.3g')} |"
                )
    lines += [
        "",
        (
            f"Planted reward: a penalty of 1 on {settings.planted_share:.1%} of the pool entries at the {planted.states} "
            f"states of each trace's first episode (held fixed), {settings.planted_groups * settings.group_size} episodes per trace; the "
            f"true gradient from {settings.reference_draws} draws per state (cosine of its two halves: "
            f"{planted.reference_cosine:.3f}). Cosine of each estimator's mean gradient to it, by episodes per trace "
            "(an episode stands for one rollout):"
        ),
        "",
        "| log-prob / advantage | "
        + " | ".join(f"n = {n}" for n in planted.episodes)
        + " | "
        + " | ".join(f"episodes to {c}" for c in COSINES)
        + " | B_noise (forward tokens) |",
        "|---|" + "---:|" * (len(planted.episodes) + len(COSINES) + 1),
    ]
    for figures in planted.rows:
        reached = [
            next(
                (f"{n}" for n, value in zip(planted.episodes, figures.cosines) if value >= c),
                f"> {planted.episodes[-1]}",
            )
            for c in COSINES
        ]
        lines.append(
            f"| {figures.logprob} / {figures.advantage} | "
            + " | ".join(f"{value:.3f}" for value in figures.cosines)
            + " | "
            + " | ".join(reached)
            + f" | {tokens_text(figures.groups, figures.group_tokens or today_tokens)} |"
        )
    return "\n".join(lines)
