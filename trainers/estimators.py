"""The estimator of the reinforcement stage, rule by rule and by name: the reward's damage term per token,
the group advantage and the log-probability of a sampled eviction.

Each rule is one entry of one table below; `Estimator` resolves the names a run's config gives
(`model.reward_rule`, `model.advantage_rule`, `model.logprob_rule`) in this one place, with a one-line
error naming the allowed ones, and the names are saved with the run's hyper-parameters and written on
the scorer's card. To add a rule, add a function of the table's signature and its entry:

- reward (`foresight.metrics.DamageTerms`): the damage term of each low-entropy token from its ΔL, η and
  p; the reward is minus their mean over the low-entropy tokens. Whatever the rule, `foresight eval` and
  the logged damage share report the paper's thresholded −R.
- advantage (`AdvantageRule`): the advantages of a group's rewards along a dim (the G rollouts of a trace,
  or the K branches of a step).
- log-probability (`LogprobRule`): of a recorded eviction under keep scores, with
  `foresight.scorer.eviction_sampling.plackett_luce_logprob`'s arguments (scores, pool, order, eligible,
  temperature); it is the action probability of the clipped ratio and of the KL term.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from foresight.metrics import DamageTerms, thresholded_terms
from foresight.scorer.eviction_sampling import plackett_luce_logprob
from trainers.rollouts import group_advantages

AdvantageRule = Callable[..., torch.Tensor]
"""(rewards, dim=...) -> advantages of the same shape, normalised within each group along `dim`."""
LogprobRule = Callable[..., torch.Tensor]
"""(scores [..., C], pool [..., P], order [..., L], eligible, temperature) -> log-probability [...]."""

REWARD_RULES: dict[str, DamageTerms] = {"thresholded": thresholded_terms}
"""thresholded: ΔL^p·1[ΔL > η] (ForesightKV §3.3)."""
ADVANTAGE_RULES: dict[str, AdvantageRule] = {"group_normalised": group_advantages}
"""group_normalised: (R − mean R) / (std R + ε) (ForesightKV Eq. 9)."""
LOGPROB_RULES: dict[str, LogprobRule] = {"order": plackett_luce_logprob}
"""order: Plackett-Luce over the pool in the sampled order (docs/algorithms.md §5)."""


@dataclass(frozen=True)
class Estimator:
    """The named rules of one run (the defaults are the paper's), checked when built."""

    reward: str = "thresholded"
    advantage: str = "group_normalised"
    logprob: str = "order"

    def __post_init__(self) -> None:
        for kind, name, table in (
            ("reward_rule", self.reward, REWARD_RULES),
            ("advantage_rule", self.advantage, ADVANTAGE_RULES),
            ("logprob_rule", self.logprob, LOGPROB_RULES),
        ):
            if name not in table:
                raise ValueError(f"unknown {kind} {name!r}; allowed: {', '.join(map(repr, table))}")

    @property
    def damage_terms(self) -> DamageTerms:
        return REWARD_RULES[self.reward]

    @property
    def advantages(self) -> AdvantageRule:
        return ADVANTAGE_RULES[self.advantage]

    @property
    def action_logprob(self) -> LogprobRule:
        return LOGPROB_RULES[self.logprob]

    def describe(self) -> str:
        """The rules in words, for the model card."""
        return f"reward rule {self.reward}, advantage rule {self.advantage}, log-probability rule {self.logprob}"
