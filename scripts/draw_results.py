"""Redraw the plots of docs/benchmarks.md and its notes from the committed results files (docs/results/*.json) in the
report's style (`foresight.eval.report.plot_metric`: the learned scorer and golden bold, the three strongest
heuristics in colour, the rest grey), with no run folder and no model:

    python scripts/draw_results.py              # every figure below, into docs/figures/

The paged-reclaim figures are drawn from their tables beside them (docs/figures/paged-reclaim*.json, results
files transcribed from docs/notes/paged-reclaim.md) by the benchmark's own plot. A figure whose data no results file holds (unseen A's
budget sweep, the RL curves) is drawn by its own command in docs/benchmarks.md's Figures table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from foresight.bench.paged_reclaim import plot_reclaim
from foresight.eval.published import ResultsFile
from foresight.eval.report import MEMORY, numeric_rows, plot_metric

DOCS = Path(__file__).resolve().parents[1] / "docs"
FIGURES_DIR = DOCS / "figures"
LOSS = {"policy": "policy", "KV MiB / sequence": MEMORY, "loss ratio": "loss_ratio"}

FIGURES = (  # (results file, PNG, column titles -> row keys, keys every row shares, the learned rows)
    (
        "main-job.json",
        "baselines-main-job-6-held-out-gsm-symbolic-traces.png",
        LOSS | {"B": "budget", "L": "interval"},
        {},
        ("foresight-sl", "foresight-rl"),
    ),
    ("unseen-b.json", "baselines-unseen-b-30-traces.png", LOSS, {"budget": 128, "interval": 32}, ("gap-s600",)),
)
RECLAIM_FIGURES = (("paged-reclaim-pilot.json", "paged-reclaim-pilot.png"), ("paged-reclaim.json", "paged-reclaim.png"))
RECLAIMED = ("reclaimed, sequence pages", "reclaimed, layer pages", "reclaimed, (layer, head) pages")
"""The reclaimed-share columns of a paged-reclaim table, in the benchmark's layout order."""


def reclaim_rows(table: ResultsFile) -> list[dict]:
    """A paged-reclaim table's rows as the benchmark's plot reads them: policy, budget, page size and the reclaimed
    share in every layout."""
    column = {name: index for index, name in enumerate(table.columns)}
    return [
        {
            "policy": row[column["policy"]],
            "budget": int(row[column["B"]]),
            "page_size": int(row[column["page size P"]]),
            "shares": [float(row[column[name]].rstrip("%")) / 100 for name in RECLAIMED],
        }
        for row in table.rows
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=FIGURES_DIR, help="folder of the PNGs (default: docs/figures/)")
    out = parser.parse_args().out
    for name, png, keys, fixed, learned in FIGURES:
        rows = numeric_rows(ResultsFile.load(DOCS / "results" / name), keys, fixed)
        print(plot_metric(rows, "loss_ratio", out / png, x=MEMORY, learned=learned))
    for name, png in RECLAIM_FIGURES:
        plot_reclaim(reclaim_rows(ResultsFile.load(FIGURES_DIR / name)), out / png, interval=32)
        print(out / png)


if __name__ == "__main__":
    main()
