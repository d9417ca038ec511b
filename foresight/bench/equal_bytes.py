"""The learned scorer's headroom at equal bytes held, beside equal entries, every budget on the same tokens.

Combines `foresight eval` folders of one trace set, running no model (`foresight.eval.equal_bytes` states the
rules): each heuristic's budget sweep scored on the tokens after the largest budget's first eviction,
its loss ratio interpolated at the bytes the learned scorer holds (eval's KV MiB, from
`foresight.runtime.held_memory`), and the share of the headroom over golden captured there.

    foresight bench equal-bytes --set 'unseen A=runs/eval-a-128,runs/eval-a-sweep' --learned default -B 128 \\
        --heuristics snapkv,tova
"""

from __future__ import annotations

from dataclasses import dataclass, field

from foresight.bench.common import ReportSettings, budget_field, trace_sets, trace_sets_field
from foresight.eval.equal_bytes import equal_bytes, held_by_row, merged_token_losses

NAME = "equal-bytes"


@dataclass(frozen=True, kw_only=True)
class Settings(ReportSettings):
    sets: tuple[str, ...] = trace_sets_field()
    learned: str = field(metadata={"help": "the learned scorer's row name in those folders", "metavar": "ROW"})
    budget: int = budget_field()
    heuristics: str = field(
        metadata={"help": "the heuristics compared, comma-separated, each with its budget sweep in the folders"}
    )

    def __post_init__(self) -> None:
        trace_sets(self.sets)  # malformed texts: refused here


def run(settings: Settings) -> str:
    parts = [f"Command: `{settings.command}`"]
    for name, folders in trace_sets(settings.sets):
        losses, reference = merged_token_losses(folders)
        result = equal_bytes(
            losses, reference, held_by_row(folders), settings.learned, settings.budget, settings.heuristics.split(",")
        )
        if result is None:
            raise ValueError(f"set {name}: no trace was scored by every compared row; evaluate them on the same traces")
        parts.append(f"**{name}**\n\n{result.markdown()}")
    return "\n\n".join(parts) + "\n"
