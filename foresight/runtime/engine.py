"""The eviction engine: prefill, batched decode and teacher-forced replay under one eviction cadence.

docs/algorithms.md section 1. Each row's cache grows by one entry per token; when a row holds
B + L (+ its protected prompt) valid entries, an eviction step keeps the most recent L entries and
the top B - L candidates by the policy's keep score, bringing the row back to B. Rows of a batch
evict on their own schedule (left padding shifts it), so a batch decodes exactly as each row alone.
A policy that observes every query (H2O, LazyEviction, RaaS) is handed each query once, in blocks of
L after the forward that completes a block, and what is left before any row's eviction step.

A replay can pause (before a given eviction step, or after a number of tokens) and go on later, under
this engine or another on the same model and cadence, and a paused replay can be copied into other rows
(`Replay.select_rows`): the copy continues exactly as those rows would have, which is how the
reinforcement stage branches K rollouts off one replay's state without running its forwards again.

The eviction step itself (observation, contexts, keep scores, top-k, compaction) is `eviction_step.py`'s; this
module drives it: prefill, decode and replay, and when each row is due (`HostCadence`).

Size: the one cadence loop (prefill, decode, replay, pausing and copying replays) kept in one place on purpose:
it is the rule every policy runs under.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from foresight.cache_argument import cache_argument
from foresight.cadence import check_budget
from foresight.runtime.cache import MAX_POOL_HEADS, EvictionCache
from foresight.runtime.capture import ATTENTION_NAME, attention_implementation
from foresight.runtime.device_clock import DeviceClock, adding_to
from foresight.runtime.eviction_step import EvictionStep
from foresight.runtime.held_memory import keeps_every_query, query_window
from foresight.runtime.policy import ObservedQueries, Policy, select_state_rows
from foresight.runtime.pool import Allocation, Layout, check_pooled, default_floor
from foresight.runtime.prefix import RecordedForward, ReplayPrefix
from foresight.runtime.run_state import HostCadence, Run, RunStats
from foresight.runtime.sampling import SamplingConfig, logits_processors, next_token
from foresight.runtime.static_decode import DecodeStep, StaticDecode


@dataclass(frozen=True)
class EvictionConfig:
    """Budget B (entries kept after an eviction) and interval L (entries evicted per step).

    `sinks` and `protect_prompt` default to the policy's own defaults when None. `layout`: a cache per KV head
    ("heads") or one pool per layer ("pooled", `foresight.runtime.pool`), where `allocation` divides the layer's
    H·(B − L) kept candidates: B − L per head ("head") or AdaKV's ("layer"), each head keeping at least `floor`
    (default AdaKV's 0.2 of B − L)."""

    budget: int
    interval: int
    sinks: int | None = None
    protect_prompt: bool | None = None
    layout: Layout = Layout.HEADS
    allocation: Allocation = Allocation.HEAD
    floor: int | None = None

    def __post_init__(self) -> None:
        check_budget(self.budget, self.interval)
        share = self.budget - self.interval
        if self.sinks is not None and not 0 <= self.sinks <= share:
            raise ValueError(f"sinks={self.sinks} must be between 0 and B - L = {share}")
        object.__setattr__(self, "layout", Layout.parse(self.layout))
        object.__setattr__(self, "allocation", Allocation.parse(self.allocation))
        if self.allocation is Allocation.LAYER and self.layout is not Layout.POOLED:
            raise ValueError(
                f"allocation='layer' needs layout='pooled': layout={self.layout.value!r} holds B - L = {share} "
                "candidates in every KV head's cache"
            )
        if self.allocation is Allocation.HEAD:
            if self.floor is not None:
                raise ValueError(
                    f"floor={self.floor} is allocation 'layer''s; allocation 'head' keeps B - L = {share} in every head"
                )
            return
        if self.floor is None:
            object.__setattr__(self, "floor", default_floor(self.budget, self.interval))
        elif not 1 <= self.floor <= share:
            raise ValueError(
                f"floor={self.floor} must be 1..B - L = {share}: the candidates every head keeps before the layer's best"
            )


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # new tokens per row, up to and including EOS
    stats: RunStats
    logits: torch.Tensor | None = None  # [batch, steps, vocab] when asked for


@dataclass
class ReplayOutput:
    """Teacher-forced losses per row; entry j is for predicting token j+1 from tokens <= j."""

    nll: list[torch.Tensor]
    first_eviction: list[int | None]  # first position processed with an evicted cache: nll[j] for j >= it
    stats: RunStats
    greedy: list[torch.Tensor] = field(default_factory=list)  # entry j: the top-1 prediction for token j + 1


@dataclass
class Replay:
    """A teacher-forced replay in progress (`EvictionEngine.start_replay`, `EvictionEngine.advance`).

    It holds the run (cache, cadence, counters), the token layout of every row, how far it has fed
    (`done`: tokens after the prompts), the token losses so far, whether the eviction step made due by
    its last forward is still to run (`pending_eviction`), and the policy's `run_state`. `select_rows`
    copies it into other rows mid-replay: the copy continues exactly as the selected rows would have,
    which is what branching K rollouts from one replay's state needs (the reinforcement stage's
    branch groups, `trainers.reinforcement.branches`)."""

    run: Run
    prefill: (
        tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    )  # the prompts' ids, positions, valid counts; None once fed
    layout: torch.Tensor  # [batch, prompt width + rest + 1]: left-padded prompts, the rest, one pad (the targets)
    rest: torch.Tensor  # [batch, longest rest]: each row's tokens after its prompt, right-padded
    prompt_lengths: list[int]
    sequence_lengths: list[int]
    chunk_cap: int
    forwards: _PrefixForwards
    policy_state: dict[str, Any]
    done: int = 0
    columns: list[torch.Tensor] = field(default_factory=list)  # token NLL of each forward [batch, q]
    greedy: list[torch.Tensor] = field(default_factory=list)  # the top-1 prediction of each forward [batch, q]
    pending_eviction: bool = False

    @property
    def prompt_width(self) -> int:
        return self.layout.shape[1] - self.rest.shape[1] - 1

    def add_column(self, outputs: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Append one forward's (token NLL, top-1 prediction), each [batch, q]."""
        self.columns.append(outputs[0])
        self.greedy.append(outputs[1])

    @property
    def evictions(self) -> int:
        """Eviction steps run so far (a pending one not counted)."""
        return self.run.stats.evictions

    @property
    def position(self) -> int:
        """The position of the newest token fed, in the widest row's count (equal for rows of one length)."""
        return int(self.run.next_positions.max()) - 1

    @property
    def finished(self) -> bool:
        return self.prefill is None and self.done >= self.rest.shape[1]

    def select_rows(self, rows: Sequence[int]) -> Replay:
        """A copy holding rows `rows` of this replay (indices, repeats allowed: `[0] * K` makes K copies of a
        one-row replay), sharing no state with it: every tensor of the cache and its layers, the cadence,
        the token layout and losses, and the policy's run state (`select_state_rows`). The copy reuses no
        recorded prefix (it is past the forwards a prefix holds, or records none of its own)."""
        rows = [int(row) for row in rows]
        index = torch.tensor(rows, dtype=torch.long, device=self.rest.device)
        return Replay(
            run=self.run.select_rows(rows),
            prefill=None if self.prefill is None else tuple(tensor[index] for tensor in self.prefill),
            layout=self.layout[index],
            rest=self.rest[index],
            prompt_lengths=[self.prompt_lengths[row] for row in rows],
            sequence_lengths=[self.sequence_lengths[row] for row in rows],
            chunk_cap=self.chunk_cap,
            forwards=_PrefixForwards(None, can_inject=False),
            policy_state=select_state_rows(self.policy_state, index),
            done=self.done,
            columns=[column[index] for column in self.columns],
            greedy=[column[index] for column in self.greedy],
            pending_eviction=self.pending_eviction,
        )

    def output(self) -> ReplayOutput:
        """The token losses and top-1 predictions of what was fed so far: entry j of a row predicts token j + 1."""
        nll, greedy = torch.cat(self.columns, 1), torch.cat(self.greedy, 1)
        pad = self.prompt_width
        spans = [
            slice(pad - prompt, min(pad - prompt + length - 1, nll.shape[1]))
            for prompt, length in zip(self.prompt_lengths, self.sequence_lengths)
        ]
        first = [int(v) if v >= 0 else None for v in self.run.first_eviction.tolist()]
        return ReplayOutput(
            nll=[nll[row, span].cpu() for row, span in enumerate(spans)],
            first_eviction=first,
            stats=self.run.stats,
            greedy=[greedy[row, span].cpu() for row, span in enumerate(spans)],
        )


class EvictionEngine:
    """Runs a frozen causal LM with its KV cache held to a budget by `policy`.

    `config=None` (or a policy that does not evict) keeps the full cache. The model runs with the
    runtime's attention function (`attention`, a name registered in AttentionInterface) during a
    run only; its own implementation is restored afterwards. `decode_step`: how `generate` runs its decode
    forwards (`DecodeStep`: "eager", or "static" and "graph", the fixed-shape step a CUDA graph holds)."""

    def __init__(
        self,
        model: torch.nn.Module,
        policy: Policy,
        config: EvictionConfig | None = None,
        attention: str = ATTENTION_NAME,
        step_observer: AbstractContextManager | None = None,
        decode_step: str | DecodeStep = DecodeStep.EAGER,
    ):
        if policy.evicts and config is None:
            raise ValueError(f"policy {policy.name!r} evicts and needs a budget and an interval")
        self.model = model
        self.policy = policy
        self.config = config
        self.sinks = 0 if config is None else (policy.default_sinks if config.sinks is None else config.sinks)
        self.protect_prompt = bool(
            config is not None
            and (policy.default_protect_prompt if config.protect_prompt is None else config.protect_prompt)
        )
        text_config = model.config.get_text_config()
        self.num_layers = text_config.num_hidden_layers
        self.group_size = text_config.num_attention_heads // text_config.num_key_value_heads
        self.evicts = policy.evicts and config is not None
        self.pool_heads = self._pool_heads(text_config.num_key_value_heads)
        observed = policy.observed_queries
        self.observes_in_forward = self.evicts and observed is ObservedQueries.FORWARD
        self.streams_queries = (self.evicts and observed is ObservedQueries.STREAM) or self.observes_in_forward
        self.observes_every_query = self.evicts and keeps_every_query(policy) and not self.streams_queries
        self._taps: dict[int, torch.Tensor] = {}
        self._tap_layers = policy.tapped_layers(self.num_layers)
        self.last_cache: EvictionCache | None = None  # the cache of the latest run, for inspection
        self.last_stats: RunStats | None = None  # its counters, also when a callback ended it early
        self.attention = attention
        self.step_observer = step_observer or nullcontext()  # entered around every eviction step (`host_reads`)
        self.clock = DeviceClock(model.device)  # the run's seconds, settled at the end of `generate` and `advance`
        self.decode_step = self._check_decode_step(DecodeStep.parse(decode_step))
        self.evict = EvictionStep(  # the step of the rows due, after every forward
            policy,
            0 if config is None else config.interval,
            self.num_layers,
            self.clock,
            self.step_observer,
            self.streams_queries,
            self.observes_every_query,
            Allocation.HEAD if config is None else config.allocation,
            0 if config is None or config.floor is None else config.floor,
        )

    def _pool_heads(self, kv_heads: int) -> int:
        """The KV heads of each layer's pool in the pooled layout (0: a cache per KV head), after refusing what it
        does not run yet: a policy that does not declare `runs_pooled`, allocation 'layer' over scores that do not
        compare across heads, and more heads than a one-byte owner tag names."""
        if not self.evicts or self.config.layout is Layout.HEADS:
            return 0
        check_pooled(self.policy, self.config.allocation)
        if kv_heads > MAX_POOL_HEADS:
            raise ValueError(
                f"layout='pooled' tags a slot's head in one byte: at most {MAX_POOL_HEADS} KV heads, the model has "
                f"{kv_heads}"
            )
        return kv_heads

    def _check_decode_step(self, decode_step: DecodeStep) -> DecodeStep:
        """A static step keeps queries in fixed buffers and runs no Python between its operations: refuse the policies
        that keep a list of every query or read each forward's hidden states, and a graph off CUDA."""
        if decode_step is DecodeStep.EAGER:
            return decode_step
        if self.pool_heads:
            raise ValueError(
                f"decode_step={decode_step.value!r} runs fixed-shape forwards; layout='pooled' runs 'eager' only"
            )
        if self.observes_in_forward:
            raise ValueError(
                f"decode_step={decode_step.value!r} runs SDPA over fixed buffers; a policy that observes in the "
                "forward's attention (observation 'forward') runs 'eager' only: give observation='stream'"
            )
        if self.observes_every_query or type(self.policy).on_forward is not Policy.on_forward:
            raise ValueError(
                f"decode_step={decode_step.value!r} runs fixed-shape forwards; policy {self.policy.name!r} observes every "
                "query or reads each forward's hidden states, which only 'eager' runs"
            )
        if decode_step is DecodeStep.GRAPH and self.model.device.type != "cuda":
            raise ValueError(
                f"decode_step='graph' captures CUDA graphs; the model is on {self.model.device}: "
                "'static' runs the same fixed-shape step eagerly"
            )
        return decode_step

    # -- public entry points -------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: SamplingConfig = SamplingConfig(),
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int = 0,
        return_logits: bool = False,
        on_token: Callable[[int], None] | None = None,
        row_seeds: Sequence[int] | None = None,
    ) -> GenerationOutput:
        """Prefill left-padded prompts, then decode up to `max_new_tokens` per row; `on_token(n)` after each
        decoded token, n the tokens so far.

        Sampling draws from one generator seeded with `sampling.seed`; with `row_seeds` (one per row)
        each row draws from its own, so a row samples the same tokens whatever rows share its batch
        and, under another policy, from the same random numbers."""
        steps = self.generation(prompts, max_new_tokens, sampling, eos_token_id, pad_token_id, return_logits, row_seeds)
        while True:
            try:
                count = next(steps)
            except StopIteration as done:
                return done.value
            if on_token is not None:
                on_token(count)

    @torch.no_grad()
    def generation(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: SamplingConfig = SamplingConfig(),
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int = 0,
        return_logits: bool = False,
        row_seeds: Sequence[int] | None = None,
    ) -> Generator[int, None, GenerationOutput]:
        """`generate` a token at a time: yields the tokens decoded so far after each, returns the output. Several
        generations advanced in turns share one thread (`foresight bench interleaved`): on threads of their own,
        each parallel CPU operation ran about 50 µs slower on all but the first (2 cores, OpenMP)."""
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
        if row_seeds is not None and len(row_seeds) != len(prompts):
            raise ValueError(f"got {len(row_seeds)} row seeds for {len(prompts)} prompts")
        try:
            with attention_implementation(self.model, self.attention):
                return (
                    yield from self._generate(
                        prompts, max_new_tokens, sampling, eos_token_id, pad_token_id, return_logits, row_seeds
                    )
                )
        finally:
            self.clock.settle()

    def _generate(self, prompts, max_new_tokens, sampling, eos_token_id, pad_token_id, return_logits, row_seeds):
        run, input_ids, positions, valid = self._start(
            prompts, pad_token_id, max(max_new_tokens - 1, 0)
        )  # the last token is never fed
        logits = self._forward(run, input_ids, positions, valid, [len(prompt) for prompt in prompts])[:, -1]
        processors = logits_processors(sampling)
        seeds = [sampling.seed] if row_seeds is None else row_seeds
        generators = [torch.Generator(device=logits.device).manual_seed(seed) for seed in seeds]
        eos = torch.tensor(sorted(_as_set(eos_token_id)), dtype=torch.long, device=logits.device)
        finished = torch.zeros(len(prompts), dtype=torch.bool, device=logits.device)
        new_tokens, all_logits = [], []
        ones = torch.ones(len(prompts), dtype=torch.long, device=logits.device)
        one_each = [1] * len(prompts)
        static = None
        for _ in range(max_new_tokens):
            if return_logits:
                all_logits.append(logits)
            token = next_token(logits, processors, sampling, generators)
            token = token.masked_fill(finished, pad_token_id)
            new_tokens.append(token)
            finished |= torch.isin(token, eos)
            yield len(new_tokens)
            if bool(finished.all()) or len(new_tokens) == max_new_tokens:
                break
            start = self.clock.start()
            if static is None and self.decode_step is not DecodeStep.EAGER:
                static = StaticDecode(self.model, run.cache, len(prompts), graph=self.decode_step is DecodeStep.GRAPH)
            logits = self._forward(run, token[:, None], run.next_positions[:, None], ones, one_each, static=static)
            logits = logits[:, -1]
            self.clock.stop(start, run.stats.step_seconds.append)
        tokens = _trim_after_eos(torch.stack(new_tokens, 1) if new_tokens else input_ids[:, :0], eos)
        stacked = torch.stack(all_logits, 1) if return_logits and all_logits else None
        return GenerationOutput(tokens=tokens, stats=run.stats, logits=stacked)

    @torch.no_grad()
    def replay(
        self,
        sequences: Sequence[torch.Tensor],
        prompt_lengths: Sequence[int],
        max_chunk: int | None = None,
        pad_token_id: int = 0,
        on_tokens: Callable[[int], None] | None = None,
        prefix: ReplayPrefix | None = None,
    ) -> ReplayOutput:
        """Teacher-forced replay: prefill each prompt, then feed the rest in chunks of at most
        `max_chunk` (default L) that end exactly where a row evicts, so the result equals
        token-by-token decoding with the same evictions.

        `prefix`: forwards shared with other replays of the same batch (`foresight.runtime.prefix`):
        an empty one records this replay's forwards up to its first eviction, a filled one is reused
        where it applies. Either way the result is that of running the model."""
        replay = self.start_replay(sequences, prompt_lengths, max_chunk, pad_token_id, prefix)
        return self.advance(replay, on_tokens=on_tokens).output()

    def start_replay(
        self,
        sequences: Sequence[torch.Tensor],
        prompt_lengths: Sequence[int],
        max_chunk: int | None = None,
        pad_token_id: int = 0,
        prefix: ReplayPrefix | None = None,
    ) -> Replay:
        """A replay of `sequences` (the arguments of `replay`) that has fed nothing yet: `advance` runs it,
        to its end or to a pause, and `Replay.output` reads its token losses."""
        for sequence, length in zip(sequences, prompt_lengths, strict=True):
            if not 1 <= length <= len(sequence):
                raise ValueError(f"prompt length {length} must be between 1 and the sequence length {len(sequence)}")
        prompts = [seq[:length].tolist() for seq, length in zip(sequences, prompt_lengths)]
        fed = max(len(seq) - length for seq, length in zip(sequences, prompt_lengths))
        run, input_ids, positions, valid = self._start(prompts, pad_token_id, fed)
        device = input_ids.device
        rest = _right_pad([seq[length:].to(device) for seq, length in zip(sequences, prompt_lengths)], pad_token_id)
        layout = torch.cat([input_ids, rest, rest.new_full((len(prompts), 1), pad_token_id)], dim=1)
        return Replay(
            run=run,
            prefill=(input_ids, positions, valid),
            layout=layout,
            rest=rest,
            prompt_lengths=list(prompt_lengths),
            sequence_lengths=[len(sequence) for sequence in sequences],
            chunk_cap=max_chunk or (self.config.interval if self.config else rest.shape[1] or 1),
            forwards=_PrefixForwards(prefix if self.evicts else None, can_inject=not self._tap_layers),
            policy_state=self.policy.run_state(),
        )

    @torch.no_grad()
    def advance(
        self,
        replay: Replay,
        stop_before_step: int | None = None,
        tokens: int | None = None,
        on_tokens: Callable[[int], None] | None = None,
    ) -> Replay:
        """Run `replay` on: to its end, or until its next eviction step would be number `stop_before_step`
        (counted from 0 over the run; the forward that makes it due has run, the step has not), or until
        `tokens` more tokens after the prompt are fed (an eviction step due after the last of them is left
        pending). A paused replay keeps everything a later `advance` needs (its cache, cadence, token
        losses, the policy's `run_state`), so this engine may run other replays meanwhile, and an engine of
        another policy on the same model and cadence may take it on (the pending step then runs under
        that policy). Returns `replay`, advanced in place."""
        if stop_before_step is not None and stop_before_step < replay.evictions:
            raise ValueError(f"the replay has run {replay.evictions} eviction steps, past step {stop_before_step}")
        self.policy.load_run_state(replay.policy_state)
        self.last_cache, self.last_stats = replay.run.cache, replay.run.stats
        try:
            with attention_implementation(self.model, self.attention):
                self._advance(replay, stop_before_step, tokens, on_tokens)
        finally:
            self.clock.settle()
        replay.policy_state = self.policy.run_state()
        return replay

    def _advance(self, replay: Replay, stop_before_step, tokens, on_tokens) -> None:
        run, rest = replay.run, replay.rest
        if replay.pending_eviction:
            if stop_before_step == replay.evictions:
                return
            replay.pending_eviction = False
            self.evict(run)
        left = rest.shape[1] if tokens is None else tokens
        if replay.prefill is not None:
            input_ids, positions, valid = replay.prefill
            targets = replay.layout[:, 1 : replay.prompt_width + 1]
            prefill = list(replay.prompt_lengths)
            replay.add_column(self._replay_forward(run, input_ids, positions, valid, prefill, targets, replay.forwards))
            replay.prefill = None
            if self._pause(replay, stop_before_step, stop=tokens is not None and left == 0):
                return
        device, rows = rest.device, rest.shape[0]
        ones = torch.ones(rows, dtype=torch.long, device=device)
        while replay.done < rest.shape[1] and left > 0:
            done = replay.done
            size = min(replay.chunk_cap, rest.shape[1] - done, run.cadence.room(), left)
            chunk_positions = run.next_positions[:, None] + torch.arange(size, device=device)
            start = replay.prompt_width + done
            targets = replay.layout[:, start + 1 : start + size + 1]
            chunk = rest[:, done : done + size]
            replay.add_column(
                self._replay_forward(run, chunk, chunk_positions, ones * size, [size] * rows, targets, replay.forwards)
            )
            replay.done, left = done + size, left - size
            if on_tokens is not None:
                on_tokens(size)
            if self._pause(replay, stop_before_step, stop=tokens is not None and left == 0):
                return

    def _pause(self, replay: Replay, stop_before_step: int | None, stop: bool) -> bool:
        """After a forward of a replay: leave its eviction step pending (True) when one is due and the replay
        stops here (`stop`, or it is step `stop_before_step`); else run the step (every-query policies
        observe their complete blocks even when no row evicts)."""
        if not self.evicts:
            return False
        if any(replay.run.cadence.due()) and (stop or stop_before_step == replay.evictions):
            replay.pending_eviction = True
            return True
        self.evict(replay.run)
        return False

    def _replay_forward(self, run: Run, input_ids, positions, valid, counts, targets, forwards: _PrefixForwards):
        """One forward of a replay: the NLL of its targets and its top-1 predictions, recorded or reused per
        `forwards` (the eviction step it may make due is the replay loop's to run: `_pause`)."""
        if run.stats.evictions:
            return _token_outputs(self._forward(run, input_ids, positions, valid, counts, evict=False), targets)
        recorded = forwards.reusable(input_ids, positions, valid)
        if recorded is not None:
            recorded = recorded.for_rows(input_ids.shape[0])
            self._forward(run, input_ids, positions, valid, counts, inject=recorded, evict=False)
            return recorded.nll, recorded.greedy
        record = forwards.start_recording(input_ids, positions, valid)
        logits = self._forward(run, input_ids, positions, valid, counts, record=record, evict=False)
        nll, greedy = _token_outputs(logits, targets)
        if record is not None:
            record.nll, record.greedy = nll, greedy
        return nll, greedy

    # -- one forward and one eviction step -------------------------------------------------------
    def _start(self, prompts: Sequence[Sequence[int]], pad_token_id: int, new_tokens: int):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        device = self.model.device
        prompt_lengths = [len(p) for p in prompts]
        lengths = torch.tensor(prompt_lengths, device=device)
        width = max(prompt_lengths)
        input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device=device)
        positions = torch.full_like(input_ids, -1)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.as_tensor(list(prompt), device=device)
            positions[row, width - len(prompt) :] = torch.arange(len(prompt), device=device)
        budget, interval = (self.config.budget, self.config.interval) if self.evicts else (0, 0)
        protected = prompt_lengths if self.protect_prompt else [0] * len(prompts)
        never = torch.iinfo(torch.long).max
        cadence = HostCadence(
            lengths=[0] * len(prompts),
            limits=[p + budget + interval if self.evicts else never for p in protected],
            left=[p + budget for p in protected],
        )
        self.policy.reset()
        cache = EvictionCache(
            self.num_layers,
            state_fields=self.policy.state_fields,
            group_size=self.group_size,
            query_window=self.policy.stream_block if self.records_stream else self._query_window(interval),
            keep_every_query=self.observes_every_query or self.records_stream,
            capacity=min(width + new_tokens, max(cadence.limits)) * max(self.pool_heads, 1),  # the most a layer holds
            query_dtype=self.policy.buffered_query_dtype,
            stream_queries=interval if self.records_stream else 0,
            pool_heads=self.pool_heads,
        )
        self.last_cache = cache
        run = Run(
            cache=cache,
            cadence=cadence,
            protected=torch.tensor(protected, device=device),
            limits=torch.tensor(cadence.limits, device=device),
            keep_counts=torch.tensor([left - interval for left in cadence.left], device=device),
            sinks=self.sinks,
            first_eviction=torch.full_like(lengths, -1),
            first_observed=self._first_streamed(cadence, prompt_lengths, interval, like=lengths),
            next_positions=lengths.clone(),
        )
        run.stats.row_evictions = [0] * len(prompts)
        self.last_stats = run.stats
        return run, input_ids, positions, lengths

    @property
    def records_stream(self) -> bool:
        """Whether the cache records a streaming policy's queries for its blocks (STREAM; FORWARD records none)."""
        return self.streams_queries and not self.observes_in_forward

    def _reaches_a_window(self, run: Run) -> bool:
        """Whether a forward just fed can hold a query a streaming policy observes: one in some row's eviction
        window. A row's windows tile its tokens from L before its first limit on, so before every row gets there
        (a prompt and the decode tokens after it, below B) the queries would add nothing to any sum and are not
        recorded. Other policies record every forward's. (A static decode forward records always: its operations
        must not change from one token to the next; what it records then adds nothing either.)"""
        if not self.streams_queries or run.stats.evictions:
            return True
        window_starts = (limit - self.config.interval for limit in run.cadence.limits)
        return any(length > start for length, start in zip(run.cadence.lengths, window_starts))

    def _first_streamed(
        self, cadence: HostCadence, prompt_lengths: Sequence[int], interval: int, like: torch.Tensor
    ) -> torch.Tensor:
        """[batch] each row's first observed query position for a streaming policy, known from the start: the
        oldest of its first eviction window, L before the larger of its limit and its prompt (a prompt past the
        limit evicts at its prefill); -1 for the others, whose first window sets it (`_first_observed`)."""
        if not self.streams_queries:
            return torch.full_like(like, -1)
        first = [max(limit, length) - interval for limit, length in zip(cadence.limits, prompt_lengths)]
        return torch.tensor(first, dtype=like.dtype, device=like.device)

    def _query_window(self, interval: int) -> int:
        """Queries each layer keeps for a WINDOW policy: the latest it reads (`Policy.latest_queries`),
        at most L; none for a policy that reads no attention."""
        return query_window(self.policy, interval) if self.evicts else 0

    def _forward(
        self,
        run: Run,
        input_ids,
        positions,
        valid,
        counts: Sequence[int],
        inject: RecordedForward | None = None,
        record: RecordedForward | None = None,
        evict: bool = True,
        static: StaticDecode | None = None,
    ) -> torch.Tensor | None:
        """Run the model on the tokens (recording into `record` if given), or `inject` a recorded run of
        the same tokens (no logits then), or run a `static` decode step on them, and every policy hook and, with
        `evict`, the eviction step that follows. `valid` [batch] and `counts` (its values on the host): each row's
        tokens that are not padding."""
        start = self.clock.start()
        if static is not None:
            input_ids, positions, valid = static.load(input_ids, positions)
        skip_prompt = not run.prefilled and self.policy.observed_queries is ObservedQueries.DECODE
        run.cadence.fed(counts)
        records_queries = not skip_prompt and (static is not None or self._reaches_a_window(run))
        observation = self.evict.forward_observation(run, positions) if self.observes_in_forward else None
        run.cache.begin_forward(
            positions, valid, run.cadence.lengths, record_queries=records_queries, observation=observation
        )
        logits = None
        if inject is not None:
            self._inject(run, inject)
        elif static is not None:
            logits = static.forward()
        else:
            hooks = self._install_taps()
            run.cache.recorder = record
            try:
                logits = self.model(
                    input_ids=input_ids,
                    position_ids=positions.clamp(min=0),
                    **cache_argument(self.model, run.cache),
                    use_cache=True,
                    eviction_cache=run.cache,
                ).logits
            finally:
                run.cache.recorder = None
                for hook in hooks:
                    hook.remove()
        self._store_token_state(run, positions)
        run.prefilled = True
        run.next_positions = positions.max(dim=1).values + 1
        run.stats.tokens += sum(counts)
        self.clock.stop(start, adding_to(run.stats, "forward_seconds"))
        run.stats.max_entries = max(run.stats.max_entries, run.cache.max_entries())
        if self.evicts and evict:
            self.evict(run)
        return logits

    def _inject(self, run: Run, recorded: RecordedForward) -> None:
        """What each attention layer of a forward does to the cache, from a recording of that forward:
        append the new keys and values, then the attention function on the recorded queries."""
        attention = ALL_ATTENTION_FUNCTIONS[self.attention]
        for layer_idx, decoder_layer in enumerate(self.model.get_decoder().layers):
            keys, values = run.cache.update(recorded.keys[layer_idx], recorded.values[layer_idx], layer_idx)
            attention(
                decoder_layer.self_attn,
                recorded.queries[layer_idx],
                keys,
                values,
                None,
                scaling=recorded.scaling[layer_idx],
                eviction_cache=run.cache,
            )

    def _install_taps(self) -> list:
        if not self._tap_layers:
            return []
        layers = self.model.get_decoder().layers

        def tap(index: int):
            def hook(module, args, output):
                self._taps[index] = output[0] if isinstance(output, tuple) else output

            return hook

        return [layers[i].register_forward_hook(tap(i)) for i in self._tap_layers]

    def _store_token_state(self, run: Run, positions: torch.Tensor) -> None:
        token_state = self.policy.on_forward(self._taps, positions)
        if not token_state:
            return
        count = positions.shape[1]
        for layer in run.cache.layers:
            for name, values in token_state.items():
                layer.state[name][:, :, -count:] = values[:, None, :].to(layer.state[name].dtype)


class _PrefixForwards:
    """A replay's use of a `ReplayPrefix`: record into it when it was empty at the start, else reuse it
    forward by forward while the inputs match (the caller stops asking after the first eviction)."""

    def __init__(self, prefix: ReplayPrefix | None, can_inject: bool) -> None:
        self.prefix = prefix
        self.recording = prefix is not None and not prefix.forwards
        self.reusing = prefix is not None and bool(prefix.forwards) and can_inject
        self.index = 0

    def reusable(self, input_ids, positions, valid) -> RecordedForward | None:
        if not self.reusing or self.index >= len(self.prefix.forwards):
            return None
        recorded = self.prefix.forwards[self.index]
        if not recorded.matches(input_ids, positions, valid):
            self.reusing = False
            return None
        self.index += 1
        return recorded

    def start_recording(self, input_ids, positions, valid) -> RecordedForward | None:
        if not self.recording:
            return None
        record = RecordedForward(input_ids, positions, valid)
        self.prefix.forwards.append(record)
        return record


def _token_outputs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position NLL of `targets` (`_token_nll`) and the top-1 prediction [batch, q] (the low-entropy flip
    rate compares it with the full cache's)."""
    return _token_nll(logits, targets), logits.argmax(-1)


def _token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position NLL [batch, q] of `targets` in float32 (one fused log-sum-exp; no [batch, q, vocab] copy
    of log-probabilities)."""
    flat = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    return flat.view(targets.shape)


def _as_set(eos_token_id: int | Sequence[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    return {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)


def _trim_after_eos(tokens: torch.Tensor, eos: torch.Tensor) -> list[list[int]]:
    stops, rows = set(eos.tolist()), []
    for row in tokens.tolist():
        stop = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        rows.append(row[:stop])
    return rows


def _right_pad(rows: Sequence[torch.Tensor], pad_token_id: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad_token_id, dtype=torch.long, device=rows[0].device)
    for index, row in enumerate(rows):
        out[index, : len(row)] = row
    return out
