"""Teacher-forced metrics of an evicting run against the full cache (docs/algorithms.md section 8).

Pure functions of per-token tensors, so each has a hand-computed check in the tests. The caller
chooses the tokens (those predicted with an evicted cache, see `scored_tokens`) and pools traces by
concatenating tokens or by adding the counts these functions return.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOW_ENTROPY_SHARE = 0.8  # ForesightKV §2.2: the bottom 80% of a trace's tokens by entropy
DAMAGE_THRESHOLD = 1.5  # η of ForesightKV §3.3: a loss increase above it damages a token
DAMAGE_EXPONENT = 2.0  # p of the reward's damage term ΔL^p (ForesightKV §3.3: ΔL²)
DAMAGE_OFFSET = 0.0  # δ of the dense damage term (ΔL − δ)₊^p (ours)


def scored_tokens(num_predictions: int, first_eviction: int | None) -> torch.Tensor:
    """[num_predictions] bool: the predictions made with an evicted cache.

    Prediction j (of token j + 1) is scored when j >= first_eviction, the first position processed
    after the first eviction step (`ReplayOutput.first_eviction`); none when nothing was evicted."""
    if first_eviction is None:
        return torch.zeros(num_predictions, dtype=torch.bool)
    return torch.arange(num_predictions) >= first_eviction


def loss_ratio(evicted_nll: torch.Tensor, full_nll: torch.Tensor) -> float:
    """Mean NLL with eviction / mean NLL with the full cache over the same tokens (ForesightKV Table 2).

    Pooling traces: concatenate their scored tokens, so every token weighs the same."""
    _check_same_tokens(evicted_nll, full_nll)
    return float(evicted_nll.double().sum() / full_nll.double().sum())


@dataclass(frozen=True)
class EntropyDamage:
    """Counts of the low-entropy damage of one or more traces; add them to pool traces.

    low_entropy: tokens in their trace's bottom share by full-cache entropy;
    damaged: those of them whose loss grew by more than the threshold (ΔL > η);
    squared_sum: Σ ΔL² over the damaged tokens.
    damaged and squared_sum are fractional in a mean over replays of the same tokens (`mean`)."""

    low_entropy: int = 0
    damaged: float = 0
    squared_sum: float = 0.0

    def __add__(self, other: EntropyDamage) -> EntropyDamage:
        return EntropyDamage(
            self.low_entropy + other.low_entropy, self.damaged + other.damaged, self.squared_sum + other.squared_sum
        )

    @staticmethod
    def mean(replays: Sequence[EntropyDamage]) -> EntropyDamage:
        """The mean counts of replays of the same tokens (a sampled policy under several seeds): their
        low-entropy tokens are the same; damaged tokens and Σ ΔL² are averaged."""
        low = {replay.low_entropy for replay in replays}
        if len(low) != 1:
            raise ValueError(f"replays to average must score the same tokens, got low-entropy counts {sorted(low)}")
        total = sum(replays, EntropyDamage())
        return EntropyDamage(low.pop(), total.damaged / len(replays), total.squared_sum / len(replays))

    @property
    def share(self) -> float:
        """Share of low-entropy tokens that are damaged (0 when there are none)."""
        return self.damaged / self.low_entropy if self.low_entropy else 0.0

    @property
    def mean_squared(self) -> float:
        """Mean ΔL² over the damaged tokens: how bad a damaged token is (0 when none)."""
        return self.squared_sum / self.damaged if self.damaged else 0.0

    @property
    def penalty(self) -> float:
        """Σ ΔL² over the damaged tokens / the number of low-entropy tokens: −R, minus the reward of the
        reinforcement stage (docs/algorithms.md §7: the mean runs over all low-entropy tokens and the indicator
        ΔL > η sits inside, so fewer damaged tokens and milder damage both lower it; 0 when none)."""
        return self.squared_sum / self.low_entropy if self.low_entropy else 0.0


def low_entropy_tokens(entropy: torch.Tensor, share: float = LOW_ENTROPY_SHARE) -> torch.Tensor:
    """Bool mask of the tokens whose entropy is at most the `share` quantile of `entropy` (linear
    interpolation, torch.quantile): the bottom `share` of the tokens, ties included."""
    if not 0 < share <= 1:
        raise ValueError(f"low-entropy share must be in (0, 1], got {share}")
    if entropy.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    return entropy <= torch.quantile(entropy.double(), share).to(entropy.dtype)


@dataclass(frozen=True)
class TokenDamage:
    """Per scored token of one trace: whether it is low-entropy (in the bottom share), whether it is
    damaged (low-entropy and ΔL > η), and its damage term (ΔL^p when damaged, else 0, unless a reward rule
    other than the paper's made it; 0 on tokens that are not low-entropy). Kept per token so
    the reinforcement stage can credit each eviction step with the damage to the tokens after it."""

    low_entropy: torch.Tensor
    damaged: torch.Tensor
    terms: torch.Tensor

    def counts(self) -> EntropyDamage:
        """The trace's counts (its `squared_sum` holds Σ ΔL^p, ΔL² at the default p = 2)."""
        return EntropyDamage(int(self.low_entropy.sum()), int(self.damaged.sum()), float(self.terms.sum()))


DamageTerms = Callable[[torch.Tensor, float, float], torch.Tensor]
"""A reward's damage term per token from ΔL [tokens], η and p (`thresholded_terms`, the paper's)."""


def thresholded_terms(delta: torch.Tensor, threshold: float, exponent: float) -> torch.Tensor:
    """ForesightKV §3.3's damage term ΔL^p·1[ΔL > η] per token."""
    return torch.where(delta > threshold, delta, 0.0).pow(exponent)


def dense_terms(delta: torch.Tensor, threshold: float, exponent: float, offset: float = DAMAGE_OFFSET) -> torch.Tensor:
    """A dense damage term per token (ours): (ΔL − δ)₊^p, δ = `offset`, so a loss increase below η still counts
    and a rollout scores by how much it damaged rather than by how many tokens crossed η. η (`threshold`) is
    not read: it still decides which tokens the damage share counts (`token_damage`)."""
    return (delta - offset).clamp_min(0.0).pow(exponent)


def token_damage(
    evicted_nll: torch.Tensor,
    full_nll: torch.Tensor,
    full_entropy: torch.Tensor,
    share: float = LOW_ENTROPY_SHARE,
    threshold: float = DAMAGE_THRESHOLD,
    exponent: float = DAMAGE_EXPONENT,
    terms: DamageTerms = thresholded_terms,
) -> TokenDamage:
    """Low-entropy damage of one trace, token by token (ForesightKV §2.2 and the reward of §3.3).

    All three tensors hold the trace's scored tokens. Low-entropy tokens are the bottom `share` by
    full-cache entropy among them (`low_entropy_tokens`); a low-entropy token is damaged when
    ΔL = evicted_nll - full_nll > threshold, and its damage term is `terms` of its ΔL (ΔL^exponent when
    damaged, the paper's; the reinforcement stage may train on another, `trainers.reinforcement.estimators`)."""
    _check_same_tokens(evicted_nll, full_nll)
    _check_same_tokens(full_entropy, full_nll)
    low = low_entropy_tokens(full_entropy, share)
    delta = evicted_nll.double() - full_nll.double()
    damaged = low & (delta > threshold)
    return TokenDamage(low, damaged, torch.where(low, terms(delta, threshold, exponent), 0.0))


def low_entropy_damage(
    evicted_nll: torch.Tensor,
    full_nll: torch.Tensor,
    full_entropy: torch.Tensor,
    share: float = LOW_ENTROPY_SHARE,
    threshold: float = DAMAGE_THRESHOLD,
) -> EntropyDamage:
    """The counts of `token_damage` with the damage term ΔL² (what `foresight eval` reports)."""
    return token_damage(evicted_nll, full_nll, full_entropy, share, threshold).counts()


def attention_cosine(evicted_output: torch.Tensor, full_output: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of attention outputs [..., D] -> [...], in float32 (ForesightKV Table 7).

    Compare one head's output for the same token in the evicted run and in the full-cache run."""
    if evicted_output.shape != full_output.shape:
        raise ValueError(
            f"attention outputs differ in shape: {tuple(evicted_output.shape)} vs {tuple(full_output.shape)}"
        )
    return F.cosine_similarity(evicted_output.float(), full_output.float(), dim=-1)


def golden_overlap(kept: torch.Tensor, golden_kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How many of a policy's kept candidates the golden schedule also keeps, per head.

    kept [..., N]: positions of the policy's kept candidates (-1 pads); golden_kept [..., K]: the
    golden kept set of the same step, ascending. Returns (hits, kept count), both [...]; the overlap
    of one step is hits / kept count."""
    valid = kept >= 0
    slot = torch.searchsorted(golden_kept, kept.contiguous()).clamp(max=golden_kept.shape[-1] - 1)
    hits = valid & (golden_kept.gather(-1, slot) == kept)
    return hits.sum(-1), valid.sum(-1)


def _check_same_tokens(first: torch.Tensor, second: torch.Tensor) -> None:
    if first.shape != second.shape or first.dim() != 1:
        raise ValueError(
            f"per-token metrics need two 1-D tensors of one length, got {tuple(first.shape)} and {tuple(second.shape)}"
        )
    if first.numel() == 0:
        raise ValueError("no scored tokens: the run never evicted (is every trace shorter than B + L?)")
