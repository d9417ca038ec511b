"""A decode step of fixed shapes, which a CUDA graph can hold (docs/algorithms.md section 1, "Static decode").

An eager decode forward's shapes follow the cache: its attention reads the N entries held, N grows by one
per token, and the host's counters (the write position, the ring's index) are Python integers baked into
each operation. On a GPU each of its few hundred small kernels is launched from Python at every token, which
bounds a step at tens of milliseconds whatever the model's size. The static step instead:

- attends over every slot of the run's storage (B + L and the protected prompt, allocated once) under a mask
  of the valid slots that the step computes on the device from the device's write cursor and lengths;
- writes its token's entry, position and fresh state at that cursor, and its query at the device's query
  slot (the ring of a window policy, the stream buffer of a streaming one), all in place;
- advances the device's counters itself, so that the host only mirrors them (`EvictionCache.advance_static`).

So consecutive decode forwards run the same operations on the same tensors with the same shapes, and with
`DecodeStep.GRAPH` the step is captured once per run (one graph per batch size) and replayed at every token.
The eviction step runs eagerly between replays and compacts in place, so the graph's tensors stay where they
are. Policies that observe every query (H2O, LazyEviction, RaaS) keep a list of them and policies that read
hidden states at every forward run eagerly only.
"""

from __future__ import annotations

import torch

from foresight.cache_argument import cache_argument
from foresight.choices import Choice
from foresight.runtime.cache import EvictionCache


class DecodeStep(Choice):
    """How the engine runs a decode forward."""

    EAGER = "eager"  # shapes follow the cache (every policy)
    STATIC = "static"  # fixed shapes and device-side counters, run eagerly (what a graph holds; any device)
    GRAPH = "graph"  # the static step captured in a CUDA graph per run and replayed at every token (CUDA)


class StaticDecode:
    """The decode forwards of one run in static form: its inputs copied into fixed tensors, the model run on the
    cache in static decode, and with `graph` the first step run eagerly (on a side stream, the warm-up CUDA
    graphs need) and the second captured, then replayed at every token."""

    def __init__(self, model: torch.nn.Module, cache: EvictionCache, batch: int, graph: bool):
        text = model.config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        cache.start_static_decode(text.num_attention_heads, head_dim)
        device = model.device
        self.model, self.cache, self.graph = model, cache, graph
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.valid = torch.ones(batch, dtype=torch.long, device=device)
        self.warm = False
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None

    def load(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copy one decode forward's tokens and positions [batch, 1] into the step's fixed inputs; returns them
        and the valid counts (every row feeds its token)."""
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        return self.tokens, self.positions, self.valid

    def forward(self) -> torch.Tensor:
        """The logits [batch, 1, vocab] of the loaded tokens (with `graph` a copy of the graph's output, which the
        next replay rewrites); the cache's host mirrors advanced."""
        if not self.graph:
            logits = self.step()
        elif self._graph is not None:
            self._graph.replay()
            logits = self._logits.clone()
        elif not self.warm:
            logits = self._warm_up()
        else:
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._logits = self.step()
            self._graph.replay()  # capturing records the step without running it
            logits = self._logits.clone()
        self.cache.advance_static()
        return logits

    def step(self) -> torch.Tensor:
        """One static decode forward on the device: the model on the loaded tokens, then the device counters."""
        logits = self.model(
            input_ids=self.tokens,
            position_ids=self.positions,
            **cache_argument(self.model, self.cache),
            use_cache=True,
            eviction_cache=self.cache,
        ).logits
        self.cache.static.after_forward()
        return logits

    def _warm_up(self) -> torch.Tensor:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            logits = self.step()
        torch.cuda.current_stream().wait_stream(stream)
        self.warm = True
        return logits
