"""scripts/gpu-acceptance.sh: every step it lists names a test, benchmark flag and config that exist; a step
that fails or runs past its cap ends alone; the CPU dry run writes a report of every step (slow, run by CI)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from foresight.cli import build_parser
from foresight.commands._grammar import settings_from

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_acceptance", ROOT / "scripts" / "gpu_acceptance.py")
acceptance = importlib.util.module_from_spec(spec)
sys.modules["gpu_acceptance"] = acceptance  # dataclasses resolve their module's annotations by name
spec.loader.exec_module(acceptance)

STATUSES = (
    "passed",
    "failed (rc ",
    "timed out after ",
    "skipped: no CUDA",
    "skipped: out of time",
    "skipped: prepare did not pass",
)


def contexts(tmp_path: Path) -> list:
    return [
        acceptance.Context(acceptance.CUDA_SCALE, False, tmp_path / "out", tmp_path / "work"),
        acceptance.Context(acceptance.DRY_SCALE, True, tmp_path / "out", tmp_path / "work"),
    ]


def commands(step, context) -> list[list[str]]:
    return [step.command(context)] + ([step.dry_command(context)] if step.dry_command else [])


def test_every_step_names_tests_benchmarks_and_configs_that_exist(tmp_path):
    test_modules = {}
    for context in contexts(tmp_path):
        for step in acceptance.STEPS:
            for command in commands(step, context):
                for word in command:
                    if "::" in word:  # a pytest node id: its module defines the test
                        path, name = word.split("::")
                        module = test_modules.setdefault(path, (ROOT / path).read_text())
                        assert f"def {name}(" in module, word
                    elif word.startswith("configs/"):
                        assert (ROOT / word).is_file(), word
                if "foresight.cli" in command:  # a benchmark: its flags parse into its settings (on this machine's CPU)
                    argv = ["cpu" if word == "cuda" else word for word in command[command.index("foresight.cli") + 1 :]]
                    args = build_parser().parse_args(argv)
                    assert args.benchmark.NAME == argv[1]
                    settings_from(args.benchmark.Settings, args)
                if "--step" in command:
                    assert command[command.index("--step") + 1] in acceptance.FIGURE_STEPS
    for path in (acceptance.SAMPLER_MODEL, acceptance.WORK_MODEL, acceptance.CAPACITY_MODEL):
        assert (ROOT / path).is_file(), path


def test_a_failed_or_slow_step_ends_alone_and_the_deadline_skips_the_rest(tmp_path, monkeypatch):
    python = sys.executable
    steps = (
        acceptance.Step("fails", "exits 3", 30, lambda c: [python, "-c", "import sys; sys.exit(3)"]),
        acceptance.Step("counts", "prints figures", 30, lambda c: [python, "-c", "print('FIGURES {\"rate\": 2.5}')"]),
        acceptance.Step("slow", "sleeps past its cap", 1.5, lambda c: [python, "-c", "import time; time.sleep(30)"]),
        acceptance.Step("late", "starts with too little of the deadline left", 30, lambda c: [python, "-c", "pass"]),
    )
    monkeypatch.setattr(acceptance, "STEPS", steps)
    context = acceptance.Context(acceptance.DRY_SCALE, True, tmp_path / "out", tmp_path / "work")
    record = acceptance.run_all(context, total_seconds=acceptance.LEAST_STEP_SECONDS + 1.0)
    statuses = {step["name"]: step["status"] for step in record["steps"]}
    assert statuses["fails"] == "failed (rc 3)"
    assert statuses["counts"] == "passed" and record["steps"][1]["figures"] == {"rate": 2.5}
    assert statuses["slow"] == "timed out after 2 s" and 1.4 < record["steps"][2]["seconds"] < 5
    assert statuses["late"] == "skipped: out of time"
    assert json.loads((tmp_path / "out" / "acceptance.json").read_text()) == record
    rows = [line for line in (tmp_path / "out" / "acceptance.md").read_text().splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0].strip("| ") for row in rows[1:5]] == [step.name for step in steps]


def test_the_imports_step_records_each_optional_package_as_its_version_or_absent(monkeypatch):
    """flash-attn, FlashInfer, Triton and vLLM are recorded whether or not they are installed: an installed one by
    the version of the distribution it ships as (the first that is installed), a missing one as absent."""
    from importlib.metadata import version

    assert set(acceptance.OPTIONAL_PACKAGES) == {"flash_attn", "flashinfer", "triton", "vllm"}
    monkeypatch.setattr(
        acceptance,
        "OPTIONAL_PACKAGES",
        {"pytest": ("not-a-distribution-xyz", "pytest"), "not_a_module_xyz": ("pytest",), "json": ("nope-xyz",)},
    )
    assert acceptance.optional_packages() == {
        "pytest": version("pytest"),
        "not_a_module_xyz": "absent",
        "json": "present (version unknown)",
    }


@pytest.mark.slow
def test_cpu_dry_run_reports_every_step(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "gpu-acceptance.sh"),
            "--cpu-dry-run",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
        ],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((out / "acceptance.json").read_text())
    assert record["mode"] == "cpu-dry-run" and record["versions"]["torch"]
    assert set(record["optional"]) == set(acceptance.OPTIONAL_PACKAGES)
    steps = {step["name"]: step for step in record["steps"]}
    assert list(steps) == [step.name for step in acceptance.STEPS]
    for step in acceptance.STEPS:
        outcome = steps[step.name]
        expected = "skipped: no CUDA" if step.gpu_only else "passed"
        assert outcome["status"].startswith(expected), (step.name, outcome["status"], outcome["output_tail"])
        assert outcome["seconds"] > 0
    assert steps["gpu-tests"]["figures"]["collected"] > 50
    assert (
        steps["sampler"]["figures"]["tokens"] == acceptance.DRY_SCALE.sampler_rows * acceptance.DRY_SCALE.sampler_tokens
    )
    sampler = steps["sampler"]["figures"]
    assert sampler["admission_forwards"] == 1 and 0 < sampler["admission_seconds"] + sampler["decode_seconds"]
    assert sampler["admission_seconds"] + sampler["decode_seconds"] <= sampler["seconds"]
    assert steps["fit"]["figures"]["steps_per_second"] > 0 and steps["rl"]["figures"]["rollouts_per_second"] > 0
    assert "| rl rollouts now |" in steps["pipeline"]["figures"]["section"]
    report = (out / "acceptance.md").read_text()
    for step in acceptance.STEPS:
        assert f"| {step.name} | {step.what} | {steps[step.name]['status']} |" in report
