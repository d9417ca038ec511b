"""The options of the reinforcement stage's policy-gradient estimator, resolved by name in one place
(docs/rl.md, "Estimator options"): which probability of a sampled eviction is differentiated, how a
group's rewards become advantages, and which damage term the reward averages over the low-entropy tokens.
The episode rollouts of `trainers.grpo` and any other rollout scheme read the same `Estimator`; whatever
trains, `foresight eval` reports −R of ForesightKV §3.3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from foresight.choices import Choice
from foresight.metrics import (
    DAMAGE_EXPONENT,
    DAMAGE_OFFSET,
    DAMAGE_THRESHOLD,
    LOW_ENTROPY_SHARE,
    TokenDamage,
    dense_token_damage,
    token_damage,
)
from foresight.scorer.eviction_sampling import LogProbability
from trainers.rollouts import equal_reward_groups, group_advantages


class Advantage(Choice):
    """How a group's rewards become advantages: Eq. 9's (R − mean) / (std + ε), or leave-one-out
    (RLOO, Kool, van Hoof and Welling 2019): R − the mean of the group's other rewards, in the reward's units."""

    GRPO = "grpo"
    RLOO = "rloo"


class Reward(Choice):
    """The damage term the reward averages over the low-entropy tokens: ΔL^p·1[ΔL > η] (ForesightKV §3.3,
    `token_damage`) or (ΔL − δ)₊^p (`dense_token_damage`)."""

    THRESHOLDED = "thresholded"
    DENSE = "dense"


def leave_one_out_advantages(rewards: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """RLOO advantages along `dim` (the G rollouts of a group): Â_k = R_k − mean_{j≠k} R_j = G / (G − 1)·(R_k −
    mean R), unscaled, so a group whose rewards differ by 0.01 moves the policy 100 times less than one whose
    rewards differ by 1 (Eq. 9 gives both ±1). Unbiased: R_k's baseline does not depend on R_k. A group of
    equal rewards gets exactly 0."""
    size = rewards.shape[dim]
    if size < 2:
        raise ValueError(f"a group needs at least 2 rollouts for a leave-one-out baseline, got {size}")
    advantages = (rewards - rewards.mean(dim, keepdim=True)) * (size / (size - 1))
    return advantages.masked_fill(equal_reward_groups(rewards, dim).unsqueeze(dim), 0.0)


@dataclass(frozen=True)
class Estimator:
    """One choice of each option, with the reward's parameters: the low-entropy `share` (0.8), η =
    `threshold` (1.5) of the thresholded term, δ = `offset` (0) of the dense one, and p = `exponent` (2) of
    both. Strings are parsed (a one-line error names the allowed values)."""

    logprob: LogProbability = LogProbability.ORDER
    advantage: Advantage = Advantage.GRPO
    reward: Reward = Reward.THRESHOLDED
    share: float = LOW_ENTROPY_SHARE
    threshold: float = DAMAGE_THRESHOLD
    exponent: float = DAMAGE_EXPONENT
    offset: float = DAMAGE_OFFSET

    def __post_init__(self) -> None:
        for name, choice in (("logprob", LogProbability), ("advantage", Advantage), ("reward", Reward)):
            object.__setattr__(self, name, choice.parse(getattr(self, name)))
        if not 0 <= self.threshold < math.inf or not 0 < self.exponent < math.inf:
            raise ValueError(
                f"need a finite damage_threshold >= 0 and damage_exponent > 0, got damage_threshold={self.threshold}, "
                f"damage_exponent={self.exponent}"
            )
        if not 0 <= self.offset < math.inf:
            raise ValueError(f"need a finite damage_offset >= 0 (δ of the dense reward), got {self.offset}")

    @property
    def name(self) -> str:
        """"logprob/advantage/reward", e.g. "order/grpo/thresholded" (the paper's)."""
        return f"{self.logprob.value}/{self.advantage.value}/{self.reward.value}"

    def describe(self) -> str:
        """The options in words, for a model card or a report."""
        term = (
            f"ΔL^{self.exponent}·1[ΔL > {self.threshold}]" if self.reward is Reward.THRESHOLDED
            else f"(ΔL − {self.offset})₊^{self.exponent}"
        )
        return f"log-probability of the evicted {self.logprob.value}, {self.advantage.value} advantages, reward {term}"

    def damage(self, evicted_nll: torch.Tensor, full_nll: torch.Tensor, full_entropy: torch.Tensor) -> TokenDamage:
        """The reward's damage term of one trace, token by token (the reward is −its mean over the low-entropy tokens)."""
        if self.reward is Reward.THRESHOLDED:
            return token_damage(evicted_nll, full_nll, full_entropy, self.share, self.threshold, self.exponent)
        return dense_token_damage(evicted_nll, full_nll, full_entropy, self.share, self.offset, self.exponent)

    def advantages(self, rewards: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The advantages of the rewards of groups along `dim`."""
        rule = group_advantages if self.advantage is Advantage.GRPO else leave_one_out_advantages
        return rule(rewards, dim=dim)

    def action_logprob(self, scores: torch.Tensor, pool: torch.Tensor, order: torch.Tensor,
                       eligible: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
        """The log-probability of each sampled eviction (`LogProbability.of`)."""
        return self.logprob.of(scores, pool, order, eligible, temperature)

