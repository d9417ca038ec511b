"""The teacher-forced evaluation's report: its columns, table, files and the learned scorers' headroom."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from foresight.artifacts import write_text
from foresight.eval.equal_bytes import TOKEN_NLL, EqualBytes, TokenLosses, equal_bytes, save_token_losses
from foresight.eval.headroom import ORACLE, REFERENCE_HEURISTICS, Headroom, TraceScore, headroom, headroom_rows
from foresight.eval.metric_registry import METRICS, SPLIT_SETS, TokenSet
from foresight.eval.report import Column, markdown_table, write_results
from foresight.eval.specs import REFERENCE


@dataclass
class EvaluationResult:
    rows: list[dict[str, Any]]
    notes: list[str]
    trace_scores: list[TraceScore] = field(default_factory=list)
    learned: tuple[str, ...] = ()  # the rows of learned scorers (`ScorerSpec`), whatever they are named
    token_losses: list[TokenLosses] = field(default_factory=list)  # per (policy, budget, trace): every token's NLL
    reference_nll: dict[int, torch.Tensor] = field(default_factory=dict)  # per trace index: the full cache's NLL


PLOTTED = tuple(m.name for m in METRICS if m.plotted)
BY_MEMORY = tuple(m.name for m in METRICS if m.by_memory)
"""The figures also drawn against the KV memory each policy holds (the field's accuracy-against-memory curves)."""

COLUMNS: tuple[Column, ...] = (
    ("policy", "policy", "{}"),
    ("budget", "B", "{}"),
    ("interval", "L", "{}"),
    ("kv_mib", "KV MiB / sequence", "{:.2f}"),
    *((m.name, m.label, m.fmt) for m in METRICS if m.label is not None),
    ("traces", "traces", "{}"),
    ("tokens", "tokens", "{}"),
)


def split_columns(token_set: TokenSet) -> tuple[Column, ...]:
    """The columns of the table over one token set: the paired figures of its predictions (keys NAME:SET)."""
    split = tuple((f"{m.name}:{token_set.value}", m.label, m.fmt) for m in METRICS if m.paired)
    return (*COLUMNS[:3], *split, ("traces", "traces", "{}"), (f"tokens:{token_set.value}", "tokens", "{}"))


def split_tables(rows: Sequence[dict[str, Any]]) -> list[str]:
    """A results.md section per token set of `SPLIT_SETS`: the rows' figures over those predictions only."""
    return [
        f"## {token_set.value.capitalize()} tokens\n\nThe scored predictions of {token_set.value} tokens only "
        f"(the table above pools every scored prediction).\n\n{markdown_table(by_loss_ratio(rows), split_columns(token_set))}"
        for token_set in SPLIT_SETS
        if any(row.get(f"tokens:{token_set.value}") for row in rows)
    ]


def by_loss_ratio(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """By budget, then loss ratio (best first; rows without one last)."""
    return sorted(rows, key=lambda r: (r["budget"], math.inf if r["loss_ratio"] is None else r["loss_ratio"]))


def evaluation_table(rows: Sequence[dict[str, Any]]) -> str:
    """The results as a markdown table, one line per (budget, policy), each metric with its 95%
    bootstrap interval over traces in brackets; '–' where a metric is undefined."""
    return markdown_table(by_loss_ratio(rows), COLUMNS)


def write_evaluation(result: EvaluationResult, out_dir: str | os.PathLike, settings: dict[str, Any]) -> list[Path]:
    """Write results.json (the rows), results.csv, results.md (settings, notes, table) and one PNG
    per metric (budget against the metric, one line per policy, intervals as error bars), plus
    traces.json (every scored trace's sums), token_nll.pt (every scored trace's per-token NLL, for scoring
    budgets on common tokens: `foresight.eval.equal_bytes`) and, for each learned scorer, its share of the headroom
    over the best heuristic (a results.md section and headroom.json). Returns the paths written."""
    comparisons = learned_headroom(result)
    sections = split_tables(result.rows)
    sections += [f"## The learned scorer against the best heuristic\n\n{c.markdown()}" for c in comparisons]
    sections += [f"## The learned scorer at equal bytes\n\n{c.markdown()}" for c in equal_bytes_headroom(result)]
    paths = write_results(
        out_dir,
        "Teacher-forced evaluation",
        settings,
        result.notes,
        by_loss_ratio(result.rows),
        COLUMNS,
        PLOTTED,
        reference=REFERENCE.name,
        after=sections,
        by_memory=BY_MEMORY,
        learned=result.learned,
        higher_is_better=[m.name for m in METRICS if m.higher_is_better],
    )
    paths.append(Path(out_dir) / "traces.json")
    write_text(paths[-1], json.dumps([vars(score) for score in result.trace_scores], indent=1))
    paths.append(Path(out_dir) / TOKEN_NLL)
    save_token_losses(paths[-1], result.token_losses, result.reference_nll)
    if comparisons:
        paths.append(Path(out_dir) / "headroom.json")
        write_text(paths[-1], json.dumps([row for c in comparisons for row in headroom_rows(c)], indent=1))
    return paths


def equal_bytes_headroom(result: EvaluationResult) -> list[EqualBytes]:
    """`foresight.eval.equal_bytes.equal_bytes` of every learned row at a budget with golden, against every
    heuristic of the reference list evaluated at two budgets or more on the golden cadence (B + L entries: no
    protected prompt), over every token set (generated tokens first)."""
    held = {(r["policy"], r["budget"]): r["kv_mib"] for r in result.rows if r.get("kv_mib") is not None}
    cadence = {(r["policy"], r["budget"]) for r in result.rows if r.get("kv_entries") == r["budget"] + r["interval"]}
    policies = {policy for policy, _ in cadence} & set(REFERENCE_HEURISTICS)
    sweeps = sorted(p for p in policies if sum(1 for q, _ in cadence if q == p) >= 2)
    runs = sorted((b, p) for p, b in held if p in result.learned and (ORACLE, b) in held)
    if not sweeps:
        return []
    found = (
        equal_bytes(result.token_losses, result.reference_nll, held, p, b, sweeps, token_set=token_set)
        for b, p in runs
        for token_set in (*SPLIT_SETS, TokenSet.ALL)
    )
    return [c for c in found if c is not None]


def learned_headroom(result: EvaluationResult) -> list[Headroom]:
    """`foresight.eval.headroom.headroom` of every learned policy at every budget and over every token set
    (generated tokens first) where it can be measured."""
    runs = sorted({(row["budget"], row["policy"]) for row in result.rows if row["policy"] in result.learned})
    comparisons = (
        headroom(result.trace_scores, budget, policy, result.learned, token_set=token_set)
        for budget, policy in runs
        for token_set in (*SPLIT_SETS, TokenSet.ALL)
    )
    return [c for c in comparisons if c is not None]
