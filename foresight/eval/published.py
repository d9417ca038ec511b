"""Results files: the small JSON beside a docs page that each of its tables is copied from, recording the
command, commit and device that made it (or, for a run that cannot be made again here, where it was
transcribed from). A page cites a file by a link on the line before the table, so a reader finds the
source of every figure and `page_mismatches` finds a page that drifted from its files."""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from foresight.artifacts import write_text

RESULTS_LINK = re.compile(r"\]\(((?:docs/|\.\./)?results/[\w.-]+\.json)\)")
"""A link to a results file, relative to the page (docs/benchmarks.md, a note under docs/notes/) or the repository
(README.md)."""


@dataclass
class ResultsFile:
    """One table of a page: its cells as the page prints them, and how they were made."""

    title: str
    command: str
    device: str
    commit: str | None
    columns: list[str]
    rows: list[list[str]]
    traces: dict[str, int] = field(default_factory=dict)  # per trace set: how many traces the table scored
    transcribed: bool = False  # copied from an older run that cannot be rerun here
    source: str | None = None  # where a transcribed table was copied from
    figures: dict[str, dict[str, str]] = field(default_factory=dict)  # per page name: figures quoted in prose

    def save(self, path: str | Path) -> Path:
        """Write the file as JSON with one line per key and per row, so a diff shows the rows that moved."""
        fields = [f" {json.dumps(key)}: {_json(value)}" for key, value in asdict(self).items() if key != "rows"]
        rows = ",\n".join(f"  {_json(row)}" for row in self.rows)
        write_text(Path(path), "{\n" + ",\n".join(fields) + f',\n "rows": [\n{rows}\n ]\n}}\n')
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> ResultsFile:
        return cls(**json.loads(Path(path).read_text()))


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def this_run(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> ResultsFile:
    """A results file of the command now running: its argv, the checkout's commit (None outside git) and
    the machine it runs on."""
    return ResultsFile(
        title=title,
        command=shlex.join([*_program(sys.argv[0]), *sys.argv[1:]]),
        device=machine(),
        commit=_commit(),
        columns=list(columns),
        rows=[list(row) for row in rows],
    )


def _program(path: str) -> list[str]:
    """How the running command was started: `foresight`, `python -m PACKAGE` or `python SCRIPT`."""
    if Path(path).name == "__main__.py":
        return ["python", "-m", Path(path).parent.name]
    return [Path(path).name] if Path(path).name == "foresight" else ["python", path]


def machine() -> str:
    """The machine in words: its GPU where one is visible, else its CPU cores and torch's threads."""
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    cpu = platform.processor() or platform.machine()
    return f"{os.cpu_count()}-core {cpu} CPU, {torch.get_num_threads()} torch threads"


def _commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        )
    except OSError:
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def table_cells(line: str) -> list[str]:
    """The cells of one markdown table row."""
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def cited_tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """Every (results file link, header, rows) of a page: a line citing a file binds the table that starts
    on its next non-blank line; a citation in prose binds none (header and rows empty: its figures alone)."""
    lines = text.splitlines()
    tables = []
    for index, line in enumerate(lines):
        for link in RESULTS_LINK.findall(line):
            start = next((i for i in range(index + 1, len(lines)) if lines[i].strip()), len(lines))
            end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
            rows = [table_cells(row) for row in lines[start:end]]
            tables.append((link, rows[0] if rows else [], rows[2:]))
    return tables


def page_mismatches(page: Path, docs: Path) -> list[str]:
    """Where `page` and the results files it cites (under `docs`, e.g. docs/results/) disagree: a table's
    header or a cell, a row too many or too few, a figure quoted in prose that the page does not hold."""
    text, problems = page.read_text(), []
    prose = " ".join(text.split())  # a figure quoted in prose may wrap
    for link, header, rows in cited_tables(text):
        source = ResultsFile.load(results_path(docs, link))
        where = f"{page.name}, {'the table from' if header else 'citing'} {link}"  # no header: cited in prose
        if header and header != source.columns:
            problems.append(f"{where}: header {header} != {source.columns}")
        if header and len(rows) != len(source.rows):
            problems.append(f"{where}: {len(rows)} rows, the file has {len(source.rows)}")
        for row, expected in zip(rows, source.rows):
            if len(row) != len(expected):
                problems.append(f"{where}: row {expected[0]!r} has {len(row)} cells, the file {len(expected)}")
            for column, cell, want in zip(source.columns, row, expected):
                if cell != want:
                    problems.append(f"{where}: row {expected[0]!r}, {column!r} reads {cell!r}, the file {want!r}")
        problems += [
            f"{where}: the figure {name!r} ({value}) is not on the page"
            for name, value in source.figures.get(page.name, {}).items()
            if " ".join(value.split()) not in prose
        ]
    return problems


def cited_files(pages: Sequence[Path], docs: Path) -> set[Path]:
    """The results files `pages` cite."""
    return {results_path(docs, link) for page in pages for link, _, _ in cited_tables(page.read_text())}


def results_path(docs: Path, link: str) -> Path:
    """The file a results link names, whichever folder the page citing it is in."""
    return docs / link.removeprefix("docs/").removeprefix("../")
