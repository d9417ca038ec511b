"""Reports: named sections of shared markdown files (each benchmark rewrites only its own), and the
result tables of the evaluations (JSON, CSV, markdown with confidence intervals, plots by budget)."""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from foresight.artifacts import atomic_file, write_text
from foresight.eval.published import ResultsFile, this_run


def write_section(path: Path, name: str, body: str) -> None:
    """Replace (or append) the section between `<!-- name:start -->` and `<!-- name:end -->` in `path`,
    leaving the rest of the file as it was; the file is replaced atomically."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}\n"
    text = path.read_text() if path.exists() else ""
    if start in text and end in text:
        before, rest = text.split(start, 1)
        after = rest.split(end, 1)[1].lstrip("\n")
        text = before + block + ("\n" + after if after else "")
    else:
        text = text.rstrip() + ("\n\n" if text.strip() else "") + block
    write_text(path, text)


# -- result tables: JSON, CSV, markdown and plots by budget ------------------------------------------
Column = tuple[str, str, str]  # (row key, title, format of its value)


def interval_keys(metric: str) -> tuple[str, str]:
    """The row keys of a metric's confidence interval."""
    return f"{metric}_low", f"{metric}_high"


def set_interval(row: dict[str, Any], metric: str, interval: tuple[float, float] | None) -> None:
    """Store a metric's confidence interval (None: undefined) in `row` under `interval_keys(metric)`."""
    low, high = interval_keys(metric)
    row[low], row[high] = (None, None) if interval is None else interval


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[Column]) -> str:
    """A markdown table of `rows` in order; '–' where a value is undefined, and a metric's confidence
    interval after it in brackets where the row has one."""
    header = "| " + " | ".join(title for _, title, _ in columns) + " |"
    rule = "|" + "|".join("---" if index == 0 else "---:" for index in range(len(columns))) + "|"
    return "\n".join(
        [header, rule, *("| " + " | ".join(_cell(row, key, fmt) for key, _, fmt in columns) + " |" for row in rows)]
    )


def _cell(row: dict[str, Any], key: str, fmt: str) -> str:
    if row.get(key) is None:
        return "–"
    text = fmt.format(row[key])
    low, high = (row.get(name) for name in interval_keys(key))
    return text if low is None or high is None else f"{text} [{fmt.format(low)}, {fmt.format(high)}]"


CELL = re.compile(r"(-?[\d.]+)(%?)(?: \[(-?[\d.]+)%?, (-?[\d.]+)%?\])?")
"""A figure as a table prints it: a value, a percent sign, its interval in brackets (`_cell`)."""


def numeric_rows(source: ResultsFile, keys: dict[str, str], fixed: dict[str, Any] | None = None) -> list[dict]:
    """The table's rows as report rows (the shape `plot_metric` draws): each column title of `keys`
    read back into its row key, a figure's interval into `interval_keys`, a percentage as a fraction, a
    cell that is not a number ('–', 'other tokens') as None; `fixed` adds keys every row shares."""
    rows = []
    for cells in source.rows:
        row = dict(fixed or {})
        for title, key in keys.items():
            cell = cells[source.columns.index(title)]
            match = CELL.fullmatch(cell)
            if key == "policy" or match is None:
                row[key] = cell if key == "policy" else None
                continue
            scale = 0.01 if match[2] else 1.0
            row[key] = float(match[1]) * scale if "." in cell or scale != 1.0 else int(match[1])
            if match[3] is not None:
                set_interval(row, key, (float(match[3]) * scale, float(match[4]) * scale))
        rows.append(row)
    return rows


def write_results(
    out_dir: str | os.PathLike,
    title: str,
    settings: dict[str, Any],
    notes: Sequence[str],
    rows: Sequence[dict[str, Any]],
    columns: Sequence[Column],
    plotted: Sequence[str],
    reference: str = "full",
    after: Sequence[str] = (),
    by_memory: Sequence[str] = (),
    learned: Sequence[str] = (),
    higher_is_better: Sequence[str] = (),
) -> list[Path]:
    """Write results.json (the rows), results.csv, results.md (title, settings, notes, table, then the
    markdown blocks of `after`), page.json (the table's cells with the command, commit and machine: the
    results file to commit beside a docs page that quotes the table, `foresight.eval.published`) and one PNG per metric in `plotted` that has a value (budget against
    the metric, one line per policy, the `reference` policy dashed), and one more per metric of
    `by_memory` against the rows' KV memory (`kv_mib`); `learned` and `higher_is_better` (metric names) as
    `plot_metric` takes them. Returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "results.csv", out_dir / "results.md"]
    write_text(paths[0], json.dumps(list(rows), indent=1))
    with atomic_file(paths[1]) as temporary, open(temporary, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else [key for key, _, _ in columns])
        writer.writeheader()
        writer.writerows(rows)
    setting_lines = [f"- {key}: {value}" for key, value in settings.items()]
    note_lines = [f"- {note}" for note in notes] or ["- none"]
    blocks = [markdown_table(rows, columns), *after]
    text = "\n".join([f"# {title}", "", *setting_lines, "", "Notes:", "", *note_lines, "", "\n\n".join(blocks), ""])
    write_text(paths[2], text)
    cells = [[_cell(row, key, fmt) for key, _, fmt in columns] for row in rows]
    paths.append(this_run(title, [title for _, title, _ in columns], cells).save(out_dir / "page.json"))
    for metric in plotted:
        if any(row.get(metric) is not None for row in rows):
            paths.append(
                plot_metric(
                    rows,
                    metric,
                    out_dir / f"{metric}.png",
                    reference,
                    learned=learned,
                    higher_is_better=metric in higher_is_better,
                )
            )
    for metric in by_memory:
        if any(row.get(metric) is not None and row.get(MEMORY) is not None for row in rows):
            paths.append(
                plot_metric(
                    rows,
                    metric,
                    out_dir / f"{metric}_by_memory.png",
                    reference,
                    x=MEMORY,
                    learned=learned,
                    higher_is_better=metric in higher_is_better,
                )
            )
    return paths


MEMORY = "kv_mib"
"""The rows' KV memory per sequence in MiB, the x axis of the memory plots."""


STRONGEST = 3
"""Heuristics drawn in colour beside the learned scorer and golden; the others are drawn thin and grey."""


def plot_metric(
    rows: Sequence[dict[str, Any]],
    metric: str,
    path: Path,
    reference: str = "full",
    x: str = "budget",
    learned: Sequence[str] = (),
    higher_is_better: bool = False,
    oracle: str = "golden",
) -> Path:
    """Budget (or `x`: MEMORY) against `metric`, one line per policy (matplotlib, Agg backend), with the
    confidence interval as error bars where rows have one; the `reference` a dashed black line (a point,
    against memory).

    Without `learned` every policy gets its own colour and marker. With the learned rows named, the plot
    is read at a glance: the learned scorers and the `oracle` bold in their own colours, the STRONGEST
    other policies (best mean of the metric over their points) in colour, every other policy thin and
    grey without error bars; a caption says at which budgets the learned scorer ran (a scorer runs at the
    B it was trained for, so a curve over budgets is one scorer per budget, never one applied across)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    tab20 = plt.get_cmap("tab20").colors
    colours, markers = tab20[0::2] + tab20[1::2], "osD^v<>pPhX*"  # the ten strong colours first
    low_key, high_key = interval_keys(metric)
    curves = {}
    for policy in dict.fromkeys(row["policy"] for row in rows):
        points = sorted(
            (r[x], r[metric], r.get(low_key), r.get(high_key))
            for r in rows
            if r["policy"] == policy and r[metric] is not None and r.get(x) is not None
        )
        if points:
            curves[policy] = points
    styles = _emphasis(curves, reference, learned, oracle, higher_is_better) if learned else {}
    if styles:  # the legend reads from the reference and the emphasised lines down to the muted ones
        curves = {policy: curves[policy] for policy in styles}
    for index, (policy, points) in enumerate(curves.items()):
        style = dict(color="black", linestyle="--") if policy == reference else dict(color=colours[index % 20])
        style |= styles.get(policy, {})
        muted = style["color"] == MUTED
        xs, values = [p[0] for p in points], [p[1] for p in points]
        marker = markers[index % len(markers)]
        if not muted and all(p[2] is not None and p[3] is not None for p in points):
            errors = [[v - p[2] for v, p in zip(values, points)], [p[3] - v for v, p in zip(values, points)]]
            axes.errorbar(xs, values, yerr=errors, capsize=3, marker=marker, label=policy, **style)
        else:
            axes.plot(xs, values, marker=marker, label=policy, **style)
    name = metric.replace("_", " ")
    if x == MEMORY:
        axes.set_xscale("log", base=2)
        axes.set_xlabel("peak KV cache per sequence (MiB; B + L entries, plus the prompt where protected)")
        axes.set_title(f"{name} against KV memory (L={rows[0]['interval']})")
    else:
        axes.set_xticks(sorted({row["budget"] for row in rows}))
        axes.set_xlabel("budget B (cache entries)")
        axes.set_title(f"{name} by budget (L={rows[0]['interval']})")
    if learned:
        figure.text(0.01, 0.01, _learned_caption(rows, learned), fontsize="small", color="dimgray")
    axes.set_ylabel(name)
    axes.grid(alpha=0.3)
    handles = dict(zip(*reversed(axes.get_legend_handles_labels())))  # label -> handle, in the order drawn
    axes.legend(
        [handles[p] for p in curves], list(curves), fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5)
    )
    figure.tight_layout(rect=(0, 0.08 if learned else 0, 1, 1))
    with atomic_file(path) as temporary:
        figure.savefig(temporary, dpi=120, format="png")
    plt.close(figure)
    return path


MUTED = "#b0b0b0"
LEARNED_COLOURS = ("#d62728", "#ff7f0e", "#8c564b", "#e377c2")  # red first: the learned scorer
ORACLE_COLOUR = "#2ca02c"
STRONG_COLOURS = ("#1f77b4", "#9467bd", "#17becf")


def _emphasis(
    curves: dict[str, list[tuple]], reference: str, learned: Sequence[str], oracle: str, higher_is_better: bool
) -> dict[str, dict[str, Any]]:
    """Every policy's line style, in legend order: the reference, the oracle and the learned scorers bold,
    the STRONGEST other policies (best mean of the metric over their points) in their own colours, then
    the rest thin and grey."""
    styles: dict[str, dict[str, Any]] = {}
    if reference in curves:
        styles[reference] = dict(color="black", linestyle="--")
    if oracle in curves:
        styles[oracle] = dict(color=ORACLE_COLOUR, linewidth=2.2, linestyle=":", zorder=4)
    for index, policy in enumerate(p for p in learned if p in curves):
        styles[policy] = dict(
            color=LEARNED_COLOURS[index % len(LEARNED_COLOURS)], linewidth=2.6, zorder=5, markersize=8
        )
    others = [p for p in curves if p not in styles]
    sign = -1 if higher_is_better else 1
    ranked = sorted(others, key=lambda p: sign * sum(point[1] for point in curves[p]) / len(curves[p]))
    for policy, colour in zip(ranked[:STRONGEST], STRONG_COLOURS):
        styles[policy] = dict(color=colour, linewidth=1.4, zorder=3)
    for policy in ranked[STRONGEST:]:
        styles[policy] = dict(color=MUTED, linewidth=0.8, alpha=0.6, markersize=3, zorder=1)
    return styles


def _learned_caption(rows: Sequence[dict[str, Any]], learned: Sequence[str]) -> str:
    """Where each learned scorer ran: at the B it was trained for (one scorer per budget)."""
    parts = []
    for policy in learned:
        budgets = sorted({row["budget"] for row in rows if row["policy"] == policy})
        if budgets:
            parts.append(f"{policy} at B = {', '.join(map(str, budgets))}")
    return (
        f"bold: the learned scorer ({'; '.join(parts)}), run only at the budget it was trained for (one scorer per\n"
        f"budget, none applied across budgets); colour: golden and the {STRONGEST} strongest heuristics; grey: the rest"
    )
