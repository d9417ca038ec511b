"""Serving under several KV-memory caps, repeated: `foresight bench serve` once per (repeat, cap), each in a fresh
process, then one table of the rows each decoder served and its throughput at them (the median over repeats).

    python scripts/serve_caps.py --caps 16,24,32 --repeats 3 --length 2048 --policies snapkv,foresight \
        --scorer checkpoints/default --out runs/serve-caps --results docs/results/serving-caps.json

Run it on an otherwise idle machine: the throughputs are wall-clock. Each run's own report and JSON stay in
`--out`, and a run whose JSON is there already is read, not run again; the results file holds the table
docs/benchmarks.md quotes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from foresight.bench.watched_run import RunResult
from foresight.eval.published import this_run


def rotated(policies: str, repeat: int) -> str:
    """The policies in the order repeat `repeat` (from 0) runs them: each repeat starts one later, so that no policy
    always runs first in its process (a drift of the machine's speed within a run then hits each in turn)."""
    names = policies.split(",")
    shift = repeat % len(names)
    return ",".join(names[shift:] + names[:shift])


def serve(cap: int, args: argparse.Namespace, out: Path, repeat: int = 0) -> list[dict]:
    """One `foresight bench serve` at `cap` MiB, the policies in repeat `repeat`'s order; its runs
    (`RunResult.as_json`), read back instead where an earlier sweep into the same folder finished it (so a stopped
    sweep resumes, and `--repeats` can grow)."""
    results = out.with_suffix(".json")
    if results.exists():
        return json.loads(results.read_text())
    command = [sys.executable, "-m", "foresight.cli", "bench", "serve", "--policies", rotated(args.policies, repeat)]
    command += ["--scorer", args.scorer, "--budget", str(args.budget), "--interval", str(args.interval)]
    command += ["--kv-memory", f"{cap}MiB", "--lengths", str(args.length), "--device", "cpu", "--dtype", "float32"]
    command += ["--out", str(out.with_suffix(".md")), "--results", str(results)]
    subprocess.run(command, check=True)
    return json.loads(results.read_text())


def served(runs: list[dict], decoder: str) -> tuple[int, float | None]:
    """The largest batch of `decoder` that ran to the end and its tokens/s (0 and None: not one sequence fit)."""
    fits = [run for run in runs if run["decoder"] == decoder and run["fits"] and run["seconds"]]
    if not fits:
        return 0, None
    best = RunResult(**max(fits, key=lambda run: run["batch"]))
    return best.batch, best.tokens_per_second


def table(measured: dict[int, list[list[dict]]], decoders: list[str]) -> list[list[str]]:
    """One row per cap: each decoder's rows (every repeat's) and its median tokens/s over the repeats."""
    rows = []
    for cap, repeats in measured.items():
        row = [f"{cap} MiB"]
        for decoder in decoders:
            batches, speeds = zip(*(served(runs, decoder) for runs in repeats))
            known = [speed for speed in speeds if speed is not None]
            row.append(" / ".join(map(str, batches)))
            row.append(f"{statistics.median(known):.1f}" if known else "–")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caps", default="16,24,32", help="KV-memory caps in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every cap")
    parser.add_argument("--length", type=int, default=2048, help="new tokens of every generation")
    parser.add_argument("--policies", default="snapkv,foresight", help="the policies beside the full cache")
    parser.add_argument("--scorer", default="checkpoints/default", help="the learned policy's scorer")
    parser.add_argument("--budget", type=int, default=128, help="B")
    parser.add_argument("--interval", type=int, default=32, help="L")
    parser.add_argument("--out", type=Path, default=Path("runs/serve-caps"), help="folder of each run's report")
    parser.add_argument("--results", type=Path, default=None, help="the results file of the table")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    caps = [int(cap) for cap in args.caps.split(",")]
    measured = {cap: [] for cap in caps}
    for repeat in range(args.repeats):
        for cap in caps:
            measured[cap].append(serve(cap, args, args.out / f"cap{cap}-run{repeat + 1}", repeat))
    decoders = ["full", *args.policies.split(",")]
    columns = ["cap"] + [f"{decoder}: {what}" for decoder in decoders for what in ("rows", "tokens/s")]
    rows = table(measured, decoders)
    print("| " + " | ".join(columns) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if args.results is not None:
        title = (
            f"Served under a KV-memory cap: rows (each of {args.repeats} runs) and median tokens/s, "
            f"{args.length}-token generations, B = {args.budget}, L = {args.interval}"
        )
        this_run(title, columns, rows).save(args.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
