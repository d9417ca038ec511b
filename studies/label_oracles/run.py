"""Is a label kind a better target than α? Its oracle (golden replaying the kind's schedule, `foresight eval
--label-kind KIND --policies golden`) against α-golden on the same traces, paired over traces
(docs/notes/loss-aligned-labels.md).

    python -m studies label-oracles --run alpha=runs/eval-a-alpha --run value=runs/eval-a-value

The first run is the reference (α); every row is pooled over the traces all folders scored, and gives the kind's
golden loss ratio, low-entropy damage and flip rate with 95% bootstrap intervals over traces, and its loss ratio
minus the reference's, paired (negative: the kind's oracle loses less).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from foresight.bench.common import ReportSettings
from foresight.eval.headroom import TraceScore, paired_gain, pooled_figure
from studies import COMMAND as COMMAND  # how its report names it, where it goes
from studies import REPORTS as REPORTS

NAME = "label-oracles"


@dataclass(frozen=True, kw_only=True)
class Settings(ReportSettings):
    run: tuple[str, ...] = field(
        metadata={
            "help": "a label kind and the `foresight eval --label-kind KIND` folder of its golden rows (repeat; the "
            "first is the reference)",
            "metavar": "KIND=DIR",
        }
    )

    def __post_init__(self) -> None:
        malformed = [text for text in self.run if "=" not in text]
        if malformed:
            raise ValueError(f"--run takes KIND=DIR, got {malformed[0]!r}")


def golden_scores(kind: str, folder: Path) -> list[TraceScore]:
    """The golden rows' trace scores of one evaluation folder, named golden-KIND."""
    entries = json.loads((folder / "traces.json").read_text())
    return [replace(TraceScore(**entry), policy=f"golden-{kind}") for entry in entries if entry["policy"] == "golden"]


def run(settings: Settings) -> str:
    runs = [text.split("=", 1) for text in settings.run]
    lines = [f"Command: `{settings.command}`", ""]
    scores = [score for kind, folder in runs for score in golden_scores(kind, Path(folder))]
    common = set.intersection(*({s.index for s in scores if s.policy == f"golden-{kind}"} for kind, _ in runs))
    scores = [score for score in scores if score.index in common]  # every row on the same traces
    budget = scores[0].budget
    reference = f"golden-{runs[0][0]}"
    lines.append(
        f"| oracle | traces | loss ratio | low-entropy damage | flip rate | loss ratio − {reference} (paired) |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|")
    for kind, _ in runs:
        name = f"golden-{kind}"
        count = sum(score.policy == name for score in scores)
        ratio, damage, flips = (
            pooled_figure(scores, budget, name, figure)
            for figure in ("loss_ratio", "low_entropy_damage", "low_entropy_flip_rate")
        )
        gain = paired_gain(scores, budget, reference, name)
        difference = "–" if name == reference else f"{-gain.value:+.4f} [{-gain.high:+.4f}, {-gain.low:+.4f}]"
        lines.append(
            f"| {name} | {count} | {ratio} | {damage.value:.2%} [{damage.low:.2%}, {damage.high:.2%}] | "
            f"{flips.value:.2%} [{flips.low:.2%}, {flips.high:.2%}] | {difference} |"
        )

    return "\n".join(lines)
