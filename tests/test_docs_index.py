"""docs/notes/README.md indexes every study in docs/notes/, and every link it holds leads to one."""

from __future__ import annotations

import re
from pathlib import Path

NOTES = Path(__file__).resolve().parents[1] / "docs" / "notes"


def indexed_and_present() -> tuple[set[str], set[str]]:
    linked = set(re.findall(r"\]\(([^)#]+\.md)\)", (NOTES / "README.md").read_text()))
    present = {path.name for path in NOTES.glob("*.md")} - {"README.md"}
    return linked, present


def test_every_note_is_listed_in_the_index():
    linked, present = indexed_and_present()
    assert sorted(present - linked) == []


def test_every_link_of_the_index_leads_to_a_note():
    linked, present = indexed_and_present()
    assert sorted(linked - present) == []
