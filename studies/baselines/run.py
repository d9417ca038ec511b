"""A learned scorer against every other policy on several trace sets and budgets, and loss ratio against KV memory.

Combines `foresight eval` folders, running no model: per set and budget, every policy's pooled loss ratio
and low-entropy damage with 95% bootstrap intervals over traces, its KV memory, and the learned scorer's
paired gain over it; one PNG per set in --plot-dir (`studies.baselines.report` states the rules).

    python -m studies baselines --set 'unseen A=runs/eval-a,runs/eval-a-256' --learned shipped --budgets 128,256
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from foresight.bench.common import RUNS, ReportSettings, budgets_field, trace_sets, trace_sets_field
from studies import COMMAND as COMMAND  # how its report names it, where it goes
from studies import REPORTS as REPORTS
from studies.baselines.report import baselines_report

NAME = "baselines"


@dataclass(frozen=True, kw_only=True)
class Settings(ReportSettings):
    sets: tuple[str, ...] = trace_sets_field()
    learned: tuple[str, ...] = field(
        metadata={
            "help": "the learned scorer's row name in those folders; repeat for sets that name it otherwise (a set's "
            "learned row is the first of these it holds)",
            "metavar": "ROW",
        }
    )
    budgets: tuple[int, ...] = budgets_field((128, 256))
    plot_dir: Path = field(default=RUNS, metadata={"help": "folder of the PNGs, one per set"})

    def __post_init__(self) -> None:
        trace_sets(self.sets)  # malformed texts: refused here


def run(settings: Settings) -> str:
    report = baselines_report(trace_sets(settings.sets), settings.learned, settings.budgets, settings.plot_dir)
    return f"Command: `{settings.command}`\n\n{report}"
