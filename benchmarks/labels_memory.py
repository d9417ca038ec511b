"""Time and peak memory of Golden Eviction labelling (foresight.labels.compute_golden_labels) against
trace length.

Each length runs in a fresh subprocess: load the model, label a trace of B + L tokens (so the weights
are paged in and the allocator warm), note the memory in use, reset the peak, label random token ids,
read the peak (`foresight.memory`: on CPU the resident set's high-water mark, so the model load's own
peak does not count; on CUDA torch.cuda.max_memory_allocated). "Above model" is the peak minus the
memory in use before labelling. Doubling T should about double it (captured queries and keys are
linear in T); materialising T x T attention would quadruple it. `--model` takes what `foresight bench`
takes, an architecture config included (random weights: time and memory depend on the shape alone).

    python benchmarks/labels_memory.py                      # default model, T = 2048 and 4096, B = 128, L = 32, CPU
    python benchmarks/labels_memory.py --device cuda --model configs/models/qwen3-4b.json \
        --lengths 8192 16384 32768 --budget 1024 --interval 256
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from foresight.report import write_section

MIB = 2**20
REPORT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def measure(model_name: str, dtype: str, length: int, budget: int, interval: int, device: str) -> dict[str, float]:
    """Label one random trace of `length` tokens in this process; memory in MiB, time in s."""
    import torch

    from foresight.labels import compute_golden_labels
    from foresight.memory import peak_bytes, reset_peak, resident_bytes
    from foresight.models import load_for_benchmark

    model, _ = load_for_benchmark(model_name, dtype=getattr(torch, dtype), device=device)
    ids = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(0))
    compute_golden_labels(model, ids[: budget + interval], budget, interval)  # page in the weights, warm up
    before = resident_bytes(device)
    reset_peak(device)
    started = time.perf_counter()
    labels = compute_golden_labels(model, ids, budget, interval)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = peak_bytes(device)
    return {"tokens": length, "steps": labels.num_steps, "before": before / MIB, "peak": peak / MIB,
            "above_model": (peak - before) / MIB, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="'default', a folder, a Hub id or an architecture config")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096], help="trace lengths T")
    parser.add_argument("--budget", type=int, default=128, help="B")
    parser.add_argument("--interval", type=int, default=32, help="L")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(measure(args.model, args.dtype, args.worker, args.budget, args.interval, args.device)))
        return
    rows = []
    for length in args.lengths:
        command = [sys.executable, __file__, "--worker", str(length), "--model", args.model, "--dtype", args.dtype,
                   "--budget", str(args.budget), "--interval", str(args.interval), "--device", args.device]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(output.strip().splitlines()[-1]))
    first = rows[0]
    lengths = " ".join(str(length) for length in args.lengths)
    lines = [
        f"### Golden labels: peak memory against trace length ({args.device})",
        "",
        f"Command: `python benchmarks/labels_memory.py --model {args.model} --dtype {args.dtype} --lengths {lengths} "
        f"--budget {args.budget} --interval {args.interval} --device {args.device}`",
        "",
        f"Model {args.model} ({args.dtype}), B = {args.budget}, L = {args.interval}. Target: the memory above the model at the "
        "largest T is below 2.5x that at the smallest when T doubles (linear, not quadratic).",
        "",
        "| T | steps M | before (MiB) | peak (MiB) | above model (MiB) | ratio peak | ratio above model | time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['tokens']} | {row['steps']} | {row['before']:.0f} | {row['peak']:.0f} | {row['above_model']:.0f} "
            f"| {row['peak'] / first['peak']:.2f}x | {row['above_model'] / first['above_model']:.2f}x | {row['seconds']:.1f} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    name = "" if args.model == "default" else "-" + Path(args.model).stem
    write_section(REPORT, f"labels-memory{name}-{args.device}", report)


if __name__ == "__main__":
    main()
