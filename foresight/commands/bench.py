"""Benchmark decoding under every policy: latency, memory and eviction time share; the largest batch and
the throughput under a KV-memory cap.

`foresight bench decode` decodes a fixed-length continuation (EOS ignored) for each policy and
batch size in one process. `foresight bench serve` finds, by running it, the largest concurrent
batch the full cache and each policy can run under a KV-memory cap at growing generation lengths,
with its throughput, peak memory and eviction time share, and runs kvpress beside them when given its
environment. Every figure of a table comes from one run on one machine; each writes its section of a
markdown report with the command that made it.
"""

from __future__ import annotations

import argparse
import platform
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from foresight.commands import _bench_serve
from foresight.commands._model import add_model_arguments, model_options
from foresight.commands._policy import add_cadence_arguments, add_policies_argument, int_list, selected_policies
from foresight.models import describe, load_model
from foresight.policies import make_policy
from foresight.report import write_section
from foresight.runtime.engine import EvictionConfig, EvictionEngine, RunStats
from foresight.tasks import chat_prompt_ids

WINDOW = 512  # tokens per latency window
PROMPT = "Solve step by step: a train leaves at 9:40 and travels 3 hours 35 minutes. When does it arrive?"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benchmarks = parser.add_subparsers(dest="what", required=True, metavar="BENCHMARK")
    decode = benchmarks.add_parser(
        "decode", help="latency against generated length, memory, eviction time share",
        formatter_class=parser.formatter_class,
    )
    add_decode_arguments(decode)
    serve = benchmarks.add_parser(
        "serve", help="largest batch and throughput under a KV-memory cap, beside kvpress",
        description=_bench_serve.__doc__, formatter_class=parser.formatter_class,
    )
    _bench_serve.add_arguments(serve)


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, device="auto", dtype="auto")
    add_policies_argument(parser, "every policy that needs no labels or scorer; full is always included")
    add_cadence_arguments(parser, budget=256, interval=64)
    parser.add_argument("--max-new-tokens", type=int, default=2048, help="tokens decoded per policy and batch size")
    parser.add_argument("--batch-sizes", type=int_list, default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"), help="markdown report whose decode section is rewritten")
    parser.add_argument("--section", default=None, help="name of the report section to rewrite (default: decode-DEVICE)")


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


def run(args: argparse.Namespace) -> int:
    if args.what == "serve":
        return _bench_serve.run(args, PROMPT)
    names = selected_policies(args.policies)
    options = model_options(args)
    device = options["device"]
    model, tokenizer = load_model(args.model, **options)
    prompt = chat_prompt_ids(tokenizer, PROMPT)
    config = EvictionConfig(args.budget, args.interval)
    results = []
    for batch in args.batch_sizes:
        for name in names:
            results.append(_decode(model, name, config, [prompt] * batch, args.max_new_tokens, len(prompt)))
    report = _report(args, results, describe(model), device, model.dtype)
    write_section(args.out, args.section or f"decode-{torch.device(device).type}", report)
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
    cache = engine.last_cache
    kv_bytes = _peak_kv_bytes(cache, output.stats.max_entries)
    first = config.budget + config.interval - prompt_length if policy.evicts else None
    return DecodeResult(name, len(prompts), output.stats, kv_bytes, first)


def _peak_kv_bytes(cache, max_entries: int) -> int:
    """Bytes of K, V, positions and policy state at the largest cache length held."""
    total = 0
    for layer in cache.layers:
        batch, heads, _, dim = layer.keys.shape
        per_entry = 2 * dim * layer.keys.element_size() + 8
        per_entry += sum(value[0, 0, :1].numel() * value.element_size() for value in layer.state.values())
        total += batch * heads * max_entries * per_entry
    return total


def _report(args, results: list[DecodeResult], shape, device: str, dtype) -> str:
    command = (
        f"foresight bench decode --model {args.model} --policies {args.policies} --budget {args.budget} "
        f"--interval {args.interval} --max-new-tokens {args.max_new_tokens} --batch-sizes {','.join(map(str, args.batch_sizes))} "
        f"--device {args.device} --dtype {args.dtype} --out {shlex.quote(str(args.out))}" + (f" --section {args.section}" if args.section else "")
    )
    cpu = f"{torch.get_num_threads()} CPU threads ({platform.processor() or platform.machine()})"
    where = torch.cuda.get_device_name(device) if device.startswith("cuda") else cpu
    steps = max(len(r.stats.step_seconds) for r in results)
    windows = [(start, min(start + WINDOW, steps)) for start in range(0, steps, WINDOW)]
    lines = [
        f"### Decode benchmark ({torch.device(device).type})",
        "",
        f"Command: `{command}`",
        "",
        f"Model {args.model} ({shape}), {dtype}, on {where}; B = {args.budget}, L = {args.interval}, "
        f"{args.max_new_tokens} new tokens, EOS ignored. Latency is ms per decode step (the whole batch), "
        f"averaged over windows of generated tokens. Flatness = latency of the last {WINDOW} tokens / the "
        f"first {WINDOW} after the first eviction (target <= 1.10). Evict share = time in scoring and "
        "eviction / decode time (target <= 5% for snapkv and rkv). Peak KV = K, V, positions and policy "
        "state at the largest cache held.",
        "",
    ]
    header = ["policy", "batch"] + [f"ms/step {a + 1}-{b}" for a, b in windows] + ["flatness", "evict share", "peak KV MiB", "max entries", "tokens/s"]
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
