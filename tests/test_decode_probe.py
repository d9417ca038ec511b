"""scripts/decode_probe.py: every runtime policy it times evicts every row at least three times, each row's
count is what the cadence gives, and a run that evicts less is refused rather than reported."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("decode_probe", ROOT / "scripts" / "decode_probe.py")
probe = importlib.util.module_from_spec(spec)
sys.modules["decode_probe"] = probe  # dataclasses resolve their module's annotations by name
spec.loader.exec_module(probe)


def expected_evictions() -> int:
    """The cadence written plainly: one row fed the prompt and NEW_TOKENS - 1 decoded tokens evicts each time it
    holds B + L entries, which brings it back to B."""
    held, evictions = 0, 0
    for _ in range(probe.PROMPT_TOKENS + probe.NEW_TOKENS - 1):
        held += 1
        if held == probe.BUDGET + probe.INTERVAL:
            held, evictions = probe.BUDGET, evictions + 1
    return evictions


@pytest.mark.parametrize("policy", [name for name in probe.RUNTIME_POLICIES if name != "full"])
def test_every_row_of_every_evicting_policy_evicts_at_least_three_times(llama, policy):
    assert probe.NEW_TOKENS + probe.PROMPT_TOKENS > probe.BUDGET + probe.INTERVAL * probe.LEAST_EVICTIONS
    engine = probe.runtime_engine(llama, policy)
    row = probe.runtime_run(engine, probe.runtime_prompt(llama.config.vocab_size), rows=3)
    assert row.row_evictions == [expected_evictions()] * 3 and expected_evictions() >= probe.LEAST_EVICTIONS
    assert row.eviction_steps == expected_evictions() and 0 < row.eviction_share < 1
    assert row.steps == probe.NEW_TOKENS - 1
    assert f"evictions per row {expected_evictions()}-{expected_evictions()}" in row.line()


def test_a_run_that_evicts_too_rarely_is_refused(llama, monkeypatch):
    monkeypatch.setattr(probe, "NEW_TOKENS", probe.INTERVAL + 2)  # 128 + 33 fed: one eviction step
    engine = probe.runtime_engine(llama, "snapkv")
    with pytest.raises(AssertionError, match="a row evicted 1 times, not 3"):
        probe.runtime_run(engine, probe.runtime_prompt(llama.config.vocab_size), rows=2)
