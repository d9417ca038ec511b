"""The `foresight` verbs of the runtime: listings, one-line errors, and runs on the default model."""

from __future__ import annotations

import pytest

from foresight.cli import main
from foresight.policies import POLICIES


def test_policies_lists_every_constructible_policy_with_needs(capsys):
    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = {line.split()[0]: line for line in lines[1:]}
    assert set(listed) == set(POLICIES)
    assert "block attention" in listed["snapkv"] and "nothing" in listed["knorm"]
    assert "sinks=4" in listed["streaming"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "--policy", "h3o", "hi"], "unknown policy 'h3o'"),
        (["generate", "--budget", "32", "--interval", "32", "hi"], "budget B=32 must be larger than the interval L=32"),
        (["generate", "--interval", "0", "hi"], "interval L=0 must be at least 1"),
        (["generate", "--model", "no/such-model-anywhere", "hi"], "no/such-model-anywhere"),
        (["generate", "-o", "seed", "--policy", "random", "hi"], "KEY=VALUE"),
        (["replay", "/no/such/file.txt"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_with_exit_status_2(capsys, monkeypatch, argv, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and "\n" not in error


@pytest.mark.slow
def test_generate_on_the_default_model_holds_the_budget(capsys):
    assert main(["generate", "--policy", "snapkv", "-B", "32", "-L", "8", "--max-new-tokens", "48", "What is 17 * 23?"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    held = int(last.split("largest cache held ")[1].split()[0])
    assert held <= 32 + 8 and "tokens/s" in last


@pytest.mark.slow
def test_short_generation_says_it_did_not_evict(capsys):
    assert main(["generate", "--policy", "h2o", "-B", "512", "-L", "32", "--max-new-tokens", "4", "Hi"]) == 0
    assert "no eviction" in capsys.readouterr().out


@pytest.mark.slow
def test_replay_reports_a_loss_ratio_against_the_full_cache(tmp_path, capsys):
    text = tmp_path / "doc.txt"
    text.write_text(" ".join(f"Step {i}: add {i} to the running total and write the new total down." for i in range(12)))
    assert main(["replay", "--policy", "streaming", "-B", "32", "-L", "8", str(text)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    ratio = float(last.split("loss ratio ")[1].split()[0])
    assert ratio > 1.0  # dropping most of a structured context must cost something
