"""Benchmarks of the eviction runtime and of the pipeline's stages, each written to its own section of a
markdown report with the command that made it, every figure of a table from one run on one machine.

- `foresight bench decode`: latency against generated length, KV memory and eviction time share
  for each policy and batch size.
- `foresight bench memory`: the cache's storage and the process's memory step by step, held flat
  from the first eviction on (CPU or CUDA).
- `foresight bench capacity` (CUDA): for generation lengths T, the largest batch each policy decodes
  within the GPU's memory, its throughput against the full cache's, and its eviction time share.
- `foresight bench serve`: under a KV-memory cap, the largest concurrent batch of the full cache and
  of each policy at growing generation lengths, found by running it, with throughput, peak memory
  and eviction share, and kvpress's DecodingPress beside them when given its environment.
- `foresight bench eval-prefix`: teacher-forced evaluation with and without the shared prefix.
- `foresight bench labels-memory`: time and peak memory of golden labelling against trace length.
- `foresight bench paged-reclaim`: the share of evicted entries' memory a paged allocator would free.
- `foresight bench pipeline`: each stage's throughput on the same traces (labels, examples, eval replay,
  fit, rl rollouts) and its share of time in the frozen model's forward.
- `foresight bench rl-heldout`: a reinforced scorer against its supervised start on held-out traces.
- `foresight bench rl-step`: rollout eviction steps per second of the reinforcement stage.
- `foresight bench trace-generation`: trace sampling at batch 1 against static and continuous batching.

`--model` also takes an architecture config (configs/models/*.json): a paper-sized model with random
weights, since speed and memory depend on the shape alone (decode, memory, capacity, labels-memory).
"""

from __future__ import annotations

import argparse

from foresight.commands._bench_args import RUNTIME_BENCHMARKS
from foresight.commands._bench_pipeline_args import PIPELINE_BENCHMARKS
from foresight.commands._bench_stage_args import STAGE_BENCHMARKS
from foresight.eval.report import write_section

BENCHMARKS = (*RUNTIME_BENCHMARKS, *STAGE_BENCHMARKS, *PIPELINE_BENCHMARKS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benchmarks = parser.add_subparsers(dest="what", required=True, metavar="BENCHMARK")
    for benchmark in BENCHMARKS:
        doc = benchmark.module.__doc__
        sub = benchmarks.add_parser(
            benchmark.module.NAME, help=doc.splitlines()[0], description=doc, formatter_class=parser.formatter_class
        )
        benchmark.add_arguments(sub)
        sub.set_defaults(benchmark=benchmark)


def run(args: argparse.Namespace) -> int:
    """Translate the options, run the benchmark, and rewrite its section of the report."""
    benchmark = args.benchmark
    settings = benchmark.settings(args)
    report = benchmark.module.run(settings)
    write_section(args.out, args.section or benchmark.section(settings), report)
    print(report)
    print(f"wrote the {benchmark.module.NAME} section of {args.out}")
    return 0
