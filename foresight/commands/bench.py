"""Benchmarks of the eviction runtime, each written to its own section of a markdown report with the
command that made it, every figure of a table from one run on one machine.

- `foresight bench decode`: latency against generated length, KV memory and eviction time share
  for each policy and batch size.
- `foresight bench memory`: the cache's storage and the process's memory step by step, held flat
  from the first eviction on (CPU or CUDA).
- `foresight bench capacity` (CUDA): for generation lengths T, the largest batch each policy decodes
  within the GPU's memory, its throughput against the full cache's, and its eviction time share.
- `foresight bench serve`: under a KV-memory cap, the largest concurrent batch of the full cache and
  of each policy at growing generation lengths, found by running it, with throughput, peak memory
  and eviction share, and kvpress's DecodingPress beside them when given its environment.

`--model` also takes an architecture config (configs/models/*.json): a paper-sized model with random
weights, since speed and memory depend on the shape alone.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from tqdm import tqdm

from foresight.commands import _bench_capacity, _bench_memory, _bench_serve
from foresight.commands._bench_common import (
    add_common_arguments,
    benchmark_device,
    command_line,
    eviction_config,
    load_benchmark_model,
    machine,
    prompt_ids,
)
from foresight.commands._policy import int_list, selected_policies
from foresight.models import describe
from foresight.policies import make_policy
from foresight.report import write_section
from foresight.runtime.engine import EvictionConfig, EvictionEngine, RunStats

WINDOW = 512  # tokens per latency window


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benchmarks = parser.add_subparsers(dest="what", required=True, metavar="BENCHMARK")
    formatter = parser.formatter_class
    decode = benchmarks.add_parser(
        "decode", help="latency against generated length, memory, eviction time share", formatter_class=formatter
    )
    add_common_arguments(decode, budget=256, interval=64)
    decode.add_argument("--max-new-tokens", type=int, default=2048, help="tokens decoded per policy and batch size")
    decode.add_argument("--batch-sizes", type=int_list, default=[1, 8], help="comma-separated batch sizes")
    decode.set_defaults(benchmark=run_decode)
    for module in (_bench_memory, _bench_capacity, _bench_serve):
        sub = benchmarks.add_parser(
            module.NAME, help=module.__doc__.splitlines()[0], description=module.__doc__, formatter_class=formatter
        )
        module.add_arguments(sub)
        sub.set_defaults(benchmark=module.run)


def run(args: argparse.Namespace) -> int:
    return args.benchmark(args)


@dataclass
class DecodeResult:
    policy: str
    batch: int
    stats: RunStats
    kv_bytes: int
    first_eviction_step: int | None  # decode step at which the first eviction happens

    def window_ms(self, start: int, stop: int) -> float:
        steps = self.stats.step_seconds[start:stop]
        return 1000 * sum(steps) / max(len(steps), 1)

    @property
    def flatness(self) -> float | None:
        """Latency of the last window over the first full window after the first eviction."""
        steps = len(self.stats.step_seconds)
        first_eviction = self.first_eviction_step
        if first_eviction is None or steps - first_eviction < 2 * WINDOW:
            return None
        return self.window_ms(steps - WINDOW, steps) / self.window_ms(first_eviction, first_eviction + WINDOW)


def run_decode(args: argparse.Namespace) -> int:
    names = selected_policies(args.policies)  # refuse a bad list before loading the model
    device = benchmark_device(args)
    model, tokenizer = load_benchmark_model(args)
    prompt = prompt_ids(tokenizer, model.config.vocab_size)
    config = eviction_config(args)
    results = []
    for batch in args.batch_sizes:
        for name in names:
            results.append(_decode(model, name, config, [prompt] * batch, args.max_new_tokens, len(prompt)))
    report = _report(args, results, describe(model), device, model.dtype)
    write_section(args.out, args.section or f"decode-{device}", report)
    print(report)
    print(f"wrote the decode section of {args.out}")
    return 0


def _decode(model, name: str, config: EvictionConfig, prompts, max_new_tokens: int, prompt_length: int) -> DecodeResult:
    policy = make_policy(name)
    engine = EvictionEngine(model, policy, config if policy.evicts else None)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with tqdm(total=max_new_tokens, desc=f"{name} x{len(prompts)}", unit="tok", leave=False) as bar:
        output = engine.generate(prompts, max_new_tokens, on_token=lambda n: bar.update(n - bar.n))
    kv_bytes = engine.last_cache.storage_bytes()
    first = config.budget + config.interval - prompt_length if policy.evicts else None
    return DecodeResult(name, len(prompts), output.stats, kv_bytes, first)


def _report(args, results: list[DecodeResult], shape, device: str, dtype) -> str:
    batch_sizes = ",".join(map(str, args.batch_sizes))
    command = command_line("decode", args, f"--max-new-tokens {args.max_new_tokens} --batch-sizes {batch_sizes}")
    where = machine(device)
    steps = max(len(r.stats.step_seconds) for r in results)
    windows = [(start, min(start + WINDOW, steps)) for start in range(0, steps, WINDOW)]
    lines = [
        f"### Decode benchmark ({device})",
        "",
        f"Command: `{command}`",
        "",
        f"Model {args.model} ({shape}), {dtype}, on {where}; B = {args.budget}, L = {args.interval}, "
        f"{args.max_new_tokens} new tokens, EOS ignored. Latency is ms per decode step (the whole batch), "
        f"averaged over windows of generated tokens. Flatness = latency of the last {WINDOW} tokens / the "
        f"first {WINDOW} after the first eviction (target <= 1.10). Evict share = time in scoring and "
        "eviction / decode time (target <= 5% for snapkv and rkv). KV held = the cache's storage (K, V, "
        "positions, policy state, query ring buffer), allocated once per run.",
        "",
    ]
    header = ["policy", "batch"] + [f"ms/step {a + 1}-{b}" for a, b in windows] + ["flatness", "evict share", "KV held MiB", "max entries", "tokens/s"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        flat = "n/a" if r.flatness is None else f"{r.flatness:.3f}"
        decode_seconds = sum(r.stats.step_seconds)
        row = [r.policy, str(r.batch)] + [f"{r.window_ms(a, b):.2f}" for a, b in windows] + [
            flat,
            f"{100 * r.stats.eviction_share:.2f}%",
            f"{r.kv_bytes / 2**20:.1f}",
            str(r.stats.max_entries),
            f"{r.batch * len(r.stats.step_seconds) / max(decode_seconds, 1e-9):.1f}",
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"
