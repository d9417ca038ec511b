"""The estimator of the reinforcement stage, rule by rule and by name: the reward's damage term per token,
the group advantage and the log-probability of a sampled eviction.

Each rule is one entry of one table below; `Estimator` resolves the names a run's config gives
(`model.reward_rule`, `model.advantage_rule`, `model.logprob_rule`) in this one place, with a one-line
error naming the allowed ones, and the names are saved with the run's hyper-parameters and written on
the scorer's card. To add a rule, add a function of the table's signature and its entry:

- reward (`foresight.metrics.DamageTerms`): the damage term of each low-entropy token from its ΔL, η and
  p (and δ = `model.damage_offset` for the dense rule); the reward is minus their mean over the low-entropy
  tokens. Whatever the rule, `foresight eval` and the logged damage share report the paper's thresholded −R.
- advantage (`AdvantageRule`): the advantages of a group's rewards along a dim (the G rollouts of a trace,
  or the K branches of a step); a batch-wide rule (`BATCH_ADVANTAGE_RULES`) scales by the spread of every
  reward of the optimisation step's groups, given to it stacked [groups, K].
- log-probability (`LogprobRule`): of a recorded eviction under keep scores, with
  `foresight.scorer.eviction_sampling.plackett_luce_logprob`'s arguments (scores, pool, order, eligible,
  temperature); it is the action probability of the clipped ratio and of the KL term.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from foresight.metrics import DAMAGE_OFFSET, DamageTerms, dense_terms, thresholded_terms
from foresight.scorer.eviction_sampling import plackett_luce_logprob, plackett_luce_set_logprob
from trainers.reinforcement.rollouts import ADVANTAGE_EPSILON, equal_reward_groups, group_advantages

GATE_WIDTH = 0.25
"""w of the sigmoid gate σ((ΔL − η) / w) (nats): the weight is 0.5 at η, 0.12 at η − 0.5, 0.018 at η − 1."""

AdvantageRule = Callable[..., torch.Tensor]
"""(rewards, dim=...) -> advantages of the same shape, normalised within each group along `dim`."""
LogprobRule = Callable[..., torch.Tensor]
"""(scores [..., C], pool [..., P], order [..., L], eligible, temperature) -> log-probability [...]."""


def leave_one_out_advantages(rewards: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """RLOO advantages along `dim` (the rollouts of a group; Kool, van Hoof and Welling 2019): Â_k = R_k −
    mean_{j≠k} R_j = G / (G − 1)·(R_k − mean R), unscaled, so a group whose rewards differ by 0.01 moves the
    policy 100 times less than one whose rewards differ by 1 (Eq. 9 gives both ±1). Unbiased: R_k's
    baseline does not depend on R_k. A group of equal rewards gets exactly 0."""
    size = rewards.shape[dim]
    if size < 2:
        raise ValueError(f"a group needs at least 2 rollouts for a leave-one-out baseline, got {size}")
    advantages = (rewards - rewards.mean(dim, keepdim=True)) * (size / (size - 1))
    return advantages.masked_fill(equal_reward_groups(rewards, dim).unsqueeze(dim), 0.0)


def self_critical_advantages(rewards: torch.Tensor, epsilon: float = ADVANTAGE_EPSILON) -> torch.Tensor:
    """Self-critical advantages of a batch's branch rewards (ours, after Rennie et al. 2017's self-critical
    sequence training): Â = d / (rms(d) + ε), d_k = R_k − R_backbone already measured against the
    deterministic policy, the rms over every reward of `rewards` (the optimisation step's groups stacked).

    The baseline is the deployed policy's own reward, not the group's mean, so a draw is pushed up only
    when it beats the deterministic decision; one scale for the whole batch, so a group whose branches
    differ by 1e-4 nats gets 1e-4 of the push of one that misses by 1 (Eq. 9 gives both ±1). The spread is
    taken about the baseline (0), not about the batch's mean: a batch whose draws are all a little worse
    than the backbone then gets advantages near −1, not ±(a tiny std)⁻¹. A batch of zeros gets zeros."""
    return rewards / (rewards.double().square().mean().sqrt().to(rewards.dtype) + epsilon)


def gated_terms(delta: torch.Tensor, threshold: float, exponent: float, width: float = GATE_WIDTH) -> torch.Tensor:
    """A dense damage term weighted toward the tail (ours): (ΔL)₊^p·σ((ΔL − η) / w), w = `width`. Every loss
    increase still counts (a gradient at every token, unlike ΔL^p·1[ΔL > η]), but one below η by a few w
    counts little, so the reward weighs what −R counts (ΔL > η) and not the bulk the loss ratio counts."""
    return delta.clamp_min(0.0).pow(exponent) * torch.sigmoid((delta - threshold) / width)


REWARD_RULES: dict[str, DamageTerms] = {"thresholded": thresholded_terms, "dense": dense_terms, "gated": gated_terms}
"""thresholded: ΔL^p·1[ΔL > η] (ForesightKV §3.3); dense: (ΔL − δ)₊^p, every loss increase past δ; gated:
(ΔL)₊^p·σ((ΔL − η) / w), dense but weighted toward the tail past η."""
ADVANTAGE_RULES: dict[str, AdvantageRule] = {
    "group_normalised": group_advantages,
    "leave_one_out": leave_one_out_advantages,
}
"""group_normalised: (R − mean R) / (std R + ε) (ForesightKV Eq. 9); leave_one_out: R − the mean of the
group's other rewards, in the reward's units (RLOO)."""
BATCH_ADVANTAGE_RULES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"self_critical": self_critical_advantages}
"""self_critical: d_k (a branch's reward minus the deterministic backbone's) over the batch's rms of d; branch
groups only (an episode has no deterministic baseline)."""
LOGPROB_RULES: dict[str, LogprobRule] = {"order": plackett_luce_logprob, "set": plackett_luce_set_logprob}
"""order: Plackett-Luce over the pool in the sampled order (docs/algorithms.md §5); set: of the evicted set in
any order (Kool, van Hoof and Welling 2020), all a reward of the evicted entries depends on."""


@dataclass(frozen=True)
class Estimator:
    """The named rules of one run (the defaults are the paper's), checked when built; `offset` is δ of the
    dense reward rule."""

    reward: str = "thresholded"
    advantage: str = "group_normalised"
    logprob: str = "order"
    offset: float = DAMAGE_OFFSET
    gate_width: float = GATE_WIDTH

    def __post_init__(self) -> None:
        for kind, name, table in (
            ("reward_rule", self.reward, REWARD_RULES),
            ("advantage_rule", self.advantage, {**ADVANTAGE_RULES, **BATCH_ADVANTAGE_RULES}),
            ("logprob_rule", self.logprob, LOGPROB_RULES),
        ):
            if name not in table:
                raise ValueError(f"unknown {kind} {name!r}; allowed: {', '.join(map(repr, table))}")
        if not 0 <= self.offset < math.inf:
            raise ValueError(f"damage_offset (δ of the dense reward) must be a finite number >= 0, got {self.offset}")
        if not 0 < self.gate_width < math.inf:
            raise ValueError(
                f"damage_gate_width (w of the gated reward) must be a finite number > 0, got {self.gate_width}"
            )

    @property
    def name(self) -> str:
        """ "logprob / advantage / reward", e.g. "order / group_normalised / thresholded" (the paper's)."""
        return f"{self.logprob} / {self.advantage} / {self.reward}"

    @property
    def damage_terms(self) -> DamageTerms:
        rule = REWARD_RULES[self.reward]
        if rule is dense_terms:
            return functools.partial(rule, offset=self.offset)
        return functools.partial(rule, width=self.gate_width) if rule is gated_terms else rule

    @property
    def batch_wide(self) -> bool:
        """Whether the advantage rule reads the whole optimisation step's rewards (`batch_advantages`)."""
        return self.advantage in BATCH_ADVANTAGE_RULES

    @property
    def advantages(self) -> AdvantageRule:
        """The per-group rule (`batch_wide` False)."""
        return ADVANTAGE_RULES[self.advantage]

    @property
    def batch_advantages(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The batch-wide rule (`batch_wide` True), of the step's rewards stacked [groups, K]."""
        return BATCH_ADVANTAGE_RULES[self.advantage]

    @property
    def action_logprob(self) -> LogprobRule:
        return LOGPROB_RULES[self.logprob]

    def describe(self) -> str:
        """The rules in words, for the model card."""
        reward = {"dense": f"dense (δ = {self.offset})", "gated": f"gated (w = {self.gate_width})"}.get(
            self.reward, self.reward
        )
        return f"reward rule {reward}, advantage rule {self.advantage}, log-probability rule {self.logprob}"
