"""Time and peak memory of Golden Eviction labelling (foresight.labels.compute_golden_labels) against trace length.

Each length runs in a fresh subprocess: load the model, label a trace of B + L tokens (so the weights
are paged in and the allocator warm), note the memory in use, reset the peak, label random token ids,
read the peak (`foresight.bench.process_memory`: on CPU the resident set's high-water mark, so the
model load's own peak does not count; on CUDA torch.cuda.max_memory_allocated). "Above model" is the
peak minus the memory in use before labelling. Doubling T should about double it (captured queries and
keys are linear in T); materialising T x T attention would quadruple it. `--model` takes what the other
benchmarks take, an architecture config included (random weights: time and memory depend on the
shape alone).

    foresight bench labels-memory                     # default model, T = 2048 and 4096, B = 128, L = 32, CPU
    foresight bench labels-memory --device cuda --model configs/models/qwen3-4b.json \\
        --lengths 8192 16384 32768 --budget 1024 --interval 256
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from foresight.bench.common import ModelSettings, budget_field, interval_field
from foresight.models import DEFAULT_MODEL, dtype_name

NAME = "labels-memory"
MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class Settings(ModelSettings):
    section: str | None = field(
        default=None,
        metadata={
            "help": "name of the report section to rewrite (default: labels-memory-DEVICE, or labels-memory-CONFIG-DEVICE "
            "for an architecture config or folder)",
            "report": True,
        },
    )
    lengths: tuple[int, ...] = field(default=(2048, 4096), metadata={"help": "trace lengths T"})
    budget: int = budget_field()
    interval: int = interval_field()


def section(settings: Settings) -> str:
    """labels-memory-DEVICE, with the config's or folder's name for another model than the default."""
    name = "" if settings.model == DEFAULT_MODEL else "-" + Path(settings.model).stem
    return f"labels-memory{name}-{torch.device(settings.run_device).type}"


@dataclass(frozen=True)
class _Job:
    """What a worker process measures: one trace length, as JSON on its command line."""

    model: str
    dtype: str
    length: int
    budget: int
    interval: int
    device: str


def run(settings: Settings) -> str:
    """Measure every length in its own process; the report's markdown section."""
    rows = []
    for length in settings.lengths:
        job = _Job(
            settings.model,
            dtype_name(settings.run_dtype),
            length,
            settings.budget,
            settings.interval,
            settings.run_device,
        )
        command = [sys.executable, "-m", __name__, json.dumps(asdict(job))]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(output.strip().splitlines()[-1]))
    first = rows[0]
    lines = [
        f"### Golden labels: peak memory against trace length ({settings.run_device})",
        "",
        f"Command: `{settings.command}`",
        "",
        f"Model {settings.model} ({dtype_name(settings.run_dtype)}), B = {settings.budget}, L = {settings.interval}. Target: the "
        "memory above the model at the largest T is below 2.5x that at the smallest when T doubles (linear, not quadratic).",
        "",
        "| T | steps M | before (MiB) | peak (MiB) | above model (MiB) | ratio peak | ratio above model | time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['tokens']} | {row['steps']} | {row['before']:.0f} | {row['peak']:.0f} | {row['above_model']:.0f} "
            f"| {row['peak'] / first['peak']:.2f}x | {row['above_model'] / first['above_model']:.2f}x | {row['seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def measure(job: _Job) -> dict[str, float]:
    """Label one random trace of `job.length` tokens in this process; memory in MiB, time in s."""
    from foresight.bench.process_memory import peak_bytes, reset_peak, resident_bytes
    from foresight.labels import compute_golden_labels
    from foresight.models import load_for_benchmark

    device, budget, interval = job.device, job.budget, job.interval
    model, _ = load_for_benchmark(job.model, dtype=getattr(torch, job.dtype), device=device)
    ids = torch.randint(0, model.config.vocab_size, (job.length,), generator=torch.Generator().manual_seed(0))
    compute_golden_labels(model, ids[: budget + interval], budget, interval)  # page in the weights, warm up
    before = resident_bytes(device)
    reset_peak(device)
    started = time.perf_counter()
    labels = compute_golden_labels(model, ids, budget, interval)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = peak_bytes(device)
    return {
        "tokens": job.length,
        "steps": labels.num_steps,
        "before": before / MIB,
        "peak": peak / MIB,
        "above_model": (peak - before) / MIB,
        "seconds": seconds,
    }


if __name__ == "__main__":  # a worker of `run`: one length, its figures as the last line of stdout
    print(json.dumps(measure(_Job(**json.loads(sys.argv[1])))))
