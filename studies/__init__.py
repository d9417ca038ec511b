"""The project's research studies: measurements that inform its choices, kept out of the installed package.

Each study is a folder: `run.py` (its NAME, its `Settings` and `run(settings) -> str`, as a benchmark of
`foresight bench` declares them), `spec.yaml` (the options of its published run) and, where the tables are
more than a few lines, `report.py`. `python -m studies NAME` runs the spec; options on the command line
replace it (studies/README.md).
"""

from pathlib import Path

COMMAND = "python -m studies"
"""How a study's report writes the command that reproduces it."""
REPORTS = Path("runs/studies")
"""Where a study's report goes without --out."""
