"""scripts/state_gate.py's gate on recordings made by hand: one-sided on the loss ratio of generated tokens, the
identity of kept sets reported and not gated."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("state_gate", ROOT / "scripts" / "state_gate.py")
state_gate = importlib.util.module_from_spec(spec)
sys.modules["state_gate"] = state_gate  # its dataclass resolves its module by name
spec.loader.exec_module(state_gate)

LENGTH, PROMPT, FIRST, TRACES = 40, 12, 8, 12


def recording(shift: torch.Tensor, kept_offset: int = 0) -> dict:
    """Twelve one-row batches whose evicted NLL is the full cache's plus `shift[trace]` on every token, one step
    each (held positions [layers 1, rows 1, Hkv 2, N 4], moved by `kept_offset` on the second head)."""
    batches = []
    for trace in range(TRACES):
        full = torch.full((LENGTH - 1,), 1.0) + 0.1 * trace
        kept = torch.tensor([[[[0, 1, 2, 3], [0, 1, 2, 3 + kept_offset]]]], dtype=torch.int32)
        batches.append(
            {
                "lengths": [LENGTH],
                "sources": [f"tiny#{trace}"],
                "steps": [kept],
                "nll": [full + shift[trace]],
                "full": [full],
                "first": [FIRST],
                "prompts": [PROMPT],
            }
        )
    return {"options": {}, "batch_size": 1, "batches": batches}


def test_the_gate_is_one_sided_on_generated_tokens_and_reports_identity():
    base = recording(torch.zeros(TRACES))
    lower = state_gate.gate(base, recording(torch.full((TRACES,), -0.05), kept_offset=4))
    assert lower.passed and lower.delta < 0 and lower.identity == 0.5  # better loss, half the sets changed: passes
    small = state_gate.gate(base, recording(torch.linspace(0.0, 0.002, TRACES)))
    assert small.passed and small.high <= state_gate.LOSS_GATE and small.identity == 1.0
    worse = state_gate.gate(base, recording(torch.full((TRACES,), 0.01)))
    assert not worse.passed and worse.low > state_gate.LOSS_GATE
    # generated tokens only: a shift on the prompt's predictions (before P - 1) leaves the figures unchanged
    prompt_only = recording(torch.zeros(TRACES))
    for batch in prompt_only["batches"]:
        batch["nll"][0][: PROMPT - 1] += 1.0
    assert state_gate.gate(base, prompt_only).delta == 0.0
    scored = (LENGTH - 1) - (PROMPT - 1)  # predictions P - 1 .. T - 2, each +0.01
    full = sum((1 + 0.1 * trace) * scored for trace in range(TRACES))
    assert worse.new_ratio == pytest.approx(1 + 0.01 * TRACES * scored / full) and worse.old_ratio == 1.0


def test_a_recording_without_prompt_lengths_is_refused():
    old = recording(torch.zeros(TRACES))
    for batch in old["batches"]:
        del batch["prompts"]
    with pytest.raises(ValueError, match="a recording made before 0.11.0 holds no prompt lengths"):
        state_gate.gate(old, old)


def test_pooled_sets_are_gated_as_one_set_of_their_traces():
    """Two trace sets whose sources coincide pool into one paired interval over all 24 traces, each set's traces kept
    apart; the pooled change is the token-weighted change of the two."""
    base = recording(torch.zeros(TRACES))
    first, second = recording(torch.full((TRACES,), 0.01)), recording(torch.full((TRACES,), -0.01))
    pooled = state_gate.gate(state_gate._pooled([base, base]), state_gate._pooled([first, second]))
    assert pooled.sets == 2 * state_gate.gate(base, first).sets
    assert pooled.delta == pytest.approx(0.0, abs=1e-12) and pooled.low < 0 < pooled.high
