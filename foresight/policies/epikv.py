"""EpiKV (epiphany-aware eviction, 2026): keep tokens that shift the residual stream in the mid layers.

EpiKV Eq. 1: g_l(t) = ||h_l(t) - h_l(t-1)||_2, the change of the hidden state h_l at layer l made by
token t. EpiKV Eq. 3: z_l(t) = (g_l(t) - mu_l(t)) / (sigma_l(t) + eps), a causal rolling z-score over
the trailing `window` tokens (t included). Score s(t) = z_a(t) - z_b(t): Band A (a ~ 10/32 of the
depth) marks important tokens, Band B (b ~ 21/32) dispensable ones. The score is computed once, when
the token goes through the model, and frozen; it is the same for every layer and KV head.

Layer l means the l-th entry of transformers' `output_hidden_states`, i.e. the output of decoder
layer l - 1, read through a forward hook (no attention is ever computed). Position 0 has no
predecessor: it gets no g, score 0, and does not enter the rolling statistics. The running state
(h_a, h_b of the previous token, the last window - 1 values of g) lives per batch row, so a chunked
prefill or replay gives exactly the scores of feeding the tokens one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from foresight.masked import masked_moments
from foresight.policies import register
from foresight.runtime.cache import StateField
from foresight.runtime.policy import EvictionContext, Policy

Z_EPSILON = 1e-6


def band_layers(num_layers: int) -> tuple[int, int]:
    """Band A and Band B layers (hidden-state indices, 1..num_layers) scaled from EpiKV's 10 and 21 of 32.

    When rounding makes them meet (shallow models), Band B moves one layer deeper."""
    if num_layers < 2:
        raise ValueError(f"EpiKV needs at least 2 decoder layers to compare two bands, got {num_layers}")
    a = min(max(round(10 / 32 * num_layers), 1), num_layers - 1)
    b = min(max(round(21 / 32 * num_layers), a + 1), num_layers)
    return a, b


def rolling_z_scores(values: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """EpiKV Eq. 3 for each new value: z-score against the trailing window ending at it.

    values [..., q] (NaN: no value), history [..., window - 1] the values before them (NaN-padded).
    Mean and (population) std over the non-NaN entries of each window; NaN values get z = 0."""
    window = history.shape[-1] + 1
    windows = torch.cat([history, values], dim=-1).unfold(-1, window, 1)  # [..., q, window]
    mean, std = masked_moments(windows, ~windows.isnan())
    z = (values - mean.squeeze(-1)) / (std.squeeze(-1) + Z_EPSILON)
    return z.nan_to_num(0.0)


@register
@dataclass
class EpiKV(Policy):
    """EpiKV: frozen per-token score z_a - z_b from hidden-state changes; attention-free.

    window (default 64): tokens in the trailing rolling window of the z-score.
    layer_a, layer_b (default None = round(10/32 n) and round(21/32 n), see `band_layers`):
    hidden-state layers of Band A (positive) and Band B (negative). The prompt is protected by default."""

    name = "epikv"
    summary = "rolling z-score of hidden-state change, band A - band B"
    default_protect_prompt = True
    state_fields = (StateField("epikv_score"),)
    window: int = 64
    layer_a: int | None = None
    layer_b: int | None = None
    _previous: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _history: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError(f"epikv window={self.window} must be >= 2 tokens")

    def reset(self) -> None:
        self._previous = None  # [batch, 2, hidden]: h_a, h_b of each row's last token
        self._history = None  # [batch, 2, window - 1]: each row's last g values (NaN: none)

    def run_state(self) -> dict[str, torch.Tensor | None]:
        return {"previous": self._previous, "history": self._history}

    def load_run_state(self, state: dict[str, torch.Tensor | None]) -> None:
        self._previous, self._history = state["previous"], state["history"]

    def bands(self, num_layers: int) -> tuple[int, int]:
        """(a, b) for a model of `num_layers` decoder layers: the options, or `band_layers` defaults."""
        default_a, default_b = band_layers(num_layers)
        a = default_a if self.layer_a is None else self.layer_a
        b = default_b if self.layer_b is None else self.layer_b
        for name, layer in (("layer_a", a), ("layer_b", b)):
            if not 1 <= layer <= num_layers:
                raise ValueError(f"epikv {name}={layer} must be a hidden-state layer in 1..{num_layers}")
        if a == b:
            raise ValueError(f"epikv layer_a and layer_b are both {a}; the score z_a - z_b needs two layers")
        return a, b

    def tapped_layers(self, num_layers: int) -> tuple[int, ...]:
        return tuple(layer - 1 for layer in self.bands(num_layers))

    def on_forward(self, hidden_states: dict[int, torch.Tensor], positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """Frozen scores [batch, q] of the tokens just added, continuing each row's running state."""
        tap_a, tap_b = self._band_taps(sorted(hidden_states))
        states = torch.stack([hidden_states[tap_a], hidden_states[tap_b]], dim=1).float()  # [batch, 2, q, H]
        batch, _, _, hidden = states.shape
        if self._previous is None:
            self._previous = states.new_zeros(batch, 2, hidden)
            self._history = states.new_full((batch, 2, self.window - 1), float("nan"))
        previous = torch.cat([self._previous[:, :, None], states[:, :, :-1]], dim=2)
        changes = (states - previous).norm(dim=-1)  # EpiKV Eq. 1, [batch, 2, q]
        changes = changes.masked_fill((positions < 1)[:, None, :], float("nan"))
        z = rolling_z_scores(changes, self._history)
        self._previous = states[:, :, -1]
        self._history = torch.cat([self._history, changes], dim=-1)[..., -(self.window - 1) :]
        return {"epikv_score": z[:, 0] - z[:, 1]}

    def _band_taps(self, tapped: list[int]) -> tuple[int, int]:
        """Which two tapped decoder layers are Band A and Band B: the options name them; by default
        Band A is the shallower one (`band_layers`)."""
        if self.layer_a is not None:
            tap_a = self.layer_a - 1
            return tap_a, next(layer for layer in tapped if layer != tap_a)
        if self.layer_b is not None:
            tap_b = self.layer_b - 1
            return next(layer for layer in tapped if layer != tap_b), tap_b
        return tapped[0], tapped[1]

    def keep_scores(self, context: EvictionContext) -> torch.Tensor:
        return context.state["epikv_score"][..., : context.num_candidates]
