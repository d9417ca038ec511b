"""Where a long evaluation keeps what it has done, so that a killed run resumes from it instead of starting over.

A run's folder holds `settings.json` (what every result in it was made with: a rerun with other settings is
refused, never mixed in) and one folder per (policy, budget) whose `policy.json` names the policy by what it
runs (for a learned scorer, the SHA-256 of its weights): a rerun under the same row name but another policy
is refused too. What each kind of run keeps inside those folders is its own (`CompletionStore`: sampled
completions; `ReplayStore`: teacher-forced replays).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from foresight.artifacts import check_settings, write_text
from foresight.eval.specs import PolicySpec, SampledScorerSpec
from foresight.runtime.engine import EvictionConfig
from foresight.scorer.model import weights_digest


def spec_identity(spec: PolicySpec) -> dict[str, Any]:
    """What makes a row's results: its name, the policy and settings of a row that has them, the weights of a
    learned scorer and, for a sampled one, its seeds and temperature."""
    identity: dict[str, Any] = {"policy": spec.name}
    scorer = getattr(spec, "scorer", None)
    if scorer is not None:
        identity["scorer_sha256"] = weights_digest(scorer)
    elif spec.policy:
        identity["runs"] = spec.policy_class.name
    if settings := spec.settings():
        identity["settings"] = {key: _option_identity(value) for key, value in settings.items()}
    if isinstance(spec, SampledScorerSpec):
        identity |= {"seeds": list(spec.seeds), "temperature": spec.temperature}
    return identity


def _option_identity(value: Any) -> Any:
    """An option as it identifies results: a folder by its absolute path, anything else as it is."""
    if isinstance(value, (str, os.PathLike)) and Path(value).exists():
        return str(Path(value).resolve())
    return value if isinstance(value, (bool, int, float, str)) else str(value)


class RunStore:
    """One run's folder: its settings checked on open, a folder per (policy, budget) checked on first use."""

    def __init__(self, folder: str | Path, settings: dict[str, Any]):
        self.folder = Path(folder)
        self._checked: dict[tuple[int, int | None, int | None], tuple[PolicySpec, Path]] = {}  # by id(spec)
        settings_file = self.folder / "settings.json"
        if settings_file.is_file():
            stored = json.loads(settings_file.read_text())
            check_settings(f"the results in {self.folder}", stored, settings, "give another --out or the same settings")
        else:
            write_text(settings_file, json.dumps(settings, indent=1))

    def policy_folder(self, spec: PolicySpec, eviction: EvictionConfig | None) -> Path:
        """The folder of `spec`'s results at `eviction`'s B and L (None: a policy that keeps everything); on first
        use it records the policy's identity, and another policy under the same name is refused. Checked once per
        spec object: a scorer's identity hashes its weights."""
        budget, interval = (None, None) if eviction is None else (eviction.budget, eviction.interval)
        key = (id(spec), budget, interval)
        if key in self._checked and self._checked[key][0] is spec:  # the spec held, so its id is not reused
            return self._checked[key][1]
        name = re.sub(r"[^\w.-]", "_", spec.name)
        folder = self.folder / name / ("" if budget is None else f"B{budget}-L{interval}")
        identity_file, identity = folder / "policy.json", spec_identity(spec)
        if identity_file.is_file():
            stored = json.loads(identity_file.read_text())
            check_settings(f"the results of {spec.name} in {folder}", stored, identity, "give another --out")
        else:
            write_text(identity_file, json.dumps(identity))
        self._checked[key] = (spec, folder)
        return folder
