"""The example cache: the supervised stage's training examples (`trainers.examples`), one
safetensors file per trace, made by `foresight examples` (or the features step of `foresight fit`).

Layout of a cache folder::

    examples.json                 the key: what the examples were made from and how they are stored
    trace-000012.safetensors      keys, values, features (storage dtype) and alpha (float32) of trace 12

The key names everything that changes the files' content: the format version, the frozen model and
the dtype it ran in, B, L, the feature set, the storage dtype and the trajectory the replay followed
(`golden`, or `scorer:<digest>` for the on-policy examples of one scorer's own evictions). Each file's metadata repeats it with
the trace's index and length. A folder made with another key is refused, never mixed or overwritten.
A file that does not open (a truncated write or copy) or that was made for another trace is damaged:
reading it is a one-line error naming the command that remakes the cache, and that command replaces
it. Files are written to a temporary name, then renamed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from foresight.artifacts import MISSING, file_problem, save_tensors, write_text
from foresight.cadence import Regime, check_budget
from foresight.data.trace_store import Trace
from foresight.labels import LabelKind
from foresight.models import float_dtype
from foresight.scorer.attention_features import FeatureSet

FORMAT = "foresight-golden-steps/2"
KEY_FILE = "examples.json"
GOLDEN_TRAJECTORY = "golden"
LEGACY_DEFAULTS = {"label_kind": LabelKind.ALPHA.value, "regime": Regime.STREAMING.value}
"""Key fields a cache made before they existed does not store, with the value such a cache holds."""


@dataclass(frozen=True)
class ExampleKey:
    """Everything that changes what a example cache holds."""

    model: str
    model_dtype: str
    budget: int
    interval: int
    feature_set: str
    storage_dtype: str
    format: str = FORMAT
    trajectory: str = GOLDEN_TRAJECTORY
    label_kind: str = LabelKind.ALPHA.value  # the labels' kind (`foresight labels --kind`) the targets are
    regime: str = Regime.STREAMING.value  # the regime whose steps the examples are (`foresight.cadence.Regime`)

    def __post_init__(self) -> None:
        check_budget(self.budget, self.interval)
        FeatureSet.parse(self.feature_set)
        LabelKind.parse(self.label_kind)
        Regime.parse(self.regime)
        float_dtype("model_dtype", self.model_dtype)
        float_dtype("storage_dtype", self.storage_dtype)

    def metadata(self) -> dict[str, str]:
        """The key as stored with the cache and each file; α's kind and the streaming regime are left out, so
        caches made before the kinds and regimes stay valid and are never read as another kind's or regime's
        (whose key names it)."""
        stored = {name: str(value) for name, value in asdict(self).items()}
        for name, default in LEGACY_DEFAULTS.items():
            if stored[name] == default:
                del stored[name]
        return stored


class ExampleCache:
    """The cache folder `directory` of one key, made from the traces (and labels) in `traces_dir`."""

    def __init__(self, directory: str | os.PathLike, traces_dir: str | os.PathLike, key: ExampleKey) -> None:
        self.directory = Path(directory)
        self.traces_dir = Path(traces_dir)
        self.key = key

    @property
    def remake_command(self) -> str:
        """The command that makes this cache, or replaces its damaged files."""
        key = self.key
        return (
            f"`foresight examples --traces {self.traces_dir} --budget {key.budget} --interval {key.interval} "
            f"--feature-set {key.feature_set} --storage-dtype {key.storage_dtype} --dtype {key.model_dtype} "
            f"{'' if key.label_kind == LabelKind.ALPHA.value else f'--label-kind {key.label_kind} '}"
            f"{'' if key.regime == Regime.STREAMING.value else f'--regime {key.regime} '}"
            f"--out {self.directory}`"
        )

    def path(self, trace_index: int) -> Path:
        return self.directory / f"trace-{trace_index:06d}.safetensors"

    def claim_path(self, first_index: int) -> Path:
        """The file a process locks while it replays the batch of traces whose first is `first_index`."""
        return self.directory / f".batch-{first_index:06d}.claim"

    @classmethod
    def of_trajectory(
        cls, directory: str | os.PathLike, traces_dir: str | os.PathLike, key: ExampleKey
    ) -> ExampleCache:
        """The cache in `directory` with `key` but the trajectory its folder records (an on-policy round's
        examples are read by a data module that knows only the golden key)."""
        file = Path(directory) / KEY_FILE
        if not file.is_file():
            raise ValueError(f"{directory} holds no examples ({KEY_FILE} missing); `foresight fit --rounds` makes them")
        stored = json.loads(file.read_text()).get("trajectory", GOLDEN_TRAJECTORY)
        return cls(directory, traces_dir, replace(key, trajectory=stored))

    def check_key(self) -> bool:
        """Whether the folder holds a cache of this key (False: none yet); refuses one of another key."""
        file = self.directory / KEY_FILE
        if not file.is_file():
            return False
        # caches made before on-policy rounds name no trajectory, those made before the kinds or regimes none
        stored = {"trajectory": GOLDEN_TRAJECTORY, **LEGACY_DEFAULTS, **json.loads(file.read_text())}
        wanted = {name: str(value) for name, value in asdict(self.key).items()}
        differing = [
            f"{name} {stored.get(name)!r} (asked: {value!r})"
            for name, value in wanted.items()
            if stored.get(name) != value
        ]
        if differing:
            raise ValueError(
                f"{self.directory} holds features made with {', '.join(differing)}; remove that folder or pick "
                f"another, then run {self.remake_command}"
            )
        return True

    def claim(self) -> None:
        """Make the folder this key's cache (before writing into it): refuse another key, record this one."""
        if self.check_key():
            return
        text = json.dumps(self.key.metadata(), indent=1)
        write_text(self.directory / KEY_FILE, text)

    def problem(self, trace: Trace) -> str | None:
        """Why the file of `trace` cannot be read as its examples (MISSING, damaged, made with other settings)."""
        return file_problem(self.path(trace.index), self._metadata(trace))

    def paths(self, traces: Sequence[Trace]) -> list[Path]:
        """The files of `traces`, or a one-line ValueError naming what is wrong and the command that remakes it."""
        command = self.remake_command
        if not self.check_key():
            raise ValueError(f"{self.directory} holds no features ({KEY_FILE} missing); make them with {command}")
        for trace in traces:
            problem = self.problem(trace)
            if problem == MISSING:
                raise ValueError(f"no features of trace {trace.index} in {self.directory}; make them with {command}")
            if problem is not None:
                raise ValueError(f"{self.path(trace.index)} is {problem}; remake it with {command}")
        return [self.path(trace.index) for trace in traces]

    def write(self, trace: Trace, tensors: dict[str, torch.Tensor]) -> None:
        """Write the examples of `trace` (after `claim`), replacing any file there."""
        save_tensors(self.path(trace.index), tensors, self._metadata(trace))

    def _metadata(self, trace: Trace) -> dict[str, str]:
        return {**self.key.metadata(), "trace_index": str(trace.index), "num_tokens": str(trace.input_ids.numel())}
