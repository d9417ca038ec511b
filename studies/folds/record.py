"""The fold study's record: every held-out trace score it has made, kept beside the study in the repository.

A fold study runs for days on a 2-core CPU, and its machines do not outlive a working session, so its fits and
evaluations (under --work) cannot be what it resumes from. The record keeps the only thing the report reads, the
trace scores, one small file per (regime, fold): a fold whose every policy has a row for each held-out family is
never fitted or replayed again, on any machine. Each file names the study it belongs to (corpus, folds, seed,
sample, fit config) and the overrides each variant's rows were made with, so rows of another study or of a
changed variant are refused in one line instead of mixed in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

from foresight.artifacts import check_settings, write_text
from foresight.eval.headroom import TraceScore

KEPT_TOKEN_SETS = ("generated", "all")
"""The scored predictions the fold table reads; the prompt's are all − generated."""
COLUMNS = tuple(field.name for field in dataclasses.fields(TraceScore))


def content_digest(path: Path) -> str:
    """The sha256 (first 16 hex digits) of a JSON or YAML file's content, comments and layout aside: what names a
    corpus manifest or a fit config in the record, so editing a comment does not orphan a study."""
    content = json.dumps(yaml.safe_load(path.read_text()), sort_keys=True)
    return hashlib.sha256(content.encode()).hexdigest()[:16]


class FoldRecord:
    """The trace scores of one fold study, one file per (regime, fold) under `folder`; a fold's file is written by
    the one process working on that fold (`--fold`)."""

    def __init__(self, folder: Path, study: Mapping[str, object], variants: Mapping[str, list[str]]) -> None:
        self.folder = folder
        self.study = dict(study)
        self.variants = {name: ";".join(overrides) for name, overrides in variants.items()}

    def scores(self, regime: str, fold: int) -> list[TraceScore]:
        """The recorded scores of one fold (empty when none), read again at every call, since processes working on
        other folds write theirs meanwhile; a file of another study or of a variant recorded with other overrides
        is refused in one line."""
        return self._read(self._path(regime, fold))

    def holds(self, regime: str, fold: int, policy: str, families: Iterable[str]) -> bool:
        """Whether `policy` has rows for every one of the fold's held-out families."""
        return set(families) <= {row.source for row in self.scores(regime, fold) if row.policy == policy}

    def add(self, regime: str, fold: int, scores: Iterable[TraceScore]) -> None:
        """Merge new scores into the fold's file (a policy's new rows replace its old ones) and write it at once."""
        new = [row for row in scores if row.token_set in KEPT_TOKEN_SETS]
        replaced = {row.policy for row in new}
        kept = [row for row in self.scores(regime, fold) if row.policy not in replaced]
        rows = sorted([*kept, *new], key=lambda row: (row.policy, row.index, row.token_set, row.budget))
        variants = {name: text for name, text in self.variants.items() if name in {row.policy for row in rows}}
        lines = ",\n".join(json.dumps([getattr(row, column) for column in COLUMNS]) for row in rows)
        header = {"study": self.study, "variants": variants, "columns": list(COLUMNS)}
        write_text(self._path(regime, fold), json.dumps(header)[:-1] + f', "rows": [\n{lines}\n]}}\n')

    def _path(self, regime: str, fold: int) -> Path:
        return self.folder / f"{regime}-fold-{fold}.json"

    def _read(self, path: Path) -> list[TraceScore]:
        if not path.is_file():
            return []
        stored = json.loads(path.read_text())
        check_settings(str(path), stored["study"], self.study, "give --record another folder, or move it away")
        for name, overrides in stored["variants"].items():
            if name in self.variants and self.variants[name] != overrides:
                raise ValueError(
                    f"{path} records variant {name!r} as {overrides!r}, not {self.variants[name]!r}: name the "
                    "changed variant anew, or remove its rows from the record"
                )
        return [TraceScore(**dict(zip(stored["columns"], row, strict=True))) for row in stored["rows"]]
