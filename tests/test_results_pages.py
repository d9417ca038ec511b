"""Every table README.md, docs/benchmarks.md, docs/rl.md, docs/serving.md and the notes that keep an older results
table cite from a results file (docs/results/*.json) reads as the
file holds it, cell by cell, with the prose figures the file lists; a page that drifts fails."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from foresight.eval.published import ResultsFile, cited_files, cited_tables, page_mismatches, table_cells
from foresight.eval.report import numeric_rows, write_results

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOTE = DOCS / "notes" / "baselines-2026.md"
PAGES = (ROOT / "README.md", DOCS / "benchmarks.md", DOCS / "rl.md", DOCS / "serving.md", NOTE)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_the_page_agrees_with_its_results_files(page):
    assert cited_tables(page.read_text()), f"{page.name} cites no results file"
    assert page_mismatches(page, DOCS) == []


def test_every_table_of_the_results_page_is_cited():
    """A table added to docs/benchmarks.md without its results file fails (the plots' index is not figures)."""
    lines = (DOCS / "benchmarks.md").read_text().splitlines()
    headers = [
        table_cells(line)
        for before, line in zip([""] + lines, lines)
        if line.startswith("|") and not before.startswith("|")
    ]
    cited = [header for _, header, _ in cited_tables("\n".join(lines)) if header]
    assert [header for header in headers if header not in cited] == [["figure", "what it draws", "command", "device"]]


def planted(tmp_path: Path, old: str, new: str, page: Path = DOCS / "benchmarks.md") -> tuple[Path, Path]:
    """A copy of docs/results/ and of `page` (docs/benchmarks.md or a note) with `old` replaced by `new` once
    on the page: the copied docs folder and page."""
    docs = tmp_path / "docs"
    shutil.copytree(DOCS / "results", docs / "results")
    text = page.read_text()
    assert text.count(old) == 1, old
    copy = docs / page.relative_to(DOCS)
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(text.replace(old, new))
    return docs, copy


def test_a_changed_cell_fails(tmp_path):
    docs, page = planted(tmp_path, "| 1.1865 [1.1458, 1.2343] |", "| 1.1866 [1.1458, 1.2343] |")
    assert page_mismatches(page, docs) == [
        "benchmarks.md, the table from results/shipped-scorer.json: row 'unseen B', 'loss ratio' reads "
        "'1.1866 [1.1458, 1.2343]', the file '1.1865 [1.1458, 1.2343]'"
    ]


def test_a_missing_cell_fails(tmp_path):
    docs, page = planted(tmp_path, "| 23.9% [−0.9%, 41.6%] | 39.7% [23.8%, 52.6%] |", "| 23.9% [−0.9%, 41.6%] |")
    assert page_mismatches(page, docs) == [
        "benchmarks.md, the table from results/equal-bytes.json: row 'unseen A' has 7 cells, the file 8"
    ]


def test_a_dropped_row_and_a_changed_prose_figure_fail(tmp_path):
    """On a note, whose links climb to docs/results/ (../results/), as on the results page."""
    docs, page = planted(
        tmp_path, "0.1167 [0.0637, 0.1954] of loss ratio", "0.1168 [0.0637, 0.1954] of loss ratio", NOTE
    )
    text = page.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| random | – | 2.5636"))
    page.write_text(text.replace(row + "\n", ""))
    problems = page_mismatches(page, docs)
    assert "baselines-2026.md, the table from ../results/unseen-a.json: 19 rows, the file has 20" in problems
    assert (
        "baselines-2026.md, the table from ../results/unseen-a.json: the figure 'snapkv − gap-s600, loss ratio' "
        "(0.1167 [0.0637, 0.1954] of loss ratio on A (snapkv)) is not on the page"
    ) in problems


def test_every_results_file_is_cited_and_says_where_it_came_from():
    files = sorted((DOCS / "results").glob("*.json"))
    assert set(files) == cited_files(PAGES, DOCS)
    tabled = {Path(link).name for page in PAGES for link, header, _ in cited_tables(page.read_text()) if header}
    assert sorted(path.name for path in files if path.name not in tabled) == []  # each file is a table of a page
    for path in files:
        source = ResultsFile.load(path)
        assert source.command and source.device and source.rows, path.name
        assert source.commit or not source.transcribed, path.name
        assert source.source or not source.transcribed, f"{path.name}: transcribed from where?"
        assert all(len(row) == len(source.columns) for row in source.rows), path.name


def test_a_report_writes_the_results_file_of_its_table(tmp_path):
    rows = [
        {"policy": "full", "budget": 128, "loss_ratio": 1.0, "loss_ratio_low": 1.0, "loss_ratio_high": 1.0},
        {"policy": "snapkv", "budget": 128, "loss_ratio": 1.375812, "loss_ratio_low": 1.2, "loss_ratio_high": None},
    ]
    columns = [("policy", "policy", "{}"), ("budget", "B", "{}"), ("loss_ratio", "loss ratio", "{:.4f}")]
    write_results(tmp_path, "Teacher-forced evaluation", {}, [], rows, columns, plotted=())
    written = json.loads((tmp_path / "page.json").read_text())
    assert written["columns"] == ["policy", "B", "loss ratio"]
    assert written["rows"] == [["full", "128", "1.0000 [1.0000, 1.0000]"], ["snapkv", "128", "1.3758"]]
    assert written["command"].startswith("python ") and written["device"] and not written["transcribed"]
    page = tmp_path / "page.md"
    table = (tmp_path / "results.md").read_text().split("\n| policy", 1)[1].split("\n\n", 1)[0]
    page.write_text(f"Table: [results/page.json](results/page.json)\n\n| policy{table}\n")
    (tmp_path / "results").mkdir()
    shutil.copy(tmp_path / "page.json", tmp_path / "results" / "page.json")
    assert page_mismatches(page, tmp_path) == []


def test_a_results_file_reads_back_into_the_rows_it_printed():
    source = ResultsFile.load(DOCS / "results" / "main-job.json")
    keys = {"policy": "policy", "B": "budget", "loss ratio": "loss_ratio", "low-entropy damage": "damage"}
    rows = numeric_rows(source, keys, {"interval": 32})
    sl = next(row for row in rows if row["policy"] == "foresight-sl")
    assert sl["budget"] == 128 and sl["interval"] == 32
    assert (sl["loss_ratio"], sl["loss_ratio_low"], sl["loss_ratio_high"]) == (1.1995, 1.0749, 1.2974)
    assert (sl["damage"], sl["damage_low"], sl["damage_high"]) == pytest.approx((0.0124, 0.0035, 0.0196), rel=1e-12)
    unseen = numeric_rows(ResultsFile.load(DOCS / "results" / "unseen-a.json"), {"loss ratio, it − gap-s600": "gain"})
    assert [row["gain"] for row in unseen][14:16] == [None, None]  # random-prompt, triattention: "other tokens"
