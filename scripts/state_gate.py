"""The gate of a state change (issue 41 §2, one-sided since issue 58; docs/notes/lean-state.md): replay held-out traces
teacher-forced under one state configuration, record every eviction step's kept (layer, KV head, position) sets
and every trace's losses, then compare two recordings. Two scorers compare the same way (a distilled member against its ensemble: `--scorer`).

    # the old state: the same script run against a checkout of the commit before the change
    PYTHONPATH=runs/base python scripts/state_gate.py record --traces data/corpus/gsm-heldout -o runs/gate/base.pt
    # the new state, one lever at a time (policy options of the learned scorer)
    python scripts/state_gate.py record --traces data/corpus/gsm-heldout -o runs/gate/sums.pt \\
        --option state_dtype=float16
    python scripts/state_gate.py compare runs/gate/base.pt runs/gate/sums.pt
    # several trace sets as one: BASE NEW pairs, their traces pooled in one paired interval
    python scripts/state_gate.py compare --pool runs/gate/base-a.pt runs/gate/sums-a.pt runs/gate/base-b.pt runs/gate/sums-b.pt

Gate (one-sided, non-inferiority; 0.11.0): the upper end of the 95% paired bootstrap interval over traces of the
change of the loss ratio on generated tokens (Σ evicted NLL / Σ full-cache NLL over the predictions of generated
tokens after the first eviction, as `foresight eval`'s generated rows) at most +0.002. A lever that lowers the loss
passes; one that raises it by less than the margin passes too. The share of identical kept sets of (trace, step,
layer, KV head) is reported beside it, no longer gated: two-sided identity refused 16-bit levers whose every loss
change had its upper end below +0.002 (docs/notes/lean-state.md). A step counts while its kept set serves a token
of its trace. Each configuration replays on its own, so a divergence carries into later steps.
Recordings are compared trace by trace, so two batch sizes compare too (float32 rounding alone: the same state
in other batch shapes).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from foresight.cadence import Regime
from foresight.data.trace_store import TraceStore, select_traces
from foresight.eval.replay import Cadence
from foresight.eval.stats import percentile_interval, resample_counts
from foresight.models import load_model
from foresight.policies import POLICIES, make_policy
from foresight.policies.options import typed_options
from foresight.runtime.engine import EvictionEngine

LOSS_GATE = 0.002


class KeptSets:
    """An `EvictionEngine.step_observer` that records, after every eviction step, each layer's kept positions
    [layers, batch, Hkv, N] (-1 on invalid slots; entries stay in position order, so equal sets are equal rows)."""

    def __init__(self) -> None:
        self.engine: EvictionEngine | None = None
        self.steps: list[torch.Tensor] = []
        self._before = 0

    def __enter__(self) -> None:
        self._before = self.engine.last_stats.evictions

    def __exit__(self, *exc) -> None:
        if exc[0] is None and self.engine.last_stats.evictions > self._before:
            held = [layer.entry_positions().to(torch.int32) for layer in self.engine.last_cache.layers]
            self.steps.append(torch.stack(held).cpu())


def record(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    views = (select_traces(TraceStore(folder), None, 0, None, per_source=args.per_source) for folder in args.traces)
    traces = sorted((trace for view in views for trace in view), key=lambda t: t.input_ids.numel())
    traces = [t for t in traces if t.input_ids.numel() > args.budget + args.interval]
    options = typed_options(POLICIES["foresight"], dict(_option(text) for text in args.option))
    batches = []
    for start in range(0, len(traces), args.batch_size):
        batch = traces[start : start + args.batch_size]
        policy = make_policy("foresight", scorer=args.scorer, record=False, **options)
        kept = KeptSets()
        cadence = Cadence(args.budget, args.interval, Regime.parse(args.regime))
        engine = EvictionEngine(model, policy, cadence.eviction, step_observer=kept)
        kept.engine = engine
        prefill = cadence.prefill_lengths(batch, engine.protect_prompt)
        output = engine.replay([t.input_ids for t in batch], prefill)
        batches.append(
            {
                "lengths": [t.input_ids.numel() for t in batch],
                "sources": [f"{t.source}#{t.index}" for t in batch],
                "steps": kept.steps,
                "nll": output.nll,
                "full": [t.token_nll for t in batch],
                "first": output.first_eviction,
                "prompts": [t.prompt_length for t in batch],
            }
        )
        print(f"batch {len(batches)}: {len(batch)} traces, {len(kept.steps)} steps", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    settings = {
        "options": options,
        "scorer": args.scorer,
        "regime": args.regime,
        "budget": args.budget,
        "interval": args.interval,
        "batch_size": args.batch_size,
    }
    torch.save({**settings, "batches": batches}, args.out)
    print(f"wrote {args.out}")


def _option(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"--option {text!r} must be NAME=VALUE")
    return name, value


@dataclass(frozen=True)
class Gate:
    """One recording against the base: the share of identical kept sets (and of held entries in common), the
    loss ratios on generated tokens and the paired change with its 95% interval; `passed` reads the upper end."""

    identity: float
    sets: int
    common: float
    old_ratio: float
    new_ratio: float
    delta: float
    low: float
    high: float

    @property
    def passed(self) -> bool:
        return self.high <= LOSS_GATE


def gate(base: dict, recording: dict) -> Gate:
    """The gate's figures of `recording` against `base` (two recordings of `record`, the same traces)."""
    old, new = _by_trace(base), _by_trace(recording)
    if new.keys() != old.keys():
        raise ValueError("the recordings replayed other traces")
    same, sets, common, entries, sums = 0, 0, 0, 0, []
    for source, (old_steps, old_nll, full, first, prompt) in old.items():
        new_steps, new_nll = new[source][:2]
        for old_kept, new_kept in zip(old_steps, new_steps):  # the serving steps, in position order
            same += int((old_kept == new_kept).all(-1).sum())
            sets += old_kept[..., 0].numel()
            common += _common_entries(old_kept, new_kept)
            entries += int((old_kept >= 0).sum())
        scored = slice(max(first, prompt - 1), None)  # the predictions of generated tokens
        sums.append([float(nll[scored].double().sum()) for nll in (old_nll, new_nll, full)])
    old_nll, new_nll, full = (np.array(column) for column in zip(*sums))
    counts = resample_counts(len(full))
    low, high = percentile_interval((counts @ new_nll - counts @ old_nll) / (counts @ full))
    return Gate(
        identity=same / sets,
        sets=sets,
        common=common / entries,
        old_ratio=old_nll.sum() / full.sum(),
        new_ratio=new_nll.sum() / full.sum(),
        delta=(new_nll.sum() - old_nll.sum()) / full.sum(),
        low=low,
        high=high,
    )


def compare(args: argparse.Namespace) -> None:
    if args.pool:
        if len(args.pool) % 2:
            raise ValueError(f"--pool takes BASE NEW pairs of recordings, got {len(args.pool)} files")
        base = _pooled([torch.load(path) for path in args.pool[::2]])
        _print_rows(base, [_pooled([torch.load(path) for path in args.pool[1::2]])], "pooled sets: ")
        return
    _print_rows(torch.load(args.base), [torch.load(path) for path in args.new])


def _pooled(recordings: list[dict]) -> dict:
    """Recordings of other trace sets as one (their traces pooled; each set's sources named by its set)."""
    batches = []
    for index, recording in enumerate(recordings):
        for batch in recording["batches"]:
            batches.append({**batch, "sources": [f"{index}:{source}" for source in batch["sources"]]})
    return {**recordings[0], "batches": batches}


def _print_rows(base: dict, recordings: list[dict], label: str = "") -> None:
    print("| configuration | kept sets identical | entries in common | loss ratio | Δ loss ratio [95% paired] | gate |")
    print("|---|---:|---:|---:|---:|---|")
    for recording in recordings:
        figures = gate(base, recording)
        options = " ".join(f"{name}={value}" for name, value in recording["options"].items()) or "no option"
        if recording.get("scorer") != base.get("scorer"):
            options = f"{recording['scorer']}, {options}"
        options = label + options
        print(
            f"| {options} (batch {recording.get('batch_size', '?')}) | {100 * figures.identity:.2f}% of "
            f"{figures.sets} | {100 * figures.common:.3f}% | {figures.new_ratio:.5f} (old {figures.old_ratio:.5f}) "
            f"| {figures.delta:+.5f} [{figures.low:+.5f}, {figures.high:+.5f}] | "
            f"{'pass' if figures.passed else 'FAIL'} |"
        )


def _by_trace(recording: dict) -> dict[str, tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, int]]:
    """Per trace: its serving steps' kept positions [layers, Hkv, N] (those whose kept set serves a token of the
    trace), its NLL with eviction and with the full cache, its first evicted position and its prompt length."""
    traces = {}
    for batch in recording["batches"]:
        for row, source in enumerate(batch["sources"]):
            steps = [step[:, row] for step in batch["steps"] if int(step[:, row].max()) < batch["lengths"][row] - 1]
            if "prompts" not in batch:
                raise ValueError("a recording made before 0.11.0 holds no prompt lengths: record it again")
            traces[source] = (steps, batch["nll"][row], batch["full"][row], batch["first"][row], batch["prompts"][row])
    return traces


def _common_entries(old: torch.Tensor, new: torch.Tensor) -> int:
    """Valid positions held by both recordings, summed over every (layer, row, KV head): each held set is
    sorted, so a position of one is in the other where a binary search finds it there."""
    index = torch.searchsorted(new.contiguous(), old.contiguous()).clamp_max(new.shape[-1] - 1)
    return int(((new.gather(-1, index) == old) & (old >= 0)).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("record", help="replay traces under one state configuration")
    run.add_argument("--traces", nargs="+", required=True, help="trace folders (held-out sets)")
    run.add_argument("--scorer", default="checkpoints/default", help="learned scorer folder")
    run.add_argument("--model", default="default")
    run.add_argument("-B", "--budget", type=int, default=128)
    run.add_argument("-L", "--interval", type=int, default=32)
    run.add_argument("--regime", default=Regime.STREAMING.value, help="streaming (default) or decode")
    run.add_argument("--per-source", type=int, default=None, help="the first N traces of each prompt source")
    run.add_argument("--batch-size", type=int, default=4)
    run.add_argument("--threads", type=int, default=1)
    run.add_argument("--option", action="append", default=[], help="policy option NAME=VALUE (the lever)")
    run.add_argument("-o", "--out", required=True)
    run.set_defaults(handler=record)
    versus = commands.add_parser("compare", help="the gate's figures of recordings against a base recording")
    versus.add_argument("base", nargs="?")
    versus.add_argument("new", nargs="*")
    versus.add_argument(
        "--pool", nargs="+", default=[], metavar="FILE", help="BASE NEW pairs of other trace sets, compared as one"
    )
    versus.set_defaults(handler=compare)
    args = parser.parse_args()
    args.handler(args)


if __name__ == "__main__":
    main()
