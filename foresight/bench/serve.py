"""Serving under a KV-memory cap: the largest concurrent batch of the full cache and of each policy at growing generation lengths, found by running it.

For each generation length, the throughput at that batch as a ratio to the full cache's in the same run,
the peak memory and the eviction time share (the shape of ForesightKV Table 3); with --kvpress-python,
kvpress's DecodingPress runs the same model, prompt, B and L beside ours, in its own environment
(`foresight.bench.kvpress_worker`), and is reported next to ours (batch-1 throughput as well).

A decoder (our engine under a policy, or kvpress in the environment that has it) decodes a batch of
copies of one prompt for N new tokens, greedily and with EOS ignored. After every forward of the
model, before the eviction that forward may trigger, a hook reads the bytes its KV cache holds: every
tensor the cache's layers hold (keys, values, positions, policy state, query buffers), each storage
counted once at its allocated size, so preallocated buffers count in full. A run stops as soon as
they exceed the cap.

The search (`max_batch`): a short batch-1 probe measures bytes per cache entry and the decoder says
how many entries a sequence holds at its fullest (prompt + N for the full cache; for a policy that
evicts, B + L or the prompt if the prefill holds more), which gives a first guess; then runs decide: the
batch is lowered until a run fits, then raised until a run does not. The largest batch that ran to the
end is the answer, reported with that run's throughput (tokens/s summed over the batch, prefill
included), its peak cache bytes, its peak device memory (CUDA) and, for our engine, the share of decode
time spent evicting. A decoder that cannot hold one sequence under the cap (the full cache of a long
generation) serves 0 rows; the run is refused only when no decoder can.

Size: the search, the decoders it drives and the report of what it found change together (each report
column is a field the search records).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm

from foresight.artifacts import write_text
from foresight.bench.common import PROMPT, RuntimeSettings, machine, model_field
from foresight.bench.kvpress_worker import PRESSES, KvpressDecoder
from foresight.bench.watched_run import MiB, RunResult, format_bytes, timed_run
from foresight.data.tasks import chat_prompt_ids
from foresight.models import describe, dtype_name, load_model

NAME = "serve"
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
_SIZE = re.compile(r"(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[a-z]*)")
PROBE_TOKENS = 16  # new tokens of the batch-1 probe past the decoder's fullest cache


class CapTooSmall(ValueError):
    """Not even one sequence fits under the cap."""


def parse_memory_cap(text: str, device: str) -> int:
    """Bytes of a KV-memory cap: a size (512MiB, 2GiB, 300MB, plain bytes), or a fraction in (0, 1) of
    the memory free on `device` now (CUDA: torch.cuda.mem_get_info; CPU: MemAvailable of /proc/meminfo)."""
    cleaned = text.strip().lower()
    try:
        fraction = float(cleaned)
    except ValueError:
        fraction = None
    if fraction is not None and "." in cleaned:
        if not 0 < fraction < 1:
            raise ValueError(f"KV memory cap {text!r}: a fraction of free memory must be in (0, 1)")
        return int(fraction * free_memory(device))
    match = _SIZE.fullmatch(cleaned)
    if match is None or match["unit"] not in _UNITS or float(match["number"]) <= 0:
        raise ValueError(
            f"KV memory cap {text!r} is not a size such as 512MiB or 2GiB, nor a fraction of free memory such as 0.5"
        )
    return int(float(match["number"]) * _UNITS[match["unit"]])


def free_memory(device: str) -> int:
    """Bytes free on `device` now."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        raise ValueError("a fraction of free memory needs CUDA or /proc/meminfo; give the cap as a size such as 2GiB")
    available = next(line for line in meminfo.read_text().splitlines() if line.startswith("MemAvailable:"))
    return int(available.split()[1]) * 1024


class Decoder(Protocol):
    name: str
    evicts: bool
    prompt_length: int

    def held_entries(self, new_tokens: int) -> int:
        """Entries one sequence holds at its fullest in a run of `new_tokens` (the first guess)."""

    def run(self, batch: int, new_tokens: int, cap_bytes: int | None) -> RunResult:
        """Decode `batch` copies of the prompt for `new_tokens` tokens, stopping past `cap_bytes`."""


class EngineDecoder:
    """Our EvictionEngine under one policy (or the full cache)."""

    def __init__(self, name: str, model: torch.nn.Module, policy, config, prompt: Sequence[int]):
        from foresight.runtime.engine import EvictionEngine

        self.name = name
        self.model = model
        self.engine = EvictionEngine(model, policy, config if policy.evicts else None)
        self.prompt = list(prompt)
        self.prompt_length = len(self.prompt)
        self.evicts = self.engine.evicts

    def held_entries(self, new_tokens: int) -> int:
        engine = self.engine
        prompt = len(self.prompt)
        full = prompt + new_tokens - 1  # the last token is sampled, never fed
        if not engine.evicts:
            return full
        protected = prompt if engine.protect_prompt else 0
        return min(
            full, max(prompt, protected + engine.config.budget + engine.config.interval)
        )  # the prefill holds the prompt

    def run(self, batch: int, new_tokens: int, cap_bytes: int | None) -> RunResult:
        def generate() -> float:
            return self.engine.generate([self.prompt] * batch, new_tokens).stats.eviction_share

        return timed_run(self.name, self.model, batch, new_tokens, cap_bytes, generate)


@dataclass
class Search:
    """The outcome of `max_batch`: the largest batch that fit (its run; None where not one sequence fits the cap,
    as the full cache's at a long generation), and every run it took."""

    best: RunResult | None
    runs: list[RunResult]

    @property
    def batch(self) -> int:
        return 0 if self.best is None else self.best.batch


def bytes_per_entry(decoder: Decoder, new_tokens: int) -> float:
    """Cache bytes per entry of one sequence, from a batch-1 run that reaches the decoder's fullest
    cache (its first eviction; `PROBE_TOKENS` new tokens for a decoder that never evicts, whose bytes
    per entry do not change with length)."""
    if decoder.evicts:
        fullest = decoder.held_entries(new_tokens) - decoder.prompt_length + 1
        length = min(new_tokens, fullest + PROBE_TOKENS)
    else:
        length = min(new_tokens, PROBE_TOKENS)
    probe = decoder.run(1, length, None)
    return probe.peak_bytes / max(probe.peak_entries, 1)


def max_batch(
    decoder: Decoder,
    new_tokens: int,
    cap_bytes: int,
    per_entry: float,
    on_run: Callable[[RunResult], None] | None = None,
) -> Search:
    """The largest batch whose run of `new_tokens` keeps the cache under `cap_bytes`, by running it:
    from the guess cap / (per_entry x entries held), down until a run fits, then up until one does not."""
    batch = max(1, math.floor(cap_bytes / (per_entry * decoder.held_entries(new_tokens))))
    runs: list[RunResult] = []

    def attempt(size: int) -> RunResult:
        result = decoder.run(size, new_tokens, cap_bytes)
        runs.append(result)
        if on_run is not None:
            on_run(result)
        return result

    while not (best := attempt(batch)).fits:
        if batch == 1:
            raise CapTooSmall(
                f"KV memory cap {format_bytes(cap_bytes)} is smaller than one sequence of {decoder.name} at "
                f"{new_tokens} new tokens (its cache passed the cap at {format_bytes(best.peak_bytes)})"
            )
        batch -= 1
    while (larger := attempt(batch + 1)).fits:
        best, batch = larger, batch + 1
    return Search(best, runs)


def check_one_sequence_fits(decoder: Decoder, new_tokens: int, cap_bytes: int, per_entry: float) -> None:
    """A one-line error, before any long run, when one sequence of `decoder` needs more than the cap."""
    needed = per_entry * decoder.held_entries(new_tokens)
    if needed > cap_bytes:
        raise CapTooSmall(
            f"KV memory cap {format_bytes(cap_bytes)} is smaller than one sequence of {decoder.name} at {new_tokens} "
            f"new tokens ({format_bytes(needed)}: {decoder.held_entries(new_tokens)} entries x {per_entry:.0f} bytes)"
        )


BATCH_ONE_REPEATS = 2


@dataclass(frozen=True, kw_only=True)
class Settings(RuntimeSettings):
    model: str = model_field(architecture_configs=False)
    kv_memory: str = field(
        metadata={
            "help": "the KV-memory cap: a size such as 512MiB or 2GiB, or a fraction of the free memory such as 0.5",
            "metavar": "SIZE|FRACTION",
        }
    )
    lengths: tuple[int, ...] = field(
        default=(1024, 2048, 4096), metadata={"help": "generation lengths (new tokens), comma-separated"}
    )
    kvpress_python: str | None = field(
        default=None,
        metadata={
            "help": "the python of an environment with kvpress (e.g. .venv-kvpress/bin/python, made by scripts/crosscheck.sh): "
            f"also run kvpress's DecodingPress for the policies it has ({', '.join(PRESSES)})",
            "metavar": "PYTHON",
        },
    )
    results: Path | None = field(default=None, metadata={"help": "also write every run as JSON to this file"})


def run(settings: Settings) -> str:
    """Measure and report; every decoder decodes copies of bench's one prompt (`PROMPT`)."""
    names = settings.policy_names
    if any(length < 1 for length in settings.lengths):
        raise ValueError(f"--lengths {','.join(map(str, settings.lengths))}: every length must be at least 1")
    device = settings.run_device
    cap = parse_memory_cap(settings.kv_memory, device)
    paired = [name for name in names if name in PRESSES] if settings.kvpress_python else []
    load_before = os.getloadavg()
    model, tokenizer = load_model(settings.model, device=device, dtype=settings.run_dtype)
    prompt = chat_prompt_ids(tokenizer, PROMPT)
    scorer = settings.learned_scorer(model)
    decoders = [EngineDecoder(name, model, settings.policy(name, scorer), settings.eviction, prompt) for name in names]
    decoders += [
        KvpressDecoder(
            settings.kvpress_python,
            name,
            settings.budget,
            settings.interval,
            settings.model,
            device,
            dtype_name(settings.run_dtype),
            torch.get_num_threads(),
            prompt,
        )
        for name in paired
    ]
    try:
        searches, batch_one = _measure(decoders, paired, sorted(settings.lengths), cap)
    finally:
        for decoder in decoders:
            if isinstance(decoder, KvpressDecoder):
                decoder.close()
    load_after = os.getloadavg()
    report = _report(
        settings, cap, decoders, paired, searches, batch_one, describe(model), (load_before, load_after), len(prompt)
    )
    if settings.results is not None:
        runs = [run.as_json() for search in searches.values() for run in search.runs] + [
            r.as_json() for r in batch_one.values()
        ]
        write_text(settings.results, json.dumps(runs, indent=1))
    return report


def _measure(
    decoders, paired: list[str], lengths: list[int], cap: int
) -> tuple[dict[tuple[str, int], Search], dict[str, RunResult]]:
    """Probe every decoder (refusing a cap below one sequence before any long run), then search each
    one's max batch at every length, shortest first, all decoders at a length in turn; then the batch-1
    runs of our policies that have a kvpress counterpart, and of kvpress, at the shortest length (the
    best of BATCH_ONE_REPEATS alternating runs of each)."""
    per_entry = {decoder.name: bytes_per_entry(decoder, lengths[-1]) for decoder in decoders}
    too_small = []
    for decoder in decoders:
        try:
            check_one_sequence_fits(decoder, lengths[-1], cap, per_entry[decoder.name])
        except CapTooSmall as error:
            too_small.append(error)
    if len(too_small) == len(decoders):
        raise too_small[0]
    searches: dict[tuple[str, int], Search] = {}
    batch_one: dict[str, RunResult] = {}
    with tqdm(desc="serve", unit="run") as bar:
        for length in lengths:
            for decoder in decoders:
                bar.set_postfix_str(f"{decoder.name} at {length}")
                searches[decoder.name, length] = _search(decoder, length, cap, per_entry[decoder.name], bar.update)
        timed = [decoder for decoder in decoders if isinstance(decoder, KvpressDecoder) or decoder.name in paired]
        for _ in range(BATCH_ONE_REPEATS):  # alternating, so a change of machine load hits both sides
            for decoder in timed:
                bar.set_postfix_str(f"{decoder.name} batch 1")
                result = decoder.run(1, lengths[0], None)
                best = batch_one.get(decoder.name)
                if best is None or result.tokens_per_second > best.tokens_per_second:
                    batch_one[decoder.name] = result
                bar.update()
    return searches, batch_one


def _search(decoder: Decoder, length: int, cap: int, per_entry: float, on_run: Callable[[], None]) -> Search:
    """`max_batch`, or no batch at all where one sequence does not fit the cap (reported as 0, not an error: the
    full cache of a long generation is what eviction is for)."""
    runs: list[RunResult] = []

    def counted(result: RunResult) -> None:
        runs.append(result)
        on_run()

    try:
        check_one_sequence_fits(decoder, length, cap, per_entry)
        return max_batch(decoder, length, cap, per_entry, on_run=counted)
    except CapTooSmall:
        return Search(None, runs)


def _ratio(value: float | None, reference: float | None) -> str:
    return "–" if value is None or not reference else f"{value / reference:.2f}x"


def _report(settings: Settings, cap, decoders, paired, searches, batch_one, shape, load, prompt_tokens: int) -> str:
    device = settings.run_device
    lengths = sorted(settings.lengths)
    lines = [
        f"### Serving under a KV-memory cap ({torch.device(device).type})",
        "",
        f"Command: `{settings.command}`",
        "",
        f"Model {settings.model} ({shape}), {settings.run_dtype}, on {machine(device)}; B = {settings.budget}, L = {settings.interval}; KV-memory "
        f"cap {format_bytes(cap)}; one prompt of {prompt_tokens} tokens copied over the batch, greedy, EOS "
        f"ignored. Load average (1, 5, 15 min) {_load(load[0])} before and {_load(load[1])} after the run. Max batch: "
        "the largest batch whose run kept the cache's tensors under the cap, found by running it (the next batch "
        "passed the cap; 0 where one sequence needs more than the cap). Throughput: tokens/s summed over the batch at that batch, prefill included. Ratios are "
        "to the full cache in the same run." + settings.scorer_note(),
        "",
    ]
    header = (
        ["decoder"]
        + [f"{length} tokens: max batch" for length in lengths]
        + [f"{length} tokens: tokens/s" for length in lengths]
    )
    lines += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for decoder in decoders:
        batches, speeds = [], []
        for length in lengths:
            search, full = searches[decoder.name, length], searches["full", length]
            batches.append(f"{search.batch} ({_ratio(search.batch, full.batch)})")
            speed, full_speed = (None if s.best is None else s.best.tokens_per_second for s in (search, full))
            speeds.append("–" if speed is None else f"{speed:.1f} ({_ratio(speed, full_speed)})")
        lines.append("| " + " | ".join([decoder.name, *batches, *speeds]) + " |")
    lines += [
        "",
        "Per run at the max batch: peak KV (the cache's tensors, MiB), peak device memory above the model "
        "(CUDA), eviction time share (scoring and eviction / decode time, our engine), and the runs the search took "
        "(batch: fit, or the MiB held when the run passed the cap).",
        "",
    ]
    header = ["decoder", "tokens", "max batch", "peak KV MiB", "peak device MiB", "evict share", "runs"]
    lines += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * 5 + "---|"]
    for decoder in decoders:
        for length in lengths:
            search = searches[decoder.name, length]
            best = search.best
            if best is None:
                lines.append(f"| {decoder.name} | {length} | 0 | – | – | – | not one sequence fits the cap |")
                continue
            device_peak = "–" if best.peak_device_bytes is None else f"{best.peak_device_bytes / MiB:.0f}"
            share = "–" if best.eviction_share is None else f"{100 * best.eviction_share:.2f}%"
            runs = ", ".join(
                f"{r.batch}: {'fit' if r.fits else f'over at {r.peak_bytes / MiB:.1f}'}" for r in search.runs
            )
            lines.append(
                f"| {decoder.name} | {length} | {best.batch} | {best.peak_bytes / MiB:.1f} | {device_peak} | {share} | {runs} |"
            )
    if paired:
        shortest = lengths[0]
        lines += [
            "",
            f"Ours against kvpress (DecodingPress around the press of the same rule, compression every L steps to "
            f"B entries): batch-1 tokens/s at {shortest} new tokens (best of {BATCH_ONE_REPEATS} alternating runs each), and "
            "tokens/s at each one's max batch.",
            "",
        ]
        header = ["policy", "kvpress press", "batch-1 ours", "batch-1 kvpress", "ours / kvpress"]
        for length in lengths:
            header += [f"{length}: max batch ours / kvpress", f"{length}: tokens/s ours / kvpress"]
        lines += ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
        for name in paired:
            press = f"kvpress {PRESSES[name][0]}"
            ours, theirs = batch_one[name].tokens_per_second, batch_one[press].tokens_per_second
            cells = [name, PRESSES[name][0], f"{ours:.1f}", f"{theirs:.1f}", _ratio(ours, theirs)]
            for length in lengths:
                a, b = searches[name, length], searches[press, length]
                speeds = "–"
                if a.best is not None and b.best is not None:
                    ours, theirs = a.best.tokens_per_second, b.best.tokens_per_second
                    speeds = f"{ours:.1f} / {theirs:.1f} ({_ratio(ours, theirs)})"
                cells += [f"{a.batch} / {b.batch}", speeds]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _load(values: tuple[float, float, float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)
