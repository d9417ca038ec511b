"""Redraw the plots of docs/benchmarks.md and its notes from the committed results files (docs/results/*.json) in the
report's style (`foresight.eval.report.plot_metric`: the learned scorer and golden bold, the three strongest
heuristics in colour, the rest grey), with no run folder and no model:

    python scripts/draw_results.py              # every figure below, into docs/figures/

Unseen A's plot and the paged-reclaim figures are drawn from tables beside them (docs/figures/*.json, results
files transcribed from the notes whose run folders are gone), the latter by the benchmark's own plot. Training
curves are drawn from the series `foresight curves` writes beside its PNG (docs/figures/*-curves.json).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from foresight.bench.paged_reclaim import plot_reclaim
from foresight.commands.curves import draw_curves, read_scalars
from foresight.eval.published import ResultsFile
from foresight.eval.report import MEMORY, numeric_rows, plot_metric

DOCS = Path(__file__).resolve().parents[1] / "docs"
FIGURES_DIR = DOCS / "figures"
LOSS = {"policy": "policy", "KV MiB / sequence": MEMORY, "loss ratio": "loss_ratio"}

FIGURES = (  # (results file under docs/, PNG, column titles -> row keys, keys every row shares, the learned rows)
    (
        "results/main-job.json",
        "baselines-main-job-6-held-out-gsm-symbolic-traces.png",
        LOSS | {"B": "budget", "L": "interval"},
        {},
        ("foresight-sl", "foresight-rl"),
    ),
    ("results/unseen-b.json", "baselines-unseen-b-30-traces.png", LOSS, {"budget": 128, "interval": 32}, ("gap-s600",)),
    (
        "figures/baselines-unseen-a.json",
        "baselines-unseen-a-14-traces.png",
        LOSS | {"B": "budget"},
        {"interval": 32},
        ("gap-s600",),
    ),
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
        rows = numeric_rows(ResultsFile.load(DOCS / name), keys, fixed)
        print(plot_metric(rows, "loss_ratio", out / png, x=MEMORY, learned=learned))
    for name, png in RECLAIM_FIGURES:
        plot_reclaim(reclaim_rows(ResultsFile.load(FIGURES_DIR / name)), out / png, interval=32)
        print(out / png)
    for series in sorted(FIGURES_DIR.glob("*-curves.json")):
        drawn = json.loads(series.read_text())
        draw_curves(
            read_scalars(series), list(drawn["tags"]), drawn["window"], drawn["run"], out / f"{series.stem}.png"
        )
        print(out / f"{series.stem}.png")


if __name__ == "__main__":
    main()
