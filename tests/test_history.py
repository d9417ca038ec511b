"""The history and the changelog follow CONTRIBUTING.md: short commit subjects, a changelog at the version."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_SUBJECT = 72


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def long_subjects(subjects: list[str]) -> list[str]:
    return [subject for subject in subjects if len(subject.encode()) > MAX_SUBJECT]  # bytes, as git tools count


def project_version() -> str:
    return re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)[1]


def newest_changelog_version() -> str:
    return re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)[1]


def test_the_check_flags_a_subject_one_character_too_long():
    assert long_subjects(["a" * MAX_SUBJECT, "b" * (MAX_SUBJECT + 1)]) == ["b" * (MAX_SUBJECT + 1)]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_commit_subjects_since_the_contributing_rules_fit_72_characters():
    added = git("log", "--diff-filter=A", "--format=%H", "--", "CONTRIBUTING.md").split()
    if not added:
        pytest.skip("CONTRIBUTING.md is not committed yet (or the clone is too shallow to see it)")
    subjects = git("log", "--format=%s", f"{added[-1]}^..HEAD").splitlines()
    assert long_subjects(subjects) == []


def test_the_newest_changelog_heading_is_the_project_version():
    assert newest_changelog_version() == project_version()
