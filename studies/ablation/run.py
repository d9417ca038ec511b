"""Several learned scorers against the same heuristics and golden, on several trace sets: an ablation table.

Combines `foresight eval` folders, running no model: per set and learned scorer, its loss ratio and
low-entropy damage, its share of the headroom between the best heuristic and golden, and its gains over
the best heuristic and over the table's first scorer, with paired 95% bootstrap intervals over traces
(`studies.ablation.report` states the rules).

    python -m studies ablation --set unseen-a=runs/eval-a,runs/eval-a-std --learned shipped="paper features" \\
        --learned std="standardised features" --budget 128
"""

from __future__ import annotations

from dataclasses import dataclass, field

from foresight.bench.common import ReportSettings, budget_field, named, trace_sets, trace_sets_field
from foresight.eval.metric_registry import TokenSet
from studies import COMMAND as COMMAND  # how its report names it, where it goes
from studies import REPORTS as REPORTS
from studies.ablation.report import ablation_report

NAME = "ablation"


@dataclass(frozen=True, kw_only=True)
class Settings(ReportSettings):
    sets: tuple[str, ...] = trace_sets_field()
    learned: tuple[str, ...] = field(
        metadata={
            "help": "a learned scorer's row name in those folders and what it is (repeat; table order)",
            "metavar": "ROW=WHAT",
        }
    )
    budget: int = budget_field()
    token_set: str = field(
        default=TokenSet.ALL.value,
        metadata={"help": "the scored predictions: all, or generated (the tokens a deployed model makes)"},
    )
    pool: str = field(
        default="",
        metadata={
            "help": "one more table with these sets' traces pooled as one set (paired intervals over all of them)",
            "metavar": "NAME,NAME,...",
        },
    )

    def __post_init__(self) -> None:
        trace_sets(self.sets), named(self.learned, "--learned", "ROW=WHAT")  # malformed texts: refused here
        TokenSet.parse(self.token_set)


def section(settings: Settings) -> str:
    return f"ablation-B{settings.budget}"


def run(settings: Settings) -> str:
    pooled = [name.strip() for name in settings.pool.split(",") if name.strip()]
    report = ablation_report(
        trace_sets(settings.sets),
        named(settings.learned, "--learned", "ROW=WHAT"),
        settings.budget,
        pooled,
        TokenSet.parse(settings.token_set),
    )
    return f"Command: `{settings.command}`\n\n{report}"
