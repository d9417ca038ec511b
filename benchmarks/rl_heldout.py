"""Held-out comparison of a reinforced scorer with the supervised scorer it started from, paired over traces.

Every held-out trace is replayed once per scorer with the learned `foresight` policy in deterministic
mode at the B and L the scorers were trained for, on the cadence of `foresight eval` (batches prefill
the same min(B + L, shortest prompt) tokens). Per trace and scorer, over the predictions after the
first eviction (`foresight.metrics`, the functions `foresight eval` and the reward use): Σ NLL with
eviction, Σ NLL with the full cache (stored with the trace), and the low-entropy damage counts.

Figures pool tokens over traces, as `foresight eval` does: −R = Σ ΔL²·1[ΔL > 1.5] / number of
bottom-80%-entropy tokens (minus the reward of docs/algorithms.md §7), loss ratio, damaged share. 95%
intervals: paired bootstrap over traces (resample the traces with replacement; both scorers on the
same resample), percentile intervals, also for the relative change of −R and the loss-ratio
difference. The report goes to a section of docs/benchmarks.md; per-trace figures to --out.

    python benchmarks/rl_heldout.py --traces runs/rl-default/traces --holdout 0.4 \\
        --scorer supervised=checkpoints/default --scorer reinforced=runs/rl-default/rl/scorer
    python benchmarks/rl_heldout.py --traces DIR --exclude 0,4,5 ...   # every trace but those trained on
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from foresight.commands.eval import select_traces
from foresight.metrics import loss_ratio, low_entropy_damage, scored_tokens
from foresight.models import load_model
from foresight.policies import make_policy
from foresight.scorer import load_scorer
from foresight.report import write_section
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.traces import TraceStore

REPORT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
FIELDS = ("evicted_nll", "full_nll", "low_entropy", "damaged", "squared_sum")


def per_trace(model, scorer, traces, batch_size: int) -> list[dict[str, float]]:
    """Σ NLL with eviction and with the full cache, and the damage counts, of every trace."""
    config = scorer.config
    engine = EvictionEngine(model, make_policy("foresight", scorer=scorer),
                            EvictionConfig(config.budget, config.interval, sinks=0, protect_prompt=False))
    rows = []
    for start in tqdm(range(0, len(traces), batch_size), desc=f"replays B={config.budget}", unit="batch"):
        batch = traces[start : start + batch_size]
        prefill = min(config.budget + config.interval, *(t.prompt_length for t in batch))
        output = engine.replay([t.input_ids for t in batch], [prefill] * len(batch))
        for trace, nll, first in zip(batch, output.nll, output.first_eviction):
            scored = scored_tokens(nll.numel(), first)
            damage = low_entropy_damage(nll[scored], trace.token_nll[scored], trace.token_entropy[scored])
            rows.append({
                "trace": trace.index, "evicted_nll": float(nll[scored].double().sum()),
                "full_nll": float(trace.token_nll[scored].double().sum()), "low_entropy": damage.low_entropy,
                "damaged": damage.damaged, "squared_sum": damage.squared_sum,
                "loss_ratio": loss_ratio(nll[scored], trace.token_nll[scored]),
            })
    return rows


def pooled(sums: np.ndarray) -> dict[str, np.ndarray]:
    """Pooled figures from summed fields [..., 5] (FIELDS order)."""
    evicted, full, low, damaged, squared = np.moveaxis(sums, -1, 0)
    return {"penalty": squared / low, "loss_ratio": evicted / full, "damage": damaged / low}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, required=True, help="traces folder (`foresight traces`)")
    parser.add_argument("--holdout", type=float, default=None,
                        help="evaluate the held-out split of this share (the one both training stages left out)")
    parser.add_argument("--exclude", default="", help="comma-separated trace indices to leave out (traces a stage trained on)")
    parser.add_argument("--holdout-seed", type=int, default=0, help="seed of the held-out split")
    parser.add_argument("--scorer", action="append", required=True, metavar="NAME=DIR",
                        help="exactly two: the supervised scorer first, then the reinforced one")
    parser.add_argument("--batch-size", type=int, default=4, help="traces replayed together")
    parser.add_argument("--resamples", type=int, default=10000, help="bootstrap resamples")
    parser.add_argument("--out", type=Path, default=None, help="write per-trace figures (JSON) here")
    parser.add_argument("--section", default="rl-heldout-cpu", help="section of docs/benchmarks.md to rewrite")
    args = parser.parse_args()
    if len(args.scorer) != 2 or not all("=" in text for text in args.scorer):
        raise SystemExit("give exactly two --scorer NAME=DIR: the supervised one, then the reinforced one")
    names, folders = zip(*(text.split("=", 1) for text in args.scorer))
    scorers = [load_scorer(folder) for folder in folders]
    if len({(s.config.budget, s.config.interval) for s in scorers}) != 1:
        raise SystemExit("the two scorers were trained for different B, L")
    store = TraceStore(args.traces)
    minimum = scorers[0].config.budget + scorers[0].config.interval + 2
    excluded = {int(index) for index in args.exclude.split(",") if index.strip()}
    traces = [
        t for t in select_traces(store, args.holdout, args.holdout_seed, None)
        if t.input_ids.numel() >= minimum and t.index not in excluded
    ]
    model, _ = load_model(store.settings["model"])
    started = time.perf_counter()
    rows = {name: per_trace(model, scorer, traces, args.batch_size) for name, scorer in zip(names, scorers)}
    seconds = time.perf_counter() - started
    sums = np.array([[[row[field] for field in FIELDS] for row in rows[name]] for name in names])  # [2, traces, 5]
    generator = np.random.default_rng(0)
    picks = generator.integers(0, len(traces), size=(args.resamples, len(traces)))
    samples = pooled(sums[:, picks].sum(2))  # each figure [2, resamples]
    point = pooled(sums.sum(1))
    interval = lambda values: np.percentile(values, [2.5, 97.5])  # noqa: E731
    change = samples["penalty"][1] / samples["penalty"][0] - 1
    difference = samples["loss_ratio"][1] - samples["loss_ratio"][0]
    config = scorers[0].config
    lines = [
        f"### Reinforced against supervised scorer on held-out traces ({model.device.type})", "",
        f"Command: `python benchmarks/rl_heldout.py --traces {args.traces}"
        + (f" --holdout {args.holdout}" if args.holdout is not None else "")
        + (f" --exclude {args.exclude}" if args.exclude else "")
        + "".join(f" --scorer {t}" for t in args.scorer) + "`", "",
        f"{len(traces)} held-out traces of {store.settings['source']} ({int(sums[0, :, 2].sum())} "
        f"low-entropy tokens after the first eviction), never used by either stage (held out, or outside what the stages read); B = {config.budget}, "
        f"L = {config.interval}, deterministic policy; 95% paired bootstrap intervals over traces "
        f"({args.resamples} resamples). Replays took {seconds:.0f} s.", "",
        "| scorer | −R (ΔL²·1[ΔL > 1.5], mean over low-entropy tokens) | loss ratio | damaged share |",
        "|---|---:|---:|---:|",
    ]
    for index, name in enumerate(names):
        cells = []
        for figure, fmt in (("penalty", "{:.4f}"), ("loss_ratio", "{:.4f}"), ("damage", "{:.2%}")):
            low, high = interval(samples[figure][index])
            cells.append(f"{fmt.format(point[figure][index])} [{fmt.format(low)}, {fmt.format(high)}]")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    point_change = point["penalty"][1] / point["penalty"][0] - 1
    point_difference = point["loss_ratio"][1] - point["loss_ratio"][0]
    lines += [
        "",
        f"Change of −R, {names[1]} against {names[0]}: {point_change:+.1%} [{interval(change)[0]:+.1%}, "
        f"{interval(change)[1]:+.1%}] (target: −20% or lower). Loss-ratio difference: {point_difference:+.4f} "
        f"[{interval(difference)[0]:+.4f}, {interval(difference)[1]:+.4f}] (target: at most +0.005).",
    ]
    report = "\n".join(lines)
    print(report)
    write_section(REPORT, args.section, report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "rl_heldout.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
