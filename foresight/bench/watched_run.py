"""One decoder run timed under a watch of its cache's memory: the bytes and entries the cache held after
every forward, stopped past a cap. `foresight bench serve` runs each decoder through it, ours in this
process and kvpress's in its own environment (foresight.bench.kvpress_worker), so both are measured alike."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from foresight.cache_argument import passed_cache

MiB = 2**20


class CapExceeded(RuntimeError):
    """Raised inside a run when its cache holds more bytes than the cap."""


def format_bytes(count: int | float) -> str:
    return f"{count / MiB:.1f} MiB"


def held_bytes(cache: Any) -> int:
    """Bytes of every tensor the cache's layers hold, each storage once at its allocated size."""
    storages: dict[int, int] = {}
    for layer in cache.layers:
        for tensor in _tensors(vars(layer).values()):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _tensors(values) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, Mapping):  # a layer's state is a read-only mapping of its fields
            yield from _tensors(value.values())
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


@dataclass
class RunResult:
    """One run of a decoder at one batch size."""

    decoder: str
    batch: int
    new_tokens: int
    fits: bool  # ran to the end under the cap
    peak_bytes: int  # most bytes the cache held after a forward
    peak_entries: int  # most entries a layer held then (per sequence, padding included)
    seconds: float | None = None  # wall time of the whole generation, prefill included (None: stopped)
    eviction_share: float | None = None  # scoring and eviction over decode time (our engine)
    peak_device_bytes: int | None = None  # CUDA: most memory allocated above what the model held before

    @property
    def tokens_per_second(self) -> float | None:
        return None if self.seconds is None else self.batch * self.new_tokens / self.seconds

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class CacheWatch:
    """A forward hook on the model that records the peak bytes and entries of the cache it is given
    (under either keyword, `passed_cache`) and raises CapExceeded past the cap. It runs at the end of the
    model's forward, which is before our engine evicts and after kvpress has compressed inside the layers."""

    def __init__(self, model: torch.nn.Module, cap_bytes: int | None):
        self.model = model
        self.cap_bytes = cap_bytes
        self.peak_bytes = 0
        self.peak_entries = 0

    def _hook(self, module, args, kwargs, output) -> None:
        cache = passed_cache(kwargs)
        if cache is None:
            return
        held = held_bytes(cache)
        self.peak_bytes = max(self.peak_bytes, held)
        self.peak_entries = max(self.peak_entries, max(layer.keys.shape[2] for layer in cache.layers))
        if self.cap_bytes is not None and held > self.cap_bytes:
            raise CapExceeded(f"the cache held {format_bytes(held)}, over the cap of {format_bytes(self.cap_bytes)}")

    @contextmanager
    def watching(self) -> Iterator[CacheWatch]:
        handle = self.model.register_forward_hook(self._hook, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()


def timed_run(
    name: str,
    model: torch.nn.Module,
    batch: int,
    new_tokens: int,
    cap_bytes: int | None,
    generate: Callable[[], float | None],
) -> RunResult:
    """Run `generate` (which returns the eviction share, or None) under a CacheWatch, timing it."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    watch = CacheWatch(model, cap_bytes)
    start = time.perf_counter()
    try:
        with watch.watching():
            share = generate()
    except CapExceeded:
        return RunResult(name, batch, new_tokens, False, watch.peak_bytes, watch.peak_entries)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak_device = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
    return RunResult(name, batch, new_tokens, True, watch.peak_bytes, watch.peak_entries, seconds, share, peak_device)
