"""TriAttention (Mao et al., ICML 2026): score keys by the trigonometric series of calibrated pre-RoPE query centres.

"TriAttention: Efficient Long Reasoning with Trigonometric KV Compression". Pre-RoPE queries concentrate
around a fixed centre E[q], so the attention logit a future query at distance Δ gives a key is, per RoPE
band f, |E[q_f]| |k_f| cos(ω_f Δ + φ_f) with φ_f = arg(E[q_f] conj(k_f)): a trigonometric series in Δ.
The score of a key averages that series over future distances, plus a norm term for the part of the
queries the centre does not explain. No attention is computed; the centres come from `foresight calibrate`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from foresight.masked import masked_moments
from foresight.policies import register
from foresight.policies.triattention_stats import TriAttentionStats, load_stats
from foresight.runtime.policy import EvictionContext, Policy

STD_FLOOR = 1e-6  # the authors' clamp of the per-head standard deviation


def geometric_offsets(max_offset: int, device: torch.device | None = None) -> torch.Tensor:
    """The authors' future distances 1, 2, 4, ... up to `max_offset` (float64), made on `device` (no copy
    from the host inside an eviction step)."""
    return 2.0 ** torch.arange(max_offset.bit_length(), dtype=torch.float64, device=device)


def zscore(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(s - mean) / max(std, 1e-6) over the valid entries of the last dim (population std)."""
    mean, std = masked_moments(scores, valid)
    return (scores - mean) / std.clamp(min=STD_FLOOR)


@register
@dataclass
class TriAttention(Policy):
    """TriAttention keep scores, as the authors' code computes them (`score_keys_for_round`).

    Per query head h of the key's group and RoPE band f, with the calibrated centre q̄ = E[q_f], the mean
    modulus E|q_f|, the key's pre-RoPE band k_f, s the rotary scaling and t the round start (newest
    position + 1): S_h = mean over offsets o of Σ_f s² |q̄||k_f| cos(ω_f (t - p + o) + φ_f) plus
    Σ_f s² (E|q_f| - |q̄|) |k_f|. Then a z-score over the valid candidates per query head (their default
    `normalize_scores`), and the max over the G heads of the group (their per-(layer, KV head) mode).

    The authors recover k_f by inverse-rotating the cached key by its position p; we use the identical
    closed form with the post-RoPE key k'_f = s k_f e^{iω_f p}: the series term is s Re(q̄ c_f conj(k'_f))
    with c_f = mean_o e^{iω_f (t + o)}, so p cancels (the test twin inverse-rotates, as the authors do).

    stats: a `TriAttentionStats` or a folder written by `foresight calibrate` (required); stats made for
      another model shape are refused with a one-line error at the first step.
    max_offset (default 65536): offsets are 1, 2, 4, ..., up to it (the authors' offset_max_length).
    normalize (default True): the per-head z-score before the max over the group.
    The prompt is protected by default, as the authors never compress the prefill.
    """

    name = "triattention"
    summary = "trigonometric series of calibrated pre-RoPE query centres (TriAttention)"
    default_protect_prompt = True
    stats: TriAttentionStats | str | os.PathLike
    max_offset: int = 65536
    normalize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stats, (str, os.PathLike)):
            self.stats = load_stats(self.stats)
        if not isinstance(self.stats, TriAttentionStats):
            raise ValueError(f"stats must be TriAttentionStats or a folder of them, got {type(self.stats).__name__}")
        if self.max_offset < 1:
            raise ValueError(f"triattention max_offset={self.max_offset} must be >= 1")

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        keys = context.keys[..., : context.num_candidates, :].float()  # post-RoPE [batch, Hkv, C, D]
        kv_heads, dim = keys.shape[1], keys.shape[-1]
        query_heads = None if context.queries is None else context.queries.shape[1]
        self.stats.check_fits(context.num_layers, kv_heads, dim, query_heads)
        device = keys.device
        if self.stats.q_mean.device != device:
            self.stats = self.stats.to(device)
        stats = self.stats
        centre = stats.q_mean[context.layer_idx].reshape(kv_heads, -1, dim // 2)  # [Hkv, G, F]
        residual = stats.q_abs_mean[context.layer_idx].reshape(centre.shape) - centre.abs()
        start = (context.newest_position + 1).double()  # the authors' round start t, per row
        angles = (start[:, None] + geometric_offsets(self.max_offset, device))[..., None] * stats.inv_freq.double()
        phase = torch.polar(torch.ones_like(angles), angles).mean(dim=1).to(torch.complex64)  # c_f [batch, F]
        query = centre[None] * phase[:, None, None, :]  # [batch, Hkv, G, F]
        real, imag = keys.chunk(2, dim=-1)
        series = torch.einsum("bhgf,bhcf->bhgc", query.real, real) + torch.einsum("bhgf,bhcf->bhgc", query.imag, imag)
        norm_term = torch.einsum("hgf,bhcf->bhgc", residual, torch.hypot(real, imag))
        scores = stats.rope_scale * (series + norm_term)  # [batch, Hkv, G, C]
        if self.normalize:
            scores = zscore(scores, (context.candidate_positions >= 0)[:, :, None, :])
        return scores.amax(dim=2)
