"""What `foresight eval` compares: a policy by name and options, or a learned scorer, with the checks that
tell which budgets each can run at. Shared by the teacher-forced replay and the accuracy evaluation.

Size: the specs and the command-line texts that make them (--policies rows, --scorer sources, -o options) change
together: every option a row takes is a field of its spec, checked here before any replay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from foresight.labels import GoldenLabels
from foresight.policies import POLICIES, Policy, make_policy
from foresight.policies.options import describe_type, parse_value, typed_options
from foresight.runtime.engine import EvictionConfig
from foresight.runtime.pool import Allocation, Layout, check_pooled, pooled_refusal
from foresight.scorer.eviction_sampling import check_temperature
from foresight.scorer.model import ForesightScorer, load_scorer

RECOMMENDED_SEEDS = 8
"""Seeds a sampled learned policy is replayed with by default (`foresight eval --sampled-seeds`)."""


# -- which policies ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PolicySpec:
    """A policy to evaluate and what building it takes. Golden takes the labels of the batch; a
    policy that needs another artifact (a learned scorer's folder) becomes one more kind of spec
    with its own `build`, without touching the replay loop.

    name: the row's name; policy: the registered policy it runs (default: `name`), so one policy can
    run under two settings as two rows; options: its constructor options (e.g. triattention's
    stats); protect_prompt and sinks: override the policy's own defaults (None keeps them); layout, allocation and
    floor: the cache layout and how a step divides a layer's kept candidates among its heads (`EvictionConfig`;
    None keeps a cache per KV head)."""

    name: str
    policy: str | None = None
    options: tuple[tuple[str, Any], ...] = ()
    protect_prompt: bool | None = None
    sinks: int | None = None
    layout: str | None = None
    allocation: str | None = None
    floor: int | None = None

    @property
    def policy_class(self) -> type[Policy]:
        return POLICIES[self.policy or self.name]

    @property
    def needs_labels(self) -> bool:
        return any(f.init and f.name == "labels" for f in fields(self.policy_class))

    @property
    def missing_artifacts(self) -> list[str]:
        """Required constructor arguments that neither eval (golden's labels) nor the options give."""
        given = {key for key, _ in self.options}
        return [
            f.name
            for f in fields(self.policy_class)
            if f.init and f.default is f.default_factory is MISSING and f.name != "labels" and f.name not in given
        ]

    @property
    def evicts(self) -> bool:
        return self.policy_class.evicts

    @property
    def protects_prompt(self) -> bool:
        if self.needs_labels:
            return False
        return self.policy_class.default_protect_prompt if self.protect_prompt is None else self.protect_prompt

    def settings(self) -> dict[str, Any]:
        """What the row sets beyond its policy's defaults: its options, then the cadence overrides that differ
        from the policy's own (the report's line on the row, and what identifies its completions)."""
        cls, given = self.policy_class, dict(self.options)
        defaults = {"protect_prompt": cls.default_protect_prompt, "sinks": cls.default_sinks, **LAYOUT_DEFAULTS}
        for key, default in defaults.items():
            if (value := getattr(self, key)) is not None and value != default:
                given[key] = value
        return given

    def build(self, labels: Sequence[GoldenLabels] | None, trace_indices: Sequence[int] = ()) -> Policy:
        """The policy for one batch: `labels` of its traces (golden), `trace_indices` (a sampled scorer)."""
        options = dict(self.options) | ({"labels": list(labels)} if self.needs_labels else {})
        return make_policy(self.policy_class.name, **options)

    def replays(self) -> list[PolicySpec]:
        """The replays whose per-trace sums average into this spec's row: itself (a sampled learned
        policy: one per seed)."""
        return [self]

    def config(self, eviction: EvictionConfig) -> EvictionConfig | None:
        """`eviction`'s B and L with this policy's sinks and prompt rule (its own defaults); golden's cadence has
        no sinks and no protected prompt (its labels assume neither)."""
        if not self.evicts:
            return None
        if self.needs_labels:
            return replace(eviction, sinks=0, protect_prompt=False)
        return replace(eviction, sinks=self.sinks, protect_prompt=self.protect_prompt, **self.layout_settings())

    def layout_settings(self) -> dict[str, Any]:
        """The cache layout keys the row sets (`LAYOUT_DEFAULTS`), for its `EvictionConfig`."""
        return {key: getattr(self, key) for key in LAYOUT_DEFAULTS if getattr(self, key) is not None}

    def skip_reason(self, eviction: EvictionConfig) -> str | None:
        """Why the policy cannot run at this budget and interval (a learned scorer runs only at its own)."""
        return None


@dataclass(frozen=True)
class ScorerSpec(PolicySpec):
    """The learned `foresight` policy with one trained scorer, run at the B and L it was trained for,
    with no sinks and no protected prompt (as in training); `options` are the policy's own (e.g. its
    observation, `-o NAME.observation=window`), none of which changes what the scorer was trained for, and the
    cache layout is a setting as a heuristic row's (`-o NAME.layout=pooled -o NAME.allocation=layer`)."""

    scorer: ForesightScorer = field(default=None, compare=False, repr=False)

    @classmethod
    def from_source(cls, source: str, several: bool) -> ScorerSpec:
        """A spec from `SOURCE` or `NAME=SOURCE` (a folder or Hub id): named NAME when given, else
        `foresight`, or `foresight:FOLDER` when several scorers are compared."""
        name, path = split_scorer(source)
        if name is None:
            name = f"foresight:{Path(path).name}" if several else "foresight"
        return cls(name=name, scorer=load_scorer(path))

    @property
    def policy_class(self) -> type[Policy]:
        return POLICIES["foresight"]

    @property
    def missing_artifacts(self) -> list[str]:
        return []

    def build(self, labels: Sequence[GoldenLabels] | None, trace_indices: Sequence[int] = ()) -> Policy:
        return make_policy("foresight", scorer=self.scorer, **dict(self.options))

    def config(self, eviction: EvictionConfig) -> EvictionConfig | None:
        return replace(eviction, sinks=0, protect_prompt=False, **self.layout_settings())

    def skip_reason(self, eviction: EvictionConfig) -> str | None:
        trained = (self.scorer.config.budget, self.scorer.config.interval)
        if (eviction.budget, eviction.interval) == trained:
            return None
        return (
            f"{self.name} skipped at B={eviction.budget}, L={eviction.interval}: its scorer was trained for "
            f"B={trained[0]}, L={trained[1]}"
        )


@dataclass(frozen=True)
class SampledScorerSpec(ScorerSpec):
    """The learned policy in sampled mode (ForesightKV Eq. 2: L evictions drawn from the 2L lowest keep
    scores, softmax of the negated scores / `temperature`), replayed once per seed of `seeds`; its row
    holds the per-trace means over the seeds. Each trace draws from its own generator seeded by (seed,
    trace index), so a trace samples the same evictions whatever traces share its batch. Draws are not
    recorded (`Foresight.record`): only the evictions matter here."""

    seeds: tuple[int, ...] = tuple(range(RECOMMENDED_SEEDS))
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not self.seeds:
            raise ValueError(f"{self.name}: a sampled policy needs at least one seed, got none")
        check_temperature(self.temperature)

    @classmethod
    def of(cls, spec: ScorerSpec, seeds: int, temperature: float) -> SampledScorerSpec:
        """`spec`'s scorer sampled with seeds 0..seeds-1, its row named NAME-sampled (a pooled row has none: the
        pooled layout does not run the sampled mode)."""
        if spec.layout == Layout.POOLED.value:
            raise ValueError(
                f"--sampled-seeds: row {spec.name!r} runs on layout='pooled', which does not run the sampled mode yet"
            )
        return cls(
            name=f"{spec.name}-sampled",
            options=spec.options,
            scorer=spec.scorer,
            seeds=tuple(range(seeds)),
            temperature=temperature,
        )

    def replays(self) -> list[PolicySpec]:
        return [replace(self, seeds=(seed,)) for seed in self.seeds]

    def build(self, labels: Sequence[GoldenLabels] | None, trace_indices: Sequence[int] = ()) -> Policy:
        """One seed's policy for a batch of the traces `trace_indices` (a spec of `replays`)."""
        if len(self.seeds) != 1 or not trace_indices:
            raise ValueError(f"{self.name}: build one seed's replay (`replays`) of a batch of known traces")
        row_seeds = tuple(trace_seed(self.seeds[0], index) for index in trace_indices)
        return make_policy(
            "foresight",
            **{
                **dict(self.options),
                "scorer": self.scorer,
                "mode": "sampled",
                "temperature": self.temperature,
                "row_seeds": row_seeds,
                "record": False,
            },
        )


def trace_seed(seed: int, trace_index: int) -> int:
    """The sampling seed of one trace's replay under `seed`: a function of the two only."""
    return int(np.random.SeedSequence([seed, trace_index]).generate_state(1)[0])


REFERENCE = PolicySpec("full")


LEARNED = "foresight"
"""The learned policy: its rows come from trained scorers (`ScorerSpec`), never from --policies alone."""
CADENCE_OPTIONS = {"protect_prompt": bool, "sinks": int, "layout": str, "allocation": str, "floor": int}
"""Option keys that override a policy's cadence defaults (not policy fields: the engine applies them)."""
LAYOUT_DEFAULTS = {"layout": Layout.HEADS.value, "allocation": Allocation.HEAD.value, "floor": None}
"""The cadence keys of the cache layout (`EvictionConfig`), as a row that gives none runs."""


def resolve_policies(
    text: str, options: Mapping[str | None, Mapping[str, str]] | None = None
) -> tuple[list[PolicySpec], list[str]]:
    """Specs for `all` or a comma-separated list of rows, and notes on what `all` leaves out. A row is
    NAME, or ROW=NAME to run a registered policy under a row name of its own (one policy under two
    settings). `options` maps a row to its option texts {key: value}, typed from the policy's fields
    (e.g. triattention's stats; None: the one row's); the keys protect_prompt and sinks override the policy's
    defaults. The learned policy is not a row here: its rows come from trained scorers."""
    if text == "all":
        rows = {name: name for name in sorted(POLICIES)}
    else:
        rows = _rows(text)
    options = options_of(options or {}, [row for row, policy in rows.items() if policy != LEARNED])
    specs, notes = [], []
    for row, policy in rows.items():
        if policy == LEARNED:
            notes.append(f"{LEARNED}: skipped, it needs a trained scorer")
            continue
        spec = _with_options(row, policy, options.get(row, {}))
        missing = spec.missing_artifacts
        if not missing:
            specs.append(spec)
            continue
        needed = f"it needs {', '.join(missing)}: give " + ", ".join(f"-o {row}.{key}=VALUE" for key in missing)
        if text != "all":
            raise ValueError(f"policy {row!r}: {needed}")
        notes.append(f"{row}: skipped, {needed}")
    return specs, notes


def _rows(text: str) -> dict[str, str]:
    """{row name: registered policy} of the --policies items NAME or ROW=NAME, each row once."""
    rows: dict[str, str] = {}
    for item in (part for part in text.split(",") if part.strip()):
        row, sep, policy = (part.strip() for part in item.partition("="))
        policy = policy if sep else row
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose 'all' or some of: {', '.join(sorted(POLICIES))}")
        if policy == LEARNED:
            raise ValueError(
                f"policy {LEARNED!r} comes from a trained scorer: give --scorer [NAME=]DIR_OR_HUB_ID, not {item!r}"
            )
        if not row:
            raise ValueError(f"--policies item {item!r} must be NAME or ROW=NAME")
        if row in POLICIES and row != policy:
            raise ValueError(f"--policies row {row!r} would run {policy}: name it apart from every registered policy")
        if rows.get(row, policy) != policy:
            raise ValueError(f"--policies row {row!r} given twice ({rows[row]}, {policy})")
        rows[row] = policy
    if not rows:
        raise ValueError(f"--policies {text!r} names no policy; give 'all' or names such as h2o,snapkv")
    return rows


def cadence_overrides(row: str, texts: dict[str, str], refused: bool = False) -> dict[str, Any]:
    """The cadence keys (protect_prompt, sinks) of a row's option texts, typed, taken out of `texts`; `refused`
    where the row's policy takes none (it evicts nothing, or follows its labels' cadence)."""
    cadence = {key: texts.pop(key) for key in CADENCE_OPTIONS if key in texts}
    if cadence and refused:
        raise ValueError(f"-o {row}.{next(iter(cadence))}: only a heuristic that evicts takes it")
    overrides = {}
    for key, text in cadence.items():
        try:
            overrides[key] = parse_value(text, CADENCE_OPTIONS[key])
        except ValueError:
            raise ValueError(f"-o {row}.{key} expects {describe_type(CADENCE_OPTIONS[key])}, got {text!r}") from None
    if overrides.get("sinks", 0) < 0:
        raise ValueError(f"-o {row}.sinks must be 0 or more, got {overrides['sinks']}")
    for key, choice in (("layout", Layout), ("allocation", Allocation)):
        if key in overrides:
            overrides[key] = choice.parse(overrides[key]).value
    return overrides


def _with_options(row: str, policy: str, texts: Mapping[str, str]) -> PolicySpec:
    """The row's spec, its options typed and checked by building the policy once (a missing statistics
    folder is refused here, before any replay)."""
    texts = dict(texts)
    spec = PolicySpec(row, None if policy == row else policy)
    overrides = cadence_overrides(row, texts, spec.needs_labels or not spec.evicts)
    extra = [] if spec.needs_labels else list(CADENCE_OPTIONS)
    typed = typed_options(POLICIES[policy], texts, label=row, extra=extra)
    spec = replace(spec, options=tuple(sorted(typed.items())), **overrides)
    if typed and not spec.missing_artifacts and not spec.needs_labels:
        spec.build(None)
    _check_layout(spec)
    return spec


def _check_layout(spec: PolicySpec) -> None:
    """Refuse, in one line naming the row, a pooled row that the pooled layout does not run (its policy, its options
    or its allocation: `check_pooled`), before any replay; the policy is built only where its class runs pooled."""
    if spec.layout != Layout.POOLED.value:
        return
    try:
        if not spec.policy_class.runs_pooled:
            raise ValueError(pooled_refusal(spec.policy_class.name))
        check_pooled(spec.build(None), Allocation.parse(spec.allocation or Allocation.HEAD.value))
    except ValueError as error:
        raise ValueError(f"-o {spec.name}.layout=pooled: {error}") from None


# -- from the command line ------------------------------------------------------------------------
LEARNED_NOTE = "foresight: skipped, it needs scorer: give --scorer DIR_OR_HUB_ID to evaluate a trained one"


def split_scorer(text: str) -> tuple[str | None, str]:
    """(NAME, source) of a --scorer text `[NAME=]DIR_OR_HUB_ID` (NAME None when not given; a NAME has no `/`,
    so a folder or Hub id that holds `=` stays whole)."""
    name, sep, source = text.partition("=")
    if sep and name.strip() and "/" not in name:
        if not source.strip():
            raise ValueError(f"--scorer {text!r} names no folder or Hub id after {name}=")
        return name.strip(), source.strip()
    return None, text.strip()


def one_scorer(texts: Sequence[str], runs: str) -> tuple[str, str] | None:
    """(row name, source) of the one --scorer of a command that runs one learned scorer (`runs` says which);
    None without one, a one-line error for several."""
    if len(texts) > 1:
        raise ValueError(f"{runs} runs one learned scorer; give --scorer once, not {len(texts)} times")
    if not texts:
        return None
    name, source = split_scorer(texts[0])
    return name or LEARNED, source


def policy_specs(policies: str, scorers: list[str], options: Sequence[str] = ()) -> tuple[list[PolicySpec], list[str]]:
    """Specs and notes of --policies and its -o [ROW.]KEY=VALUE options; the learned `foresight` policy
    comes from the --scorer folders or Hub ids."""
    names = [name.strip() for name in policies.split(",")]
    row_options = options_by_row(options)
    if not scorers:
        if "foresight" in names:
            raise ValueError("policy 'foresight' needs a trained scorer: give --scorer DIR_OR_HUB_ID")
        specs, notes = resolve_policies(policies, row_options)
        return specs, [LEARNED_NOTE if note.startswith("foresight:") else note for note in notes]
    others = policies if policies == "all" else ",".join(name for name in names if name != "foresight")
    learned = [ScorerSpec.from_source(source, several=len(scorers) > 1) for source in scorers]
    learned = [replace(spec, **_scorer_settings(spec.name, row_options.pop(spec.name, {}))) for spec in learned]
    for spec in learned:
        _check_layout(spec)
    if row_options and not others.strip(","):
        raise ValueError(
            f"-o {next(iter(row_options)) or 'KEY'}...: --policies names no heuristic to take options "
            f"(a --scorer row takes -o NAME.KEY=VALUE; rows: {', '.join(spec.name for spec in learned)})"
        )
    specs, notes = resolve_policies(others, row_options) if others.strip(",") else ([], [])
    notes = [note for note in notes if not note.startswith("foresight:")]
    specs += learned
    check_distinct_names(specs)
    return specs, notes


def _scorer_settings(row: str, texts: dict[str, str]) -> dict[str, Any]:
    """A --scorer row's -o options, typed as the learned policy declares them, and its cache layout (layout,
    allocation, floor, as a heuristic row's); the rest of its cadence (no sinks, no protected prompt, the scorer's B
    and L) is what it was trained for, so those keys are refused."""
    trained = set(texts) & (set(CADENCE_OPTIONS) - set(LAYOUT_DEFAULTS))
    layout = cadence_overrides(row, texts, refused=bool(trained))
    return {"options": tuple(typed_options(POLICIES[LEARNED], texts, label=row).items()), **layout}


def check_distinct_names(specs: list[PolicySpec]) -> None:
    """One-line error when two specs would write rows of one name."""
    names = [spec.name for spec in specs]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"two result rows would be named {repeated[0]!r}; name each --scorer apart as NAME=DIR")


def options_by_row(texts: Sequence[str]) -> dict[str | None, dict[str, str]]:
    """{row: {key: value}} of the -o [ROW.]KEY=VALUE texts (row None where ROW. is left out). A key `scorer`
    is refused with the spelling that gives a scorer."""
    options: dict[str | None, dict[str, str]] = {}
    for text in texts:
        target, sep, value = text.partition("=")
        row, _, key = target.strip().rpartition(".")
        if not (sep and key.strip()) or (target.strip().startswith(".")):
            raise ValueError(
                f"-o {text!r} must look like [ROW.]KEY=VALUE, e.g. lag_size=none or triattention.stats=DIR"
            )
        if key.strip() == "scorer":
            raise ValueError(
                f"-o {text}: a scorer is not a policy option; use --scorer {value.strip() or 'DIR_OR_HUB_ID'}"
            )
        options.setdefault(row.strip() or None, {})[key.strip()] = value.strip()
    return options


def options_of(
    options: Mapping[str | None, Mapping[str, str]], rows: Sequence[str], what: str = "a row of --policies"
) -> dict[str, dict[str, str]]:
    """{row: {key: value}}: the options of `options_by_row` given to `rows`, those without ROW. to the one row
    (a one-line error when there are several to choose from, or for a ROW that is not `what`)."""
    unknown = sorted(row for row in options if row is not None and row not in rows)
    if unknown:
        raise ValueError(f"options for {unknown[0]!r}, which is not {what} (rows: {', '.join(rows) or 'none'})")
    given = {row: dict(texts) for row, texts in options.items() if row is not None}
    if None in options:
        if len(rows) != 1:
            key = next(iter(options[None]))
            raise ValueError(f"-o {key}=...: name its row, -o ROW.{key}=... (rows: {', '.join(rows) or 'none'})")
        given[rows[0]] = {**given.get(rows[0], {}), **options[None]}
    return given
