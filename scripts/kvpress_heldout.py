"""The learned kvpress press against our engine on held-out traces (docs/kvpress.md): for each trace of a folder,
the mean teacher-forced loss of its completion under `ForesightPress` (one token a forward) and under the
engine's replay, their relative gap and the largest per-token gap. Run in the kvpress environment:

    .venv-kvpress/bin/python scripts/kvpress_heldout.py [TRACES [SCORER [MAX_TRACES]]]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from foresight.data.trace_store import TraceStore  # noqa: E402
from foresight.models import load_model  # noqa: E402
from foresight.policies.foresight import Foresight  # noqa: E402
from foresight.runtime.engine import EvictionConfig, EvictionEngine  # noqa: E402
from tests.kvpress_env import teacher_forced  # noqa: E402 (imports kvpress, the suite's attention functions kept)


def main(traces: str = "data/corpus/gsm-heldout", scorer: str = "checkpoints/default", most: str = "34") -> None:
    from foresight.integrations.kvpress_press import ForesightPress  # after kvpress, as tests.kvpress_env imports it

    torch.set_num_threads(1)
    model, _ = load_model("default")
    press = ForesightPress(scorer)
    config = press.scorer.config
    engine = EvictionEngine(model, Foresight(scorer=press.scorer), EvictionConfig(config.budget, config.interval))
    for trace in list(TraceStore(traces))[: int(most)]:
        start = trace.prompt_length - 1
        ours = engine.replay([trace.input_ids], [trace.prompt_length]).nll[0][start:]
        theirs = teacher_forced(model, press, trace.input_ids, trace.prompt_length)[start:]
        gap = ((theirs.mean() - ours.mean()) / ours.mean()).item()
        print(
            f"trace {trace.index} prompt {trace.prompt_length} tokens {len(trace.input_ids)} "
            f"engine {ours.mean().item():.7f} press {theirs.mean().item():.7f} rel {gap:+.3e} "
            f"max_token_abs {(theirs - ours).abs().max().item():.3e}",
            flush=True,
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
