"""The eviction step of docs/algorithms.md §1, apart from the drivers that feed it tokens (`engine.py`): hand a
policy the queries it observes, then, for the rows that reached their limit, every layer's context, the policy's
new state and keep scores, one top-k over the stacked layers (the recent window, sinks and protected prompt
always kept) and one compaction of the cache. In the pooled layout the contexts are each head's view of its
layer's pool, the new state is written back through the view and the top-k is the step's allocation
(`foresight.runtime.pool`).

It reads and writes a run's cache and counters and decides nothing about when it runs: the engine calls it after
every forward, and its host cadence says which rows are due.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager

import torch

from foresight.runtime.cache import (
    KEYS,
    OWNERS,
    POSITION_DTYPE,
    POSITIONS,
    QUERIES,
    VALUES,
    EvictionCache,
    EvictionLayer,
    ForwardObservation,
)
from foresight.runtime.capture import first_observed_query
from foresight.runtime.device_clock import DeviceClock, adding_to
from foresight.runtime.policy import EvictionContext, Policy, StepLayers
from foresight.runtime.pool import Allocation, OwnerView, keep_candidates
from foresight.runtime.run_state import Run


class EvictionStep:
    """The eviction step of one engine: its policy, interval L and layer count, where its seconds are counted
    (`clock`) and what is entered around every step (`step_observer`); `streams_queries` and
    `observes_every_query` say how the policy sees the queries between steps; `allocation` and `floor` how a step
    divides a layer's kept candidates among its heads (`foresight.runtime.pool`; the per-head layout's is
    `Allocation.HEAD`)."""

    def __init__(
        self,
        policy: Policy,
        interval: int,
        num_layers: int,
        clock: DeviceClock,
        step_observer: AbstractContextManager,
        streams_queries: bool,
        observes_every_query: bool,
        allocation: Allocation = Allocation.HEAD,
        floor: int = 0,
    ) -> None:
        self.policy, self.interval, self.num_layers = policy, interval, num_layers
        self.clock, self.step_observer = clock, step_observer
        self.streams_queries, self.observes_every_query = streams_queries, observes_every_query
        self.allocation, self.floor = allocation, floor

    def __call__(self, run: Run) -> None:
        """Hand every-query policies their complete query blocks (all that is left when a row evicts),
        then run an eviction step for the rows that reached their limit."""
        start = self.clock.start()
        with self.step_observer:
            self._eviction_step(run)
        self.clock.stop(start, adding_to(run.stats, "eviction_seconds"))

    def _eviction_step(self, run: Run) -> None:
        due_rows = run.cadence.due()
        evicting = any(due_rows)
        if self.observes_every_query:
            self._observe_queries(run, complete_blocks_only=not evicting)
        elif self.streams_queries:
            self._stream_queries(run, complete_blocks_only=not evicting)
        if evicting:
            cache = run.cache
            due = cache.lengths >= run.limits * cache.slots_per_token  # due_rows on the device, before the compaction
            rows = None if all(due_rows) else _host_index([row for row, evicts in enumerate(due_rows) if evicts], due)
            lengths = [length for length, evicts in zip(run.cadence.lengths, due_rows) if evicts]
            candidates = tuple(length - self.interval for length in lengths)
            width = run.cadence.evict(due_rows)
            first_observed = self._first_observed(run, due, rows)
            window = self._streamed_window(run, rows) if self.streams_queries else self._window_queries(cache, rows)
            step = _step_layers(cache, _entry_positions(cache, lengths, rows), *window, rows)
            view = _owner_view(cache, step.positions, rows)
            if view is not None:  # the pooled layout: each head's slots as its own cache
                step, candidates = view.step(step), None  # a head's valid candidates differ by head
            entries = cache.layers[0].get_seq_length() if view is None else view.width
            contexts = self._contexts(cache, step, entries - self.interval, candidates, first_observed, rows=rows)
            if not self.observes_every_query:  # every-query policies observed all their queries already
                self._write_state(cache, step, contexts, self.policy.step_observe(contexts), rows, view)
            scores = self.policy.step_keep_scores(contexts)
            keep = self._keep_top(run, rows, scores, step.positions[..., : contexts[0].num_candidates])
            if view is not None:
                keep = view.to_pool(keep)
            keep = keep if rows is None else _with_rows(cache.layers[0], keep, rows)
            cache.compact(keep, width * cache.slots_per_token)
            run.first_eviction = torch.where(due & (run.first_eviction < 0), run.next_positions, run.first_eviction)
            run.stats.evictions += 1
            run.stats.row_evictions = [count + evicts for count, evicts in zip(run.stats.row_evictions, due_rows)]

    def _observe_queries(self, run: Run, complete_blocks_only: bool) -> None:
        """docs/algorithms.md sections 2-3: `observe` each recorded query once, in query order, in blocks of at
        most L, for every row, against the keys in the cache now. No row has evicted since those queries
        ran (this runs before every eviction step), so each still sees exactly the entries it attended to:
        the causal mask hides the later ones."""
        if run.cache.layers[0].unobserved_count < (self.interval if complete_blocks_only else 1):
            return
        cache = run.cache
        positions = _entry_positions(cache, run.cadence.lengths)
        for queries, query_positions in cache.take_unobserved(complete_blocks_only):
            step = _step_layers(cache, positions, queries, query_positions)
            contexts = self._contexts(cache, step, num_candidates=0)
            self._write_state(cache, step, contexts, self.policy.step_observe(contexts), rows=None)

    def _stream_queries(self, run: Run, complete_blocks_only: bool) -> None:
        """ObservedQueries.STREAM: hand the policy the queries recorded since its last observation, in blocks of its
        `stream_block` (with `complete_blocks_only`, a last shorter block waits; all of them before any row's
        eviction step), those inside their row's next eviction window (the L queries before its step; the others
        get position -1, so they add nothing), against the keys in the cache now, which are the ones they attended
        to: no row evicted since they ran. Each block knows where its rows' next steps come
        (`EvictionContext.evicts_after`), from the host's cadence. In the pooled layout the blocks are observed on each
        head's view of the pool, and the new state goes back through it."""
        cache = run.cache
        if cache.layers[0].unobserved_count < (self.policy.stream_block if complete_blocks_only else 1):
            return
        blocks = cache.take_unobserved(complete_blocks_only)
        evicts_after = _next_steps(run, run.next_positions - 1)
        positions = _entry_positions(cache, run.cadence.lengths)
        view = _owner_view(cache, positions, rows=None)
        for queries, query_positions in blocks:
            step = _step_layers(cache, positions, queries, self._in_window(query_positions, evicts_after))
            step = step if view is None else view.step(step)
            contexts = self._contexts(cache, step, num_candidates=0, evicts_after=evicts_after)
            for name, value in self.policy.stream_observe(contexts).items():
                cache.write_state(name, value if view is None else view.scatter(value, cache.stacked(name)))

    def forward_observation(self, run: Run, positions: torch.Tensor) -> ForwardObservation:
        """ObservedQueries.FORWARD: how the attention of the forward about to run on the tokens at `positions`
        [batch, q] (-1: padding) observes them: its latest L queries at most (the most one eviction window holds),
        those outside their row's next window given position -1, as `_stream_queries` hands a block."""
        count = min(positions.shape[1], self.interval)
        evicts_after = _next_steps(run, positions.amax(-1))
        weights = self.policy.forward_weights(self._in_window(positions[:, -count:], evicts_after), evicts_after)
        return ForwardObservation(self.policy.forward_observe, weights, count)

    def _in_window(self, query_positions: torch.Tensor, evicts_after: torch.Tensor) -> torch.Tensor:
        """query_positions [batch, l] with -1 for each query outside its row's next eviction window (the L queries up
        to evicts_after [batch]), which a streaming policy does not observe."""
        outside = (query_positions < 0) | (evicts_after[:, None] - query_positions >= self.interval)
        return query_positions.masked_fill(outside, -1)

    def _first_observed(self, run: Run, due: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor | None:
        """The evicting rows' first observed query positions (`EvictionContext.first_observed`) for a WINDOW or
        STREAM policy that reads attention: a row evicting for the first time observes its window's oldest query
        first (the same in every layer), and every query after it at its later steps, L at a time. A streaming
        policy's are known from the start (`_first_streamed`)."""
        if not self.policy.needs_attention or self.observes_every_query:
            return None
        if not self.streams_queries:
            oldest = first_observed_query(run.cache.layers[0].query_positions)
            run.first_observed = torch.where(due & (run.first_observed < 0), oldest, run.first_observed)
        return run.first_observed if rows is None else run.first_observed[rows]

    def _contexts(
        self,
        cache: EvictionCache,
        step: StepLayers,
        num_candidates: int,
        candidate_counts: tuple[int, ...] | None = None,
        first_observed: torch.Tensor | None = None,
        evicts_after: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> list[EvictionContext]:
        """Every layer's context: its slices of the `step`'s tensors, with the rows' valid candidates
        (`candidate_counts`), `first_observed` query positions, for a streamed block `evicts_after`, and which
        of the run's rows they are (`rows`, None: all)."""
        return [
            EvictionContext(
                layer_idx=index,
                num_layers=self.num_layers,
                keys=step.keys[index],
                values=step.values[index],
                positions=step.positions[index],
                num_candidates=num_candidates,
                scaling=layer.scaling,
                state={name: value[index] for name, value in step.state.items()},
                queries=None if step.queries is None else step.queries[index],
                query_positions=step.query_positions,
                candidate_counts=candidate_counts,
                first_observed=first_observed,
                evicts_after=evicts_after,
                step=step,
                rows=rows,
            )
            for index, layer in enumerate(cache.layers)
        ]

    def _window_queries(
        self, cache: EvictionCache, rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """Every layer's ring of the latest queries a WINDOW policy reads, in query order (oldest first), for the
        evicting rows: ([layers, rows, Hq, W, D], [rows, W]), or Nones for a policy that reads none. The stacked
        rings are read as they are when they start at their first slot and every row evicts; else rotated and
        their rows selected for every layer at once. The layers record the same positions and advance their
        rings together, so layer 0's cursor and positions are every layer's."""
        if not self.policy.needs_attention or self.observes_every_query:
            return None, None
        first = cache.layers[0]
        queries, positions, cursor = cache.stacked(QUERIES), first.query_positions, first.query_cursor
        if cursor:
            queries, positions = queries.roll(-cursor, dims=3), positions.roll(-cursor, dims=1)
        if rows is not None:
            queries, positions = queries[:, rows], positions[rows]
        return queries, positions

    def _streamed_window(self, run: Run, rows: torch.Tensor | None) -> tuple[None, torch.Tensor]:
        """A streaming policy's window at its step: no queries (it observed them as they ran), and their
        positions [rows, L], the L before each evicting row's next position (what names the step)."""
        ages = torch.arange(self.interval - 1, -1, -1, device=run.next_positions.device)
        positions = (run.next_positions[:, None] - 1 - ages).to(POSITION_DTYPE)
        return None, positions if rows is None else positions[rows]

    @staticmethod
    def _write_state(
        cache: EvictionCache,
        step: StepLayers,
        contexts: Sequence[EvictionContext],
        states: Sequence[dict[str, torch.Tensor]],
        rows: torch.Tensor | None,
        view: OwnerView | None = None,
    ) -> None:
        """Hand each layer's new per-entry state to its context and write it to the cache: for every layer and
        field in one multi-tensor copy when every row evicts (the step's state views the storage, so it reads
        the new state too), else one stack and one write of the evicting `rows` per field (the new state the
        step's then). In the pooled layout the step's state is each head's `view` of it: the held view slots go
        back to their pool slots."""
        for context, state in zip(contexts, states, strict=True):
            context.state.update(state)
        if rows is None and view is None:
            targets = [layer.state[name] for layer, state in zip(cache.layers, states) for name in state]
            if targets:
                torch._foreach_copy_(targets, [value for state in states for value in state.values()])
            return
        for name in states[0]:
            step.state[name] = torch.stack([state[name] for state in states])
            value = step.state[name]
            if view is not None:
                pool = cache.stacked(name)
                value = view.scatter(value, pool if rows is None else pool[:, rows])
            cache.write_state(name, value, rows)

    def _keep_top(
        self, run: Run, rows: torch.Tensor | None, scores: torch.Tensor, candidates: torch.Tensor
    ) -> torch.Tensor:
        """[layers, rows, Hkv, N] entries every layer keeps, in one pass over the layers' stacked keep
        scores and candidate positions [layers, rows, Hkv, C]: the recent window, sinks, the protected
        prompt and the top candidates by keep score, divided among the heads by the step's allocation."""

        def select(tensor: torch.Tensor) -> torch.Tensor:
            return tensor if rows is None else tensor[rows]

        scores = scores.float().nan_to_num(nan=0.0, posinf=1e30, neginf=-1e30)
        protected = (candidates >= 0) & ((candidates < run.sinks) | (candidates < select(run.protected)[:, None, None]))
        scores = scores.masked_fill(protected, float("inf")).masked_fill(candidates < 0, float("-inf"))
        kept = keep_candidates(scores, select(run.keep_counts), self.allocation, self.floor)
        recent = torch.ones_like(kept[..., : self.interval])
        return torch.cat([kept, recent], dim=-1)


def _next_steps(run: Run, newest: torch.Tensor) -> torch.Tensor:
    """[batch] the position of the query after which each row's next eviction step runs, from its newest fed query's
    position `newest` [batch] and the tokens its host cadence has left before the step."""
    ahead = [max(0, limit - length) for limit, length in zip(run.cadence.limits, run.cadence.lengths)]
    return newest + _host_index(ahead, newest)


def _host_index(indices: list[int], like: torch.Tensor) -> torch.Tensor:
    """`indices` as a long tensor on `like`'s device, copied from the host without waiting for the device (pinned
    memory, a non-blocking copy on CUDA): a ragged step's rows, known to the host's cadence."""
    index = torch.tensor(indices, dtype=torch.long)
    if like.device.type == "cuda":
        return index.pin_memory().to(like.device, non_blocking=True)
    return index.to(like.device)


def _step_layers(
    cache: EvictionCache,
    positions: torch.Tensor,
    queries: torch.Tensor | None,
    query_positions: torch.Tensor | None,
    rows: torch.Tensor | None = None,
) -> StepLayers:
    """Every layer's tensors of a step for the batch rows `rows` (None: all): their keys, values and state, views of
    the cache's stacked storage when every row takes part (else one gather per field), with their entry
    `positions` and the `queries` they observe."""

    def select(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if rows is None else tensor[:, rows]

    return StepLayers(
        keys=select(cache.stacked(KEYS)),
        values=select(cache.stacked(VALUES)),
        positions=positions,
        state={field.name: select(cache.stacked(field.name)) for field in cache.layers[0].state_fields},
        queries=queries,
        query_positions=query_positions,
    )


def _owner_view(cache: EvictionCache, positions: torch.Tensor, rows: torch.Tensor | None) -> OwnerView | None:
    """Each KV head's slots of the pooled layout's pools, for the batch rows `rows` (None: all) whose entry positions
    are `positions` (None in the per-head layout)."""
    if cache.slots_per_token == 1:
        return None
    owners = cache.stacked(OWNERS)
    return OwnerView.of(owners if rows is None else owners[:, rows], positions, cache.slots_per_token)


def _entry_positions(cache: EvictionCache, lengths: Sequence[int], rows: torch.Tensor | None = None) -> torch.Tensor:
    """Every layer's entry positions [layers, rows, Hkv, N] with -1 on invalid slots, for the batch rows `rows`
    (None: all) whose valid entries are `lengths` (from the host's cadence). Where every such row fills the slots
    they are the stored positions themselves (a view); else one mask of the invalid slots, which every layer
    shares (their rows hold the same valid slots), marks them all."""
    positions, first = cache.stacked(POSITIONS), cache.layers[0]
    if min(lengths) * cache.slots_per_token < first.get_seq_length():
        positions = positions.masked_fill(~first.valid[None, :, None, :], -1)
    return positions if rows is None else positions[:, rows]


def _with_rows(layer: EvictionLayer, keep_rows: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[layers, batch, Hkv, N]: `keep_rows` [layers, len(rows), Hkv, N] for the evicting `rows`, every valid
    entry for the others (`layer`: any layer; their valid slots are the same)."""
    layers, _, heads, _ = keep_rows.shape
    keep = layer.valid[None, :, None, :].expand(layers, -1, heads, -1).clone()
    keep[:, rows] = keep_rows
    return keep
