"""Recipes chosen by held-out families: k-fold by family over a training corpus (issue 55).

The corpus's families (its traces' prompt sources) are dealt into k folds (seeded, sizes differing by at most
one). For fold k, every variant of the recipe is fitted on the traces of the other folds' families
(`data.exclude_sources`), then fold k's traces are replayed under the full cache, golden, the heuristics of the
reference list and every variant, in each regime. Every trace is thus scored once, by scorers that never saw
its family (a cross-fit). The figure a variant is chosen by is its share of the headroom on **generated
tokens**, pooled over the held-out traces of every fold, with its 95% bootstrap interval over traces, per
regime; the all-token share and each fold's own share stand beside it. No test set is read: a corpus trace of
a family that a test set (data/corpus/unseen-*) holds is refused before any fit.

A variant is NAME=OVERRIDES, the fit config's overrides joined by `;` (`wide=model.hidden=32;ensemble.members=1`;
`base=` for the config as it is); `{fold_scorer:NAME}` in an override names the same fold's scorer of an earlier
variant (`student=ensemble.members=1;model.teacher={fold_scorer:base}`: one member distilled from the ensemble).

Fits and evaluations land under --work, one folder per (regime, variant, fold), and every trace score goes into
the record (--record, `record.py`: small files kept in the repository), so a stopped study resumes on any machine:
a fold whose every policy is recorded is neither fitted nor replayed again, and a variant added later is fitted
and replayed alone. Each fold's reference rows (full cache, golden, the reference list) come first, since they
need labels and no fit; then the variants that make their examples alike (the same `data.` overrides) share one
example cache, made once for every fold, and run variant by variant, fold by fold (a fold's fit, its evaluation,
its record). A cache is removed once every fold of its variants is recorded (one holds every step's candidate
keys and values: 28-32 GB for the 755 traces of `train66`), unless --keep-examples. `--fold` gives a process its
share of the folds: processes on different folds share the labels, the caches (by claims) and the record.

    python -m studies folds --traces data/corpus/train66 --folds 5 --config configs/default.yaml \\
        --variant base= --variant one=ensemble.members=1 --regime decode --regime streaming
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from foresight.bench.common import ReportSettings, scorer_field
from foresight.cli import main as foresight
from foresight.data.corpus import refuse_test_families, test_set_folders
from foresight.data.trace_store import TraceStore, folder_sources
from foresight.eval.headroom import ORACLE, REFERENCE, REFERENCE_HEURISTICS, TraceScore, headroom, percent
from foresight.eval.metric_registry import TokenSet
from foresight.eval.specs import LEARNED, ScorerSpec, split_scorer
from foresight.scorer.model import weights_digest
from studies import COMMAND as COMMAND  # how its report names it, where it goes
from studies import REPORTS as REPORTS
from studies.folds.record import FoldRecord, content_digest

NAME = "folds"
CORPUS = Path("data/corpus")


@dataclass(frozen=True, kw_only=True)
class Settings(ReportSettings):
    traces: Path = field(metadata={"help": "the training corpus (a traces folder of several prompt sources)"})
    folds: int = field(default=5, metadata={"help": "folds k: the families are dealt into k groups"})
    fold_seed: int = field(default=0, metadata={"help": "seed of the deal of families into folds"})
    config: Path = field(default=Path("configs/default.yaml"), metadata={"help": "the fit config (the recipe)"})
    variant: tuple[str, ...] = field(
        default=("base=",),
        metadata={"help": "NAME=KEY=VALUE;KEY=VALUE: a variant of the recipe by its config overrides (repeat)"},
    )
    regime: tuple[str, ...] = field(
        default=("decode", "streaming"), metadata={"help": "a regime to fit and score in (repeat)"}
    )
    test_sets: Path = field(default=CORPUS, metadata={"help": "the folder whose unseen-* trace folders are test sets"})
    work: Path = field(default=Path("runs/folds"), metadata={"help": "folder of the fits and evaluations"})
    record: Path | None = field(
        default=None,
        metadata={"help": "folder of the trace scores the study resumes from on any machine (default: WORK/record)"},
    )
    batch_size: int = field(default=4, metadata={"help": "traces replayed together by each evaluation"})
    keep_examples: bool = field(
        default=False,
        metadata={
            "help": "keep each example cache once its variants' fits are done (at the corpus's size one holds a few "
            "GB, so by default the fits run cache by cache and each is removed after them)"
        },
    )
    scorer: tuple[str, ...] = scorer_field(
        "a scorer replayed as it is on every fold beside the variants, never fitted (today's default, "
        "`shipped=checkpoints/default`)"
    )
    fold: tuple[int, ...] = field(
        default=(),
        metadata={
            "help": "a fold this process works on (repeat; default: every fold): processes on different folds share "
            "the example caches and the record"
        },
    )
    per_family: int | None = field(
        default=None, metadata={"help": "score only the first N traces of each held-out family (default: all)"}
    )
    train_per_family: int | None = field(
        default=None,
        metadata={
            "help": "fit on the first N traces of each training family only, and label and cache only those "
            "(default: all; the fits' `data.per_source`)"
        },
    )

    def __post_init__(self) -> None:
        self.variants  # a malformed variant is refused here
        if self.folds < 2:
            raise ValueError(f"--folds {self.folds}: a fold study needs at least 2 folds")
        if outside := sorted(set(self.fold) - set(range(self.folds))):
            raise ValueError(f"--fold {outside[0]}: the folds are 0..{self.folds - 1}")
        for name, value in (("--per-family", self.per_family), ("--train-per-family", self.train_per_family)):
            if value is not None and value < 1:
                raise ValueError(f"{name} {value}: take at least 1 trace of each family, or leave it out")

    @property
    def variants(self) -> dict[str, list[str]]:
        """{name: its `--set` overrides} of every variant (NAME= alone: the config as it is)."""
        found: dict[str, list[str]] = {}
        for text in self.variant:
            name, sep, overrides = text.partition("=")
            if not sep or not name.strip() or name.strip() in found:
                raise ValueError(f"--variant {text!r} must look like NAME=KEY=VALUE;KEY=VALUE, each NAME once")
            own = [override.strip() for override in overrides.split(";") if override.strip()]
            for earlier in re.findall(r"\{fold_scorer:([^}]+)\}", overrides):
                if earlier not in found:
                    raise ValueError(
                        f"--variant {text!r} reads variant {earlier!r}'s scorer, which no earlier --variant names"
                    )
                if _made(found[earlier]) != _made(own):
                    raise ValueError(
                        f"--variant {text!r} reads variant {earlier!r}'s scorer, whose examples differ "
                        f"({_made(found[earlier]) or 'none'} against {_made(own) or 'none'}): a teacher reads what "
                        "its student reads"
                    )
            found[name.strip()] = own
        return found


def deal_folds(families: list[str], folds: int, seed: int) -> dict[str, int]:
    """Each family's fold: the families in a seeded order dealt round-robin, so fold sizes differ by at most one; a
    one-line error when there are fewer families than folds."""
    if folds > len(families):
        raise ValueError(
            f"--folds {folds} is more than the corpus's {len(families)} families ({', '.join(families)}): "
            "every fold must hold out at least one family"
        )
    order = np.random.default_rng(seed).permutation(len(families))
    return {families[i]: rank % folds for rank, i in enumerate(order)}


def run(settings: Settings) -> str:
    refuse_test_families(settings.traces, test_set_folders(settings.test_sets))
    families = folder_sources(settings.traces)
    assignment = deal_folds(families, settings.folds, settings.fold_seed)
    held = {fold: sorted(family for family, k in assignment.items() if k == fold) for fold in range(settings.folds)}
    specs = [ScorerSpec.from_source(text, several=True) for text in settings.scorer]
    fixed = {spec.name: Path(split_scorer(text)[1]) for text, spec in zip(settings.scorer, specs, strict=True)}
    if repeated := sorted(set(fixed) & set(settings.variants)):
        raise ValueError(f"--scorer {repeated[0]}=...: a variant has that name; name the scorer apart")
    weights = {spec.name: [f"scorer:{weights_digest(spec.scorer)[:16]}"] for spec in specs}  # a new one: new rows
    record = FoldRecord(settings.record or settings.work / "record", _study(settings), {**settings.variants, **weights})
    sections = [f"Command: `{settings.command}`", "", _fold_table(assignment, settings.traces)]
    mine = {fold: held[fold] for fold in settings.fold or held}
    for regime in settings.regime:
        for fold, families in mine.items():  # the reference rows and the fixed scorers first: no fit
            if not record.holds(regime, fold, ORACLE, families):
                record.add(regime, fold, _evaluated(settings, regime, fold, families, {}, reference=True))
            for name, folder in fixed.items():
                if not record.holds(regime, fold, name, families):
                    record.add(
                        regime, fold, _evaluated(settings, regime, fold, families, {name: folder}, reference=False)
                    )
        for examples, variants in _by_examples(settings, regime).items():
            for name in variants:  # variant by variant: a row of the table is whole before the next one starts
                for fold, families in mine.items():
                    if not record.holds(regime, fold, name, families):
                        scorer = {name: _fitted(settings, regime, name, fold, families, examples)}
                        record.add(regime, fold, _evaluated(settings, regime, fold, families, scorer, reference=False))
            done = all(record.holds(regime, fold, name, held[fold]) for fold in held for name in variants)
            if done and not settings.keep_examples:  # a process on other folds may still read it otherwise
                shutil.rmtree(examples, ignore_errors=True)
        scores = {fold: record.scores(regime, fold) for fold in held}
        sections.append(_regime_table(regime, scores, [*settings.variants, *fixed], held))
    return "\n\n".join(sections)


def _study(settings: Settings) -> dict[str, object]:
    """What makes two runs one study: the corpus, the deal of its families, the scored sample and the fit config."""
    return {
        "corpus": content_digest(settings.traces / "manifest.json"),
        "folds": settings.folds,
        "fold_seed": settings.fold_seed,
        "per_family": settings.per_family,
        "train_per_family": settings.train_per_family,
        "config": content_digest(settings.config),
    }


def _fitted(settings: Settings, regime: str, name: str, fold: int, held: list[str], examples: Path) -> Path:
    """The scorer of variant `name` fitted without fold `fold`'s families (a finished fit is read, not redone),
    after the scorers its overrides read (`{fold_scorer:NAME}`)."""
    out = settings.work / regime / name / f"fold-{fold}"
    scorer = out / "scorer"
    if not (scorer / "config.json").is_file():
        overrides = settings.variants[name]
        for earlier in re.findall(r"\{fold_scorer:([^}]+)\}", ";".join(overrides)):
            _fitted(settings, regime, earlier, fold, held, examples)
        own = [_placed(override, settings, regime, fold) for override in overrides]
        sets = [f"data.exclude_sources={json.dumps(held)}", f"data.examples_dir={examples}", *own]
        if settings.train_per_family is not None:
            sets.append(f"data.per_source={settings.train_per_family}")
        words = ["fit", "--config", str(settings.config), "--traces", str(settings.traces), "--out", str(out)]
        _run([*words, "--regime", regime, *(word for s in sets for word in ("--set", s))])
    return scorer


def _placed(override: str, settings: Settings, regime: str, fold: int) -> str:
    """An override with `{fold_scorer:NAME}` replaced by the folder of variant NAME's scorer of the same fold and
    regime (a distilled variant's teacher: `model.teacher={fold_scorer:base}`); NAME must come earlier."""
    return re.sub(
        r"\{fold_scorer:([^}]+)\}",
        lambda match: str(settings.work / regime / match.group(1) / f"fold-{fold}" / "scorer"),
        override,
    )


def _by_examples(settings: Settings, regime: str) -> dict[Path, list[str]]:
    """The variants' names grouped by the example cache they read (`_examples`), in the order they first appear."""
    groups: dict[Path, list[str]] = {}
    for name, overrides in settings.variants.items():
        groups.setdefault(_examples(settings, regime, overrides), []).append(name)
    return groups


def _examples(settings: Settings, regime: str, overrides: list[str]) -> Path:
    """The example cache of a variant: one for every fold and every variant that makes its examples alike (the
    same `data.` overrides), so the variants of one feature set share one cache."""
    name = re.sub(r"[^\w.=-]", "_", "-".join(["examples", *_made(overrides)]))
    return settings.work / regime / name


def _made(overrides: list[str]) -> list[str]:
    """The overrides that change how a variant's examples are made (its `data.` ones), sorted."""
    return sorted(override for override in overrides if override.startswith("data."))


def _evaluated(
    settings: Settings, regime: str, fold: int, held: list[str], scorers: dict[str, Path], reference: bool
) -> list[TraceScore]:
    """Fold `fold`'s traces replayed under every variant of `scorers` and, with `reference`, the full cache, golden
    and the reference list; their trace scores. The evaluation keeps each policy's replays, so a policy replayed
    earlier on this machine is read, not replayed again."""
    sample = "" if settings.per_family is None else f"-first{settings.per_family}"
    out = settings.work / regime / f"eval-fold-{fold}{sample}"
    budget, interval = (str(_fit_data(settings.config)[key]) for key in ("budget", "interval"))
    scored = [] if settings.per_family is None else ["--per-source", str(settings.per_family)]
    _run(["labels", "--traces", str(settings.traces), "-B", budget, "-L", interval, "--regime", regime, *scored])
    policies = ",".join([REFERENCE, ORACLE, *REFERENCE_HEURISTICS] if reference else [LEARNED])
    words = ["eval", "--traces", str(settings.traces), "--sources", ",".join(held), "--regime", regime]
    words += ["-B", budget, "-L", interval, "--policies", policies, "--out", str(out), *scored]
    words += [
        "--batch-size",
        str(settings.batch_size),
        *(w for n, s in scorers.items() for w in ("--scorer", f"{n}={s}")),
    ]
    _run(words)
    asked = {*scorers, *([REFERENCE, ORACLE, *REFERENCE_HEURISTICS] if reference else [])}
    return [TraceScore(**entry) for entry in json.loads((out / "traces.json").read_text()) if entry["policy"] in asked]


def _fit_data(config: Path) -> dict:
    """The `data` section of a fit config (its budget and interval are the study's)."""
    return yaml.safe_load(config.read_text())["data"]


def _run(words: list[str]) -> None:
    if foresight(words) != 0:
        raise RuntimeError(f"`foresight {' '.join(words)}` failed (its error is above)")


def _fold_table(assignment: dict[str, int], traces: Path) -> str:
    counts = TraceStore(traces).sources()
    lines = ["| fold | families | traces |", "|---:|---|---:|"]
    for fold in sorted(set(assignment.values())):
        held = sorted(f for f, k in assignment.items() if k == fold)
        lines.append(f"| {fold} | {', '.join(held)} | {sum(counts[f] for f in held)} |")
    return "\n".join(lines)


def _regime_table(
    regime: str, scores: dict[int, list[TraceScore]], variants: list[str], held: dict[int, list[str]]
) -> str:
    """Per variant: the share of the headroom on generated and all tokens over the held-out traces of every fold it
    has scores for (a study in progress says how many), then per fold."""
    lines = [
        f"### {regime} regime, held-out families",
        "",
        "| variant | folds | generated tokens | all tokens | per fold (generated) |",
        "|---|---:|---:|---:|---|",
    ]
    for name in variants:
        done = [
            fold for fold, rows in scores.items() if {r.source for r in rows if r.policy == name} >= set(held[fold])
        ]
        pooled = [row for fold in done for row in scores[fold]]
        cells = [_share(pooled, name, variants, token_set) for token_set in (TokenSet.GENERATED, TokenSet.ALL)]
        folds = [_share(scores[fold], name, variants, TokenSet.GENERATED, short=True) for fold in sorted(scores)]
        lines.append(f"| {name} | {len(done)} of {len(scores)} | {cells[0]} | {cells[1]} | {', '.join(folds)} |")
    return "\n".join(lines)


def _share(scores: list[TraceScore], name: str, variants: list[str], token_set: TokenSet, short: bool = False) -> str:
    """A variant's share of the headroom over `scores` (with its interval unless `short`), or – where not scored."""
    budgets = sorted({s.budget for s in scores})
    found = headroom(scores, budgets[0], name, variants, token_set=token_set) if budgets else None
    if found is None:
        return "–"
    return f"{found.share.value:.1%}" if short else percent(found.share, 1)
