"""Teacher-forced evaluation with and without the shared prefix (foresight/runtime/prefix.py), same run.

Evaluates the held-out traces of a traces folder under the given policies and budgets twice, first with
every replay running the model on every token, then with the replays of a batch reusing the forwards
before the first eviction, and reports the wall and CPU seconds of each and their ratio. The two result
tables must agree to the last digit; the command fails otherwise.

    python benchmarks/eval_prefix.py --traces runs/main/traces --holdout 0.25 --policies all --budgets 128,256
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from foresight.commands._policy import int_list
from foresight.commands.eval import select_traces
from foresight.evaluation import evaluate, resolve_policies
from foresight.models import load_model
from foresight.report import write_section
from foresight.traces import TraceStore, describe_traces

REPO = Path(__file__).resolve().parents[1]
REPORT = REPO / "docs" / "benchmarks.md"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, required=True, help="a traces folder with labels at each budget")
    parser.add_argument("--holdout", type=float, default=0.25, help="evaluate this held-out share (as `foresight eval`)")
    parser.add_argument("--policies", default="all")
    parser.add_argument("--budgets", type=int_list, default=[128, 256])
    parser.add_argument("--interval", type=int, default=32)
    parser.add_argument("--section", default="eval-prefix-cpu", help="section of docs/benchmarks.md to rewrite")
    args = parser.parse_args()
    store = TraceStore(args.traces)
    traces = list(select_traces(store, args.holdout, 0, None))
    model, _ = load_model(store.settings["model"])
    specs, _ = resolve_policies(args.policies)
    timings, tables = {}, {}
    for shared in (False, True):
        wall, cpu = time.perf_counter(), time.process_time()
        result = evaluate(model, traces, specs, args.budgets, args.interval, labels_root=args.traces,
                          progress=False, share_prefix=shared)
        timings[shared] = (time.perf_counter() - wall, time.process_time() - cpu)
        tables[shared] = [{k: v for k, v in row.items() if k != "seconds"} for row in result.rows]
    if tables[True] != tables[False]:
        raise SystemExit("the shared-prefix evaluation differs from the plain one")
    (plain_wall, plain_cpu), (shared_wall, shared_cpu) = timings[False], timings[True]
    report = "\n".join([
        "### Evaluation with the shared prefix (cpu)", "",
        f"Command: `python benchmarks/eval_prefix.py --traces {args.traces} --holdout {args.holdout} "
        f"--policies {args.policies} --budgets {','.join(map(str, args.budgets))}` "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {torch.get_num_threads()} torch thread(s))", "",
        f"{describe_traces(traces)}; {len(specs)} policies; B = {', '.join(map(str, args.budgets))}, L = {args.interval}. "
        "Both runs gave the same table (every figure and interval).", "",
        "| evaluation | wall s | CPU s |", "|---|---:|---:|",
        f"| every replay runs the model on every token | {plain_wall:.1f} | {plain_cpu:.1f} |",
        f"| replays share the forwards before the first eviction | {shared_wall:.1f} | {shared_cpu:.1f} |",
        f"| ratio (plain / shared) | {plain_wall / shared_wall:.2f}x | {plain_cpu / shared_cpu:.2f}x |",
    ])
    print(report)
    write_section(REPORT, args.section, report)


if __name__ == "__main__":
    main()
