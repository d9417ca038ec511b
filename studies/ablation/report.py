"""Several learned scorers against the same heuristics and golden, on several trace sets: an ablation table
(`python -m studies ablation`).

Each set is one or more `foresight eval` output folders over the same traces and budget (each folder's
traces.json holds every scored trace's sums), so a scorer evaluated later is compared with the
heuristics and golden evaluated once. A (policy, budget, trace) scored in two folders must agree to
the last digit (the replay is deterministic); otherwise the folders are not of the same traces and
the merge is refused. Per set and learned scorer: its loss ratio and low-entropy damage, its share of
the headroom between the best heuristic and golden, and its loss-ratio gain over the best heuristic,
and its loss-ratio gain over the first scorer of the table (the reference recipe), and a second table of every
later scorer against the first (loss ratio, damage, relative change of −R, flip rate), all with paired 95%
bootstrap intervals over traces (`foresight.eval.headroom`); the best heuristic is chosen among every
non-learned policy of the set, the same for every scorer. `pooled` names sets whose traces one more
table pools as one set (its best heuristic is the best over all of them).

    python -m studies ablation --set unseen-a=runs/eval-a,runs/eval-a-std --learned shipped="paper features" \\
        --learned std="standardised features" --budget 128
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import astuple, replace
from pathlib import Path
from typing import Any

from foresight.eval.headroom import (
    ORACLE,
    Estimate,
    Headroom,
    TraceScore,
    headroom,
    paired_gain,
    percent,
)
from foresight.eval.metric_registry import TokenSet

TraceSets = Sequence[tuple[str, Sequence[Path]]]
"""(name, `foresight eval` folders of its traces) per trace set."""


def eval_entries(folder: Path, name: str) -> list[dict[str, Any]]:
    """The entries of one file of a `foresight eval` folder (traces.json, results.json), or an error naming
    the command that writes it."""
    path = folder / name
    if not path.is_file():
        raise ValueError(f"{folder} holds no {name}; make it with `foresight eval --traces ... --out {folder}`")
    return json.loads(path.read_text())


def merged_scores(folders: Sequence[Path]) -> list[TraceScore]:
    """The trace scores of several evaluation folders of the same traces, each (policy, budget, trace) once."""
    merged: dict[tuple[str, int, int, str], TraceScore] = {}
    for folder in folders:
        for entry in eval_entries(folder, "traces.json"):
            score = TraceScore(**entry)
            key = (score.policy, score.budget, score.index, score.token_set)
            if key in merged:
                score = _agreed(merged[key], score, folder)
            merged[key] = score
    return list(merged.values())


def _agreed(earlier: TraceScore, later: TraceScore, folder: Path) -> TraceScore:
    """One trace score from two folders' copies: every field both hold must agree; a field one of them does not
    hold (NaN: a traces.json written before the field existed) is taken from the other."""
    values = []
    for first, second in zip(astuple(earlier), astuple(later), strict=True):
        missing = [isinstance(value, float) and math.isnan(value) for value in (first, second)]
        if not any(missing) and first != second:
            raise ValueError(
                f"{later.policy} at B = {later.budget} on trace {later.index} differs between {folder} and an "
                "earlier folder: merge only evaluations of the same traces"
            )
        values.append(second if missing[0] else first)
    return TraceScore(*values)


def set_table(
    name: str,
    scores: list[TraceScore],
    learned: tuple[tuple[str, str], ...],
    budget: int,
    token_set: TokenSet = TokenSet.ALL,
) -> str:
    """One set's rows over the predictions of `token_set`: golden, the best heuristic and every learned scorer it
    holds."""
    names = [row for row, _ in learned]
    results: list[tuple[str, Headroom]] = []
    for row, what in learned:
        found = headroom(scores, budget, row, other_learned=[n for n in names if n != row], token_set=token_set)
        if found is not None:
            results.append((what, found))
    if not results:
        raise ValueError(f"set {name}: no learned scorer of {names} with golden and a heuristic at B = {budget}")
    first = results[0][1]
    best = first.best_heuristic
    lines = [
        f"**{name}**: {first.traces} traces, B = {budget}; best heuristic {best} "
        f"(loss ratio {first.loss_ratio[best]}, damage {percent(first.damage[best])}), golden "
        f"{first.loss_ratio[ORACLE]}; least damaging heuristic {first.least_damaging_heuristic} "
        f"({percent(first.damage[first.least_damaging_heuristic])}).",
        "",
        "| scorer | what | loss ratio | low-entropy damage | share of the headroom | loss ratio gain over "
        f"{best} | damage gain over {first.least_damaging_heuristic} | loss ratio gain over {first.learned} |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for what, result in results:
        over_first = None
        if result is not first:
            over_first = paired_gain(scores, budget, first.learned, result.learned, token_set=token_set)
        lines.append(
            f"| {result.learned} | {what} | {result.loss_ratio[result.learned]} | "
            f"{percent(result.damage[result.learned])} | {percent(result.share, 1)} | {result.ratio_gain} | "
            f"{percent(result.damage_gain)} | {over_first or '–'} |"
        )
    if len(results) > 1:
        lines += ["", *paired_table(scores, [result.learned for _, result in results], budget, token_set)]
    return "\n".join(lines)


def paired_table(
    scores: list[TraceScore], names: Sequence[str], budget: int, token_set: TokenSet = TokenSet.ALL
) -> list[str]:
    """Every later scorer against the first, paired over the traces both scored alike: the differences in loss
    ratio, low-entropy damage and flip rate (later − first) and the relative change of −R (negative: lower)."""
    first = names[0]
    lines = [
        f"Paired against {first} (later − {first}; negative is better):",
        "",
        "| scorer | loss ratio | low-entropy damage | −R, relative change | low-entropy flip rate |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in names[1:]:
        ratio, damage, flips = (
            paired_gain(scores, budget, name, first, figure, token_set=token_set)
            for figure in ("loss_ratio", "low_entropy_damage", "low_entropy_flip_rate")
        )
        penalty = paired_gain(scores, budget, first, name, "low_entropy_penalty", relative=True, token_set=token_set)
        cells = [_or_dash(ratio, str), _or_dash(damage, percent), _or_dash(penalty, percent), _or_dash(flips, percent)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _or_dash(estimate: Estimate | None, text: Callable[[Estimate], str]) -> str:
    """The estimate as `text` writes it, or a dash where there is none: no trace scored alike, or a figure the
    folders' traces.json do not hold (NaN: written before it was kept per trace; `foresight eval` rewrites it from
    its kept replays when rerun)."""
    return "–" if estimate is None or math.isnan(estimate.value) else text(estimate)


SET_STRIDE = 1_000_000
"""Index offset between the sets of a pooled table (trace indices are below it)."""


def pooled_scores(sets: list[list[TraceScore]]) -> list[TraceScore]:
    """The trace scores of several sets as one set: each trace keeps its own sums and gets an index no
    other set's trace has (set number x SET_STRIDE + its index), so resamples draw traces of every set."""
    for scores in sets:
        if any(score.index >= SET_STRIDE for score in scores):
            raise ValueError(f"a trace index of {SET_STRIDE} or more cannot be pooled across sets")
    return [
        replace(score, index=number * SET_STRIDE + score.index)
        for number, scores in enumerate(sets)
        for score in scores
    ]


def ablation_report(
    trace_sets: TraceSets,
    learned: tuple[tuple[str, str], ...],
    budget: int,
    pooled: Sequence[str] = (),
    token_set: TokenSet = TokenSet.ALL,
) -> str:
    """The tables of every set (and of the `pooled` sets as one) in markdown over the predictions of `token_set`:
    `learned` is (row name, what it is) per scorer, in table order."""
    sets = [(name, merged_scores(folders)) for name, folders in trace_sets]
    unknown = [name for name in pooled if name not in dict(sets)]
    if unknown:
        raise ValueError(f"--pool names {unknown[0]!r}, which is not a set; the sets are: {', '.join(dict(sets))}")
    if pooled:
        sets.append((f"pooled over {' + '.join(pooled)}", pooled_scores([dict(sets)[name] for name in pooled])))
    tables = [set_table(name, scores, learned, budget, token_set) for name, scores in sets]
    intervals = (
        f"Predictions of {token_set.value} tokens; 95% paired bootstrap intervals over traces; every scorer against "
        "the same best heuristic."
    )
    return "\n\n".join([intervals, *tables])
