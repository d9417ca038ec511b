"""Bring your own model, last link: a scorer fitted on another architecture's traces runs under the kvpress
press and keeps the engine's positions at every decoding step (docs/kvpress.md, "Bring your own model").

Run in the kvpress environment (scripts/crosscheck.sh makes .venv-kvpress), from the repository root:

    .venv-kvpress/bin/python scripts/kvpress_byom.py --model runs/tiny-qwen3 \
        --scorer runs/tiny-qwen3-fit/scorer --traces runs/tiny-qwen3-traces --count 3

Each trace's prompt (cut below B + L, so the first step comes while decoding) is decoded greedily by the engine
for 8 steps; the same tokens are fed to the model under the press one at a time, and every (step, layer, KV
head) kept set is compared.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from foresight.data.trace_store import TraceStore  # noqa: E402
from foresight.integrations.kvpress_press import ForesightPress  # noqa: E402
from foresight.policies.foresight import Foresight  # noqa: E402
from foresight.runtime.engine import EvictionConfig, EvictionEngine  # noqa: E402
from foresight.scorer.model import load_scorer  # noqa: E402
from tests.kvpress_env import held_positions, teacher_forced  # noqa: E402  (the cross-check's own helpers)

STEPS = 8


def kept_sets(model, scorer, ids: torch.Tensor, prompt_length: int) -> tuple[list, list]:
    """The engine's and the press's kept positions [step][layer][head] on one prompt and its greedy tokens."""
    budget, interval = scorer.config.budget, scorer.config.interval
    engine = EvictionEngine(model, Foresight(scorer=scorer), EvictionConfig(budget, interval))
    ours: list = []

    def on_token(_: int) -> None:
        if engine.last_stats.evictions > len(ours):
            ours.append(held_positions(engine.last_cache))

    output = engine.generate([ids[:prompt_length].tolist()], STEPS * interval + 1, on_token=on_token)
    sequence = torch.cat([ids[:prompt_length], torch.tensor(output.tokens[0])])
    press, theirs = ForesightPress(scorer=scorer), []

    def after_step(_: DynamicCache) -> None:
        layers = [press.base_press.entries(layer) for layer in range(scorer.config.num_layers)]
        theirs.append([[sorted(head) for head in layer.positions[0].tolist()] for layer in layers])

    teacher_forced(model, press, sequence, prompt_length, after_step)
    return ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the model's folder")
    parser.add_argument("--scorer", required=True, help="a scorer folder or Hub id fitted for that model")
    parser.add_argument("--traces", required=True, help="a traces folder of that model")
    parser.add_argument("--count", type=int, default=3, help="traces to check (default 3)")
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    scorer = load_scorer(args.scorer)
    window = scorer.config.budget + scorer.config.interval
    same = total = 0
    for trace in list(TraceStore(args.traces))[: args.count]:
        ours, theirs = kept_sets(model, scorer, trace.input_ids, min(trace.prompt_length, window - 1))
        if len(ours) != len(theirs):
            raise SystemExit(f"trace {trace.index}: the engine made {len(ours)} steps, the press {len(theirs)}")
        pairs = [(a, b) for step, other in zip(ours, theirs) for la, lb in zip(step, other) for a, b in zip(la, lb)]
        same += sum(a == b for a, b in pairs)
        total += len(pairs)
        print(f"trace {trace.index}: {len(ours)} steps, {sum(a == b for a, b in pairs)} of {len(pairs)} sets identical")
    print(f"kept (step, layer, KV head) sets identical: {same} of {total}")


if __name__ == "__main__":
    main()
