"""ForesightKV's learned scorer as an NVIDIA kvpress press, for people who already compress with kvpress
(docs/kvpress.md)::

    from foresight.integrations.kvpress_press import ForesightPress

    press = ForesightPress("checkpoints/default")  # a scorer folder or Hub id, read by `load_scorer`
    with press(model):
        model.generate(input_ids, past_key_values=DynamicCache(), max_new_tokens=512)

`ForesightScorerPress` is kvpress's `ScorerPress` running one eviction step of our engine on one layer of
kvpress's cache: the scorer's attention features over the last L queries, their running sums carried per
entry from step to step (gathered with the entries kept), the keep scores of `foresight.policies.foresight`
and the engine's keep rule (sinks, the top B - L candidates with ties to the older entry, the newest L kept).
Alone it compresses a prefill, as kvpress's presses do. `ForesightPress` is kvpress's `DecodingPress` around
it, which compresses every L decoding steps to B entries as well.

The engine's settings on kvpress's (docs/algorithms.md section 1):
- B and L are the scorer's (`target_size` and `compression_interval`; a scorer fits one B and L).
- Cadence: the engine evicts when a layer holds B + L entries; DecodingPress counts decoding forwards from
  the prefill. After a prefill of T >= B + L tokens (its own step leaves B) the two agree; after a shorter
  one the press starts that count at T - B, so its first step comes when the layer holds B + L entries too.
  A decoding forward must bring one token, as `model.generate`'s do: DecodingPress counts forwards, not tokens.
- Queries: the engine records each forward's queries; kvpress buffers the attention's input hidden states
  (the last L, and a prefill's last L), and the press projects and rotates them as the model did (a prefill's
  in one projection with its rotary embedding, decoding ones one token at a time).
- Recent window: kvpress has none; the press keeps the newest L entries itself. Sinks: `sinks`, as
  `EvictionConfig`'s (0, the learned scorer's default).
- Not mapped: `protect_prompt` (the learned scorer runs without it), left-padded batches (kvpress pads
  nothing: a batch's rows have one length, each row evicting by its own scores), and the sampled mode of
  Eq. 2 (the press evicts the L lowest scores, the deterministic mode).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

try:
    from kvpress import DecodingPress, ScorerPress
    from kvpress.presses.base_press import BasePress, is_prefilling
    from kvpress.utils import get_prerope_query_states
except ImportError as error:
    raise ImportError(
        f"foresight.integrations.kvpress_press needs kvpress ({error}); install it in its own environment "
        "as docs/kvpress.md shows (kvpress pins transformers < 5.3)"
    ) from None
from transformers.models.llama.modeling_llama import rotate_half

from foresight.cadence import top_k_mask
from foresight.models import describe
from foresight.policies.foresight import Foresight
from foresight.runtime.capture import first_observed_query
from foresight.runtime.policy import EvictionContext
from foresight.scorer.model import ForesightScorer


@dataclass
class LayerEntries:
    """What kvpress's cache does not hold for one layer: each entry's position and the scorer's per-entry
    state, in the cache's slot order ([batch, Hkv, N] and [batch, Hkv, N, *trailing])."""

    positions: torch.Tensor
    state: dict[str, torch.Tensor]


@dataclass
class ForesightScorerPress(ScorerPress):
    """One eviction step of the engine with a learned scorer, on one layer of kvpress's cache (module docstring).

    scorer: a `ForesightScorer`, or a folder / Hub repo id to load one from (`load_scorer`).
    sinks: the first positions never evicted (the engine's `sinks`; 0 by default, as the learned policy's).
    A layer evicts when it holds at least B + L entries (a prefill, or DecodingPress's step); otherwise the
    press only notes its new entries. kvpress's compression ratio is not read: B and L are the scorer's.
    """

    scorer: ForesightScorer | str | os.PathLike | None = None
    sinks: int = 0
    _policy: Foresight = field(init=False, repr=False)
    _layers: dict[int, LayerEntries] = field(default_factory=dict, init=False, repr=False)
    _first_observed: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        # kvpress hands a press the window's queries at its step, so the press reads them there (no stream).
        self._policy = Foresight(scorer=self.scorer, record=False, observation="window")
        self.scorer = self._policy.scorer
        budget, interval = self.budget, self.interval
        if not isinstance(self.sinks, int) or not 0 <= self.sinks <= budget - interval:
            raise ValueError(f"sinks={self.sinks!r} must be an integer between 0 and B - L = {budget - interval}")

    @property
    def budget(self) -> int:
        return self.scorer.config.budget

    @property
    def interval(self) -> int:
        return self.scorer.config.interval

    def post_init_from_model(self, model: nn.Module) -> None:
        """Refuse, in one line, a model of another shape than the scorer's; start a new run."""
        self.scorer.check_compatible(describe(model))
        self.reset()

    def reset(self) -> None:
        self._layers = {}
        self._first_observed = None
        self._policy.reset()

    def entries(self, layer_idx: int) -> LayerEntries:
        """The positions and per-entry state of what layer `layer_idx` of kvpress's cache holds, as of the
        press's latest call on that layer (for inspection, as the engine's `last_cache`)."""
        if layer_idx not in self._layers:
            raise ValueError(f"the press has not seen layer {layer_idx} of a run yet")
        return self._layers[layer_idx]

    def start(self, layer_idx: int) -> None:
        """A prefill: the layer's entries begin a new run (and, at the first layer, the scorer's steps)."""
        self._layers.pop(layer_idx, None)
        if layer_idx == 0:
            self._policy.reset()
            self._first_observed = None

    def compress(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor | None,
        kwargs: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer_idx, prefill = module.layer_idx, is_prefilling(kwargs["cache_position"], kwargs["hidden_states"].shape[1])
        if prefill:
            self.start(layer_idx)
        entries = self._entries(layer_idx, keys, _newest_position(kwargs))
        budget, interval = self.budget, self.interval
        count = keys.shape[2]
        if count < budget + interval:
            return keys, values
        queries, query_positions = self._window_queries(module, hidden_states, kwargs, prefill)
        if self._first_observed is None:  # the run's first step observes its window's oldest query first
            self._first_observed = first_observed_query(query_positions)
        batch = keys.shape[0]
        context = EvictionContext(
            layer_idx=layer_idx,
            num_layers=module.config.num_hidden_layers,
            keys=keys,
            values=values,
            positions=entries.positions,
            num_candidates=count - interval,
            scaling=module.scaling,
            state=dict(entries.state),
            queries=queries,
            query_positions=query_positions,
            candidate_counts=(count - interval,) * batch,
            first_observed=self._first_observed,
        )
        context.state.update(self._policy.observe(context))
        keep = self._keep(self._policy.keep_scores(context), context.candidate_positions)
        slots = torch.arange(count, device=keys.device).expand_as(keep)
        index = slots.masked_select(keep).view(*keep.shape[:2], budget)  # slot order, so position order
        self._layers[layer_idx] = LayerEntries(
            positions=entries.positions.gather(2, index),
            state={name: _gather(value, index) for name, value in context.state.items()},
        )
        return _gather(keys, index), _gather(values, index)

    def _entries(self, layer_idx: int, keys: torch.Tensor, newest: int) -> LayerEntries:
        """The layer's entries with those added since the last call: kvpress appends them after the held
        ones, the newest at position `newest`, with the state a new entry starts with."""
        batch, heads, count, _ = keys.shape
        held = self._layers.get(layer_idx)
        known = 0 if held is None else held.positions.shape[2]
        added = count - known
        positions = torch.arange(newest - added + 1, newest + 1, device=keys.device).expand(batch, heads, added)
        group = self.scorer.config.group_size
        state = {
            item.name: torch.full(
                (batch, heads, added, *((group,) if item.per_query_head else ())),
                item.fill,
                dtype=item.dtype,
                device=keys.device,
            )
            for item in self._policy.state_fields
        }
        if held is not None:
            positions = torch.cat([held.positions, positions], dim=2)
            state = {name: torch.cat([held.state[name], value], dim=2) for name, value in state.items()}
        entries = LayerEntries(positions=positions, state=state)
        self._layers[layer_idx] = entries
        return entries

    def _window_queries(
        self, module: nn.Module, hidden_states: torch.Tensor, kwargs: dict, prefill: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last L queries after RoPE [batch, Hq, L, D] and their positions [batch, L], computed as the model
        computed them: a prefill's in one projection, rotated by the forward's rotary embedding; the
        buffered decoding hidden states one token at a time, rotated at their positions."""
        interval = self.interval
        newest = _newest_position(kwargs)
        batch = hidden_states.shape[0]
        positions = torch.arange(newest - interval + 1, newest + 1, device=hidden_states.device).expand(batch, -1)
        if prefill:
            queries = get_prerope_query_states(module, hidden_states)[:, :, -interval:]
            cos, sin = (table[:, -interval:] for table in kwargs["position_embeddings"])
        else:
            tail = hidden_states[:, -interval:]
            queries = torch.cat([get_prerope_query_states(module, token) for token in tail.split(1, dim=1)], dim=2)
            cos, sin = module.rotary_emb(tail, positions)
        cos, sin = cos[:, None], sin[:, None]
        return (queries * cos) + (rotate_half(queries) * sin), positions

    def _keep(self, scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """[batch, Hkv, N] entries kept: the sinks, the top B - L candidates by keep score (ties: the older) and
        the newest L, with the engine's treatment of non-finite scores (docs/algorithms.md section 1)."""
        scores = scores.float().nan_to_num(nan=0.0, posinf=1e30, neginf=-1e30)
        scores = scores.masked_fill(candidates < self.sinks, float("inf"))
        kept = top_k_mask(scores, self.budget - self.interval)
        return torch.cat([kept, kept.new_ones(*kept.shape[:2], self.interval)], dim=-1)


@dataclass
class ForesightPress(DecodingPress):
    """The learned scorer under kvpress at prefill and while decoding: DecodingPress around a
    `ForesightScorerPress`, with target_size B and compression_interval L read from the scorer and the
    engine's cadence (module docstring).

    scorer: a `ForesightScorer`, or a folder / Hub repo id to load one from. sinks: as the engine's."""

    base_press: ForesightScorerPress = field(init=False)
    compression_interval: int = field(init=False)
    target_size: int = field(init=False)
    hidden_states_buffer_size: int = field(init=False)
    scorer: ForesightScorer | str | os.PathLike | None = None
    sinks: int = 0

    def __post_init__(self) -> None:
        self.base_press = ForesightScorerPress(scorer=self.scorer, sinks=self.sinks)
        self.scorer = self.base_press.scorer
        self.target_size, self.compression_interval = self.base_press.budget, self.base_press.interval
        self.hidden_states_buffer_size = self.compression_interval
        super().__post_init__()

    def forward_hook(self, module: nn.Module, input: list[torch.Tensor], kwargs: dict, output: list):
        """A prefill: its own eviction step when it brings B + L entries or more; then DecodingPress's count of
        decoding steps set so that the next step comes when the layer holds B + L entries, and its buffer
        holding the prompt's last L hidden states (the engine's last L queries)."""
        hidden_states = kwargs["hidden_states"]
        if not is_prefilling(kwargs["cache_position"], hidden_states.shape[1]):
            return super().forward_hook(module, input, kwargs, output)
        output = BasePress.forward_hook(self.base_press, module, input, kwargs, output)
        layer_idx = module.layer_idx
        held = kwargs["past_key_values"].layers[layer_idx].keys.shape[2]
        self.layer_step_counts[layer_idx] = held - self.target_size
        tail = hidden_states[:, -self.compression_interval :].detach().clone()
        self.hidden_states_buffer[layer_idx] = list(tail.split(1, dim=1))
        return output


def _newest_position(kwargs: dict) -> int:
    """The position of the forward's newest token: its position id, which RoPE used (kvpress's own pipeline and
    `model.generate` pass the true one; the cache position counts the entries held, fewer after a step)."""
    return int(kwargs["position_ids"][0, -1])


def _gather(entries: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The entries [batch, Hkv, N, *trailing] at slots index [batch, Hkv, W]."""
    expanded = index.view(*index.shape, *(1,) * (entries.dim() - 3)).expand(*index.shape, *entries.shape[3:])
    return entries.gather(2, expanded).contiguous()
