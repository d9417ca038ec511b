"""`foresight bench serve`: under a KV-memory cap, the largest concurrent batch of the full cache and of
each policy at growing generation lengths, found by running it (foresight.bench.serving), with the
throughput at that batch as a ratio to the full cache's in the same run, the peak memory and the
eviction time share; with --kvpress-python, kvpress's DecodingPress runs the same model, prompt, B and
L beside ours, in its own environment, and is reported next to ours (batch-1 throughput as well).
The table has the shape of ForesightKV Table 3.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from foresight.artifacts import write_text
from foresight.bench.common import PROMPT, BenchSettings, dtype_name
from foresight.models import describe, load_model
from foresight.policies import make_policy
from foresight.bench.serving import (
    MiB,
    RunResult,
    Search,
    EngineDecoder,
    bytes_per_entry,
    check_one_sequence_fits,
    format_bytes,
    max_batch,
    parse_memory_cap,
)
from foresight.bench.kvpress_worker import PRESSES, KvpressDecoder
from foresight.data.tasks import chat_prompt_ids

BATCH_ONE_REPEATS = 2
NAME = "serve"


@dataclass(frozen=True, kw_only=True)
class ServeSettings(BenchSettings):
    kv_memory: str  # the KV-memory cap: a size such as 512MiB, or a fraction of the free memory such as 0.5
    lengths: list[int]  # generation lengths (new tokens)
    kvpress_python: str | None  # the python of an environment with kvpress: also run its DecodingPress
    results: Path | None  # also write every run as JSON to this file


def run(settings: ServeSettings) -> str:
    """Measure and report; every decoder decodes copies of bench's one prompt (`PROMPT`)."""
    names = settings.policies
    if any(length < 1 for length in settings.lengths):
        raise ValueError(f"--lengths {','.join(map(str, settings.lengths))}: every length must be at least 1")
    device = settings.device
    cap = parse_memory_cap(settings.kv_memory, device)
    paired = [name for name in names if name in PRESSES] if settings.kvpress_python else []
    load_before = os.getloadavg()
    model, tokenizer = load_model(settings.model, device=device, dtype=settings.dtype)
    prompt = chat_prompt_ids(tokenizer, PROMPT)
    decoders = [EngineDecoder(name, model, make_policy(name), settings.eviction, prompt) for name in names]
    decoders += [
        KvpressDecoder(settings.kvpress_python, name, settings.budget, settings.interval, settings.model, device,
                       dtype_name(settings.dtype), torch.get_num_threads(), prompt)
        for name in paired
    ]
    try:
        searches, batch_one = _measure(decoders, paired, sorted(settings.lengths), cap)
    finally:
        for decoder in decoders:
            if isinstance(decoder, KvpressDecoder):
                decoder.close()
    load_after = os.getloadavg()
    report = _report(settings, cap, decoders, paired, searches, batch_one, describe(model), (load_before, load_after), len(prompt))
    if settings.results is not None:
        runs = [run.as_json() for search in searches.values() for run in search.runs] + [r.as_json() for r in batch_one.values()]
        write_text(settings.results, json.dumps(runs, indent=1))
    return report


def _measure(decoders, paired: list[str], lengths: list[int], cap: int) -> tuple[dict[tuple[str, int], Search], dict[str, RunResult]]:
    """Probe every decoder (refusing a cap below one sequence before any long run), then search each
    one's max batch at every length, shortest first, all decoders at a length in turn; then the batch-1
    runs of our policies that have a kvpress counterpart, and of kvpress, at the shortest length (the
    best of BATCH_ONE_REPEATS alternating runs of each)."""
    per_entry = {decoder.name: bytes_per_entry(decoder, lengths[-1]) for decoder in decoders}
    for decoder in decoders:
        check_one_sequence_fits(decoder, lengths[-1], cap, per_entry[decoder.name])
    searches: dict[tuple[str, int], Search] = {}
    batch_one: dict[str, RunResult] = {}
    with tqdm(desc="serve", unit="run") as bar:
        for length in lengths:
            for decoder in decoders:
                bar.set_postfix_str(f"{decoder.name} at {length}")
                searches[decoder.name, length] = max_batch(decoder, length, cap, per_entry[decoder.name], on_run=lambda _: bar.update())
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


def _ratio(value: float | None, reference: float | None) -> str:
    return "–" if value is None or not reference else f"{value / reference:.2f}x"


def _report(settings: ServeSettings, cap, decoders, paired, searches, batch_one, shape, load, prompt_tokens: int) -> str:
    device = settings.device
    cpu = f"{torch.get_num_threads()} CPU threads ({platform.processor() or platform.machine()})"
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else cpu
    lengths = sorted(settings.lengths)
    lines = [
        f"### Serving under a KV-memory cap ({torch.device(device).type})",
        "",
        f"Command: `{settings.command}`",
        "",
        f"Model {settings.model} ({shape}), {settings.dtype}, on {where}; B = {settings.budget}, L = {settings.interval}; KV-memory "
        f"cap {format_bytes(cap)}; one prompt of {prompt_tokens} tokens copied over the batch, greedy, EOS "
        f"ignored. Load average (1, 5, 15 min) {_load(load[0])} before and {_load(load[1])} after the run. Max batch: "
        "the largest batch whose run kept the cache's tensors under the cap, found by running it (the next batch "
        "passed the cap). Throughput: tokens/s summed over the batch at that batch, prefill included. Ratios are "
        "to the full cache in the same run.",
        "",
    ]
    header = ["decoder"] + [f"{length} tokens: max batch" for length in lengths] + [f"{length} tokens: tokens/s" for length in lengths]
    lines += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for decoder in decoders:
        batches, speeds = [], []
        for length in lengths:
            best, full = searches[decoder.name, length].best, searches["full", length].best
            batches.append(f"{best.batch} ({_ratio(best.batch, full.batch)})")
            speeds.append(f"{best.tokens_per_second:.1f} ({_ratio(best.tokens_per_second, full.tokens_per_second)})")
        lines.append("| " + " | ".join([decoder.name, *batches, *speeds]) + " |")
    lines += ["", "Per run at the max batch: peak KV (the cache's tensors, MiB), peak device memory above the model "
              "(CUDA), eviction time share (scoring and eviction / decode time, our engine), and the runs the search took "
              "(batch: fit, or the MiB held when the run passed the cap).", ""]
    header = ["decoder", "tokens", "max batch", "peak KV MiB", "peak device MiB", "evict share", "runs"]
    lines += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * 5 + "---|"]
    for decoder in decoders:
        for length in lengths:
            search = searches[decoder.name, length]
            best = search.best
            device_peak = "–" if best.peak_device_bytes is None else f"{best.peak_device_bytes / MiB:.0f}"
            share = "–" if best.eviction_share is None else f"{100 * best.eviction_share:.2f}%"
            runs = ", ".join(f"{r.batch}: {'fit' if r.fits else f'over at {r.peak_bytes / MiB:.1f}'}" for r in search.runs)
            lines.append(f"| {decoder.name} | {length} | {best.batch} | {best.peak_bytes / MiB:.1f} | {device_peak} | {share} | {runs} |")
    if paired:
        shortest = lengths[0]
        lines += ["", f"Ours against kvpress (DecodingPress around the press of the same rule, compression every L steps to "
                  f"B entries): batch-1 tokens/s at {shortest} new tokens (best of {BATCH_ONE_REPEATS} alternating runs each), and "
                  "tokens/s at each one's max batch.", ""]
        header = ["policy", "kvpress press", "batch-1 ours", "batch-1 kvpress", "ours / kvpress"]
        for length in lengths:
            header += [f"{length}: max batch ours / kvpress", f"{length}: tokens/s ours / kvpress"]
        lines += ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
        for name in paired:
            press = f"kvpress {PRESSES[name][0]}"
            ours, theirs = batch_one[name].tokens_per_second, batch_one[press].tokens_per_second
            cells = [name, PRESSES[name][0], f"{ours:.1f}", f"{theirs:.1f}", _ratio(ours, theirs)]
            for length in lengths:
                a, b = searches[name, length].best, searches[press, length].best
                cells += [f"{a.batch} / {b.batch}", f"{a.tokens_per_second:.1f} / {b.tokens_per_second:.1f} ({_ratio(a.tokens_per_second, b.tokens_per_second)})"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _load(values: tuple[float, float, float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)
