"""Where a learned scorer stands against every other policy, the newest baselines among them, on several
trace sets and budgets; and each policy's loss ratio against the KV memory it holds (`python -m studies baselines`).

Each set is one or more `foresight eval` folders of the same traces, merged as `python -m studies ablation`
merges them (traces.json, every scored trace's sums: a trace scored twice must agree), plus each row's
peak KV memory per sequence from results.json (everything the policy holds: `foresight.runtime.held_memory`). Per set and budget: every policy's pooled loss ratio and
low-entropy damage with 95% bootstrap intervals over traces, its KV memory, and the learned scorer's
paired gain over it (policy − learned; positive: the learned scorer is better) on the traces both scored
on the same tokens. A policy that protects the prompt scores only the tokens after it and holds the
prompt on top of the budget, so it has no paired gain; its `ROW=POLICY` twin with protect_prompt=false
(`foresight eval -o ROW.protect_prompt=false`) is the one on equal memory and tokens. One PNG per set:
loss ratio against KV memory, one curve per policy over every budget of the set's folders.

    python -m studies baselines --set 'unseen A=runs/eval-a,runs/eval-a-256' --learned shipped --budgets 128,256
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from foresight.eval.headroom import FIGURES, TraceScore, paired_gain, percent, pooled_figure
from foresight.eval.report import MEMORY, plot_metric
from studies.ablation.report import TraceSets, eval_entries, merged_scores


def memory_rows(folders: Sequence[Path]) -> list[dict[str, Any]]:
    """The results.json rows of the folders, one per (policy, budget): the first that states its KV memory."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for folder in folders:
        for row in eval_entries(folder, "results.json"):
            key = (row["policy"], row["budget"])
            if key not in rows or (rows[key].get(MEMORY) is None and row.get(MEMORY) is not None):
                rows[key] = row
    return list(rows.values())


def budget_table(scores: list[TraceScore], rows: list[dict[str, Any]], learned: str, budget: int) -> list[str]:
    """The lines of one budget's table: every policy scored there, best loss ratio first; the learned
    scorer's gains where it ran at this budget (it runs only at the B it was trained for)."""
    policies = sorted({s.policy for s in scores if s.budget == budget})
    if not policies:
        return [f"B = {budget}: not evaluated."]
    memory = {row["policy"]: row.get(MEMORY) for row in rows if row["budget"] == budget}
    figures = {
        p: (pooled_figure(scores, budget, p), pooled_figure(scores, budget, p, "low_entropy_damage")) for p in policies
    }
    here = learned in policies
    lines = [
        f"B = {budget}, {len({s.index for s in scores if s.budget == budget})} traces"
        + ("." if here else f"; {learned} did not run at this budget (no gains)."),
        "",
        f"| policy | KV MiB / sequence | loss ratio | low-entropy damage | loss ratio, it − {learned} | damage, it − {learned} |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for policy in sorted(policies, key=lambda p: (math.isnan(figures[p][0].value), figures[p][0].value)):
        ratio, damage = figures[policy]
        gains = (
            [_gain(scores, budget, policy, learned, figure) for figure in FIGURES]
            if here and policy != learned
            else ["–", "–"]
        )
        kv = "–" if memory.get(policy) is None else f"{memory[policy]:.2f}"
        lines.append(f"| {policy} | {kv} | {ratio} | {percent(damage)} | {gains[0]} | {gains[1]} |")
    return lines


def _gain(scores: list[TraceScore], budget: int, policy: str, learned: str, figure: str) -> str:
    """The paired gain's cell: 'other tokens' when no trace was scored on the same tokens by both."""
    gain = paired_gain(scores, budget, policy, learned, figure)
    if gain is None:
        return "other tokens"
    return str(gain) if figure == "loss_ratio" else percent(gain)


def plot_path(plot_dir: Path, set_name: str) -> Path:
    """The set's PNG: baselines-SLUG.png in `plot_dir`."""
    slug = re.sub(r"[^a-z0-9]+", "-", set_name.lower()).strip("-")
    return plot_dir / f"baselines-{slug}.png"


def baselines_report(trace_sets: TraceSets, learned_rows: Sequence[str], budgets: Sequence[int], plot_dir: Path) -> str:
    """Every set's tables in markdown and its plot in `plot_dir`; a set's learned row is the first of
    `learned_rows` it holds."""
    parts = [
        "Loss ratio and low-entropy damage pooled over traces; gains paired over the traces both policies scored on "
        "the same tokens, 95% bootstrap intervals; positive: the learned scorer is better. KV MiB: what a sequence holds at "
        "its peak, counted by `foresight.runtime.held_memory` (K/V, positions, per-entry state, query ring and buffered "
        "queries of B + L entries, plus the prompt for a policy that protects it; the full cache: the whole trace; "
        "evaluations made before that accounting give K/V alone).",
    ]
    paths = [plot_path(plot_dir, name) for name, _ in trace_sets]
    if len(set(paths)) < len(paths):
        raise ValueError(f"set names {[name for name, _ in trace_sets]} give the same plot file: name them apart")
    for (name, folders), path in zip(trace_sets, paths):
        scores, rows = merged_scores(folders), memory_rows(folders)
        learned = next((row for row in learned_rows if row in {s.policy for s in scores}), None)
        if learned is None:
            raise ValueError(
                f"set {name}: none of the learned rows {list(learned_rows)} was evaluated in {list(map(str, folders))}"
            )
        if any(row.get(MEMORY) is not None for row in rows):
            plot_metric(rows, "loss_ratio", path, x=MEMORY)
            parts.append(f"**{name}** (loss ratio against KV memory: `{path}`)")
        else:
            parts.append(f"**{name}** (no row states its KV memory: these evaluations predate it, so no plot)")
        parts.append(f"Learned row: {learned}.")
        parts += ["\n".join(budget_table(scores, rows, learned, budget)) for budget in budgets]
    return "\n\n".join(parts)
