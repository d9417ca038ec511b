"""Evaluate eviction policies: teacher-forced on stored traces (--traces), or by the accuracy of sampled
completions (--prompts).

Teacher-forced (ForesightKV Table 2 and 7): every trace is replayed through the model that made it under every policy and budget; each row of
the report gives the loss ratio against the stored full-cache loss (tokens after the first
eviction), the low-entropy damage (share of bottom-80%-entropy tokens whose loss grew by more than
1.5, and their mean squared increase), the cosine similarity of attention outputs with the full
cache, and the overlap with the golden kept set where labels exist (`foresight labels`). With
--sampled-seeds N every --scorer also gets a row NAME-sampled: the learned policy sampling its evictions
(Eq. 2), each trace's figures the mean of N replays seeded 0..N-1.

Generation (--prompts): k completions per problem under the full cache and under every policy and
budget; pass@1 and pass@k by the strict and the flexible answer rule, agreement with the full
cache's answer on the same seed, mean length and the share of completions that end in a repetition
loop. Completions are kept under OUT/completions, so a killed run resumes where it stopped.

Teacher-forced, each evicting policy's replay of a batch of traces is kept under OUT/replays as soon as it
ends, so a killed run resumes where it stopped too (a rerun with another model, dtype, device or label kind is
refused, and a rerun's other policies or batches are replayed, not mixed in); several processes started on one
OUT (one per core or GPU) share its batches by claims, and each writes the whole results once all are kept.

Both write OUT/results.json, results.csv, results.md (every figure with its 95% bootstrap interval,
over traces or problems) and one PNG per figure (budget on the x axis).
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from foresight.cadence import Regime
from foresight.commands import _generation
from foresight.commands._grammar import HelpParts, PartedHelp
from foresight.commands._model import (
    add_model_arguments,
    model_of_traces,
    model_options,
)
from foresight.commands._policy import (
    REQUIRED,
    add_cadence_arguments,
    add_option_argument,
    add_policies_argument,
    add_regime_argument,
    add_scorer_argument,
)
from foresight.data.trace_store import TraceStore, describe_traces, select_traces
from foresight.eval.replay import evaluate
from foresight.eval.replay_store import ReplayStore
from foresight.eval.results import evaluation_table, write_evaluation
from foresight.eval.specs import (
    RECOMMENDED_SEEDS,
    PolicySpec,
    SampledScorerSpec,
    ScorerSpec,
    check_distinct_names,
    policy_specs,
)
from foresight.labels import LabelKind
from foresight.models import load_model
from foresight.scorer.eviction_sampling import check_temperature

log = logging.getLogger(__name__)

TRACE_BATCH = 4


HELP_PARTS: HelpParts = {
    "traces": (
        "teacher-forced on stored traces (--traces)",
        (1, 3),
        (
            "max_traces",
            "holdout",
            "holdout_seed",
            "sources",
            "label_kind",
            "share_prefix",
            "sampled_seeds",
            "sample_temperature",
        ),
    ),
    "prompts": (
        "accuracy of sampled completions (--prompts)",
        (2, 4),
        ("num", "problem_seed", "samples", "max_new_tokens", "temperature", "top_k", "top_p", "seed"),
    ),
    "policies": ("learned scorers and policy options", (), ("option", "scorer")),
}
"""`foresight eval --help PART`: the verb's options by mode (its whole help is over a hundred lines)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-h", "--help", action=PartedHelp, parts=HELP_PARTS)
    parser.add_argument("--traces", type=Path, help="traces folder written by `foresight traces` (or give --prompts)")
    add_policies_argument(
        parser, "every registered policy that can run; golden where labels exist, foresight with --scorer"
    )
    add_cadence_arguments(parser, budget=REQUIRED, interval=REQUIRED, several_budgets=True)
    add_regime_argument(parser)
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json/.csv/.md and the plots")
    add_model_arguments(parser, made_traces=True)
    parser.add_argument(
        "--max-traces", type=int, default=None, help="evaluate at most this many traces, in order (default: all)"
    )
    parser.add_argument(
        "--holdout",
        type=float,
        default=None,
        metavar="FRACTION",
        help="evaluate only the held-out split of this fraction (TraceView.split) (default: every trace)",
    )
    parser.add_argument("--holdout-seed", type=int, default=0, help="seed of the held-out split")
    parser.add_argument(
        "--sources",
        type=lambda text: [source for source in text.split(",") if source],
        default=None,
        metavar="SOURCE,...",
        help="evaluate only the traces of these prompt sources, as their `source` names them (a fold's held-out "
        "families) (default: every source)",
    )
    parser.add_argument(
        "--per-source",
        type=int,
        default=None,
        metavar="N",
        help="evaluate only the first N traces (by index) of each prompt source (default: all of them)",
    )
    parser.add_argument(
        "--label-kind",
        default=LabelKind.ALPHA.value,
        choices=[member.value for member in LabelKind],
        help="the labels golden replays and the golden overlap reads (`foresight labels --label-kind`): its oracle "
        "is the golden schedule of that kind's score (default: alpha, Eq. 5)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="traces replayed together, or completions generated together with --prompts "
        f"(default: {TRACE_BATCH} traces, {_generation.DEFAULT_BATCH} completions)",
    )
    parser.add_argument(
        "--no-shared-prefix",
        dest="share_prefix",
        action="store_false",
        help="run the model on every token of every replay instead of reusing, across the policies of a batch, "
        "the forwards before the first eviction (the same results; saves the memory of the recorded queries, "
        "keys and values of B + L tokens per trace)",
    )
    add_option_argument(parser)
    add_scorer_argument(
        parser,
        what="repeat to compare several, each NAME= naming its rows (e.g. --scorer foresight-sl=runs/main/scorer "
        "--scorer foresight-rl=runs/main/rl/scorer). Adds foresight to --policies (naming it there is optional)",
    )
    parser.add_argument(
        "--sampled-seeds",
        type=int,
        nargs="?",
        const=RECOMMENDED_SEEDS,
        default=0,
        metavar="N",
        help="also evaluate every --scorer in sampled mode (Eq. 2: the L evictions drawn without replacement from "
        "the 2L lowest keep scores), as a row NAME-sampled whose per-trace figures are the mean of N replays seeded "
        f"0..N-1; the flag alone means N={RECOMMENDED_SEEDS}, the recommended number (default: 0, deterministic "
        "only). Teacher-forced (--traces) only",
    )
    parser.add_argument(
        "--sample-temperature",
        type=float,
        default=1.0,
        metavar="T",
        help="τ of the sampled rows: Eq. 2's softmax reads the negated keep scores divided by T (default: 1.0, the paper's)",
    )
    _generation.add_arguments(parser)


def option_settings(specs: Sequence[PolicySpec]) -> dict[str, str]:
    """The report's line on the rows run with settings of their own or under another policy's name (none without)."""
    described = [
        f"{spec.name} ({', '.join([f'policy {spec.policy_class.name}', *(f'{k}={v}' for k, v in spec.settings().items())])})"
        for spec in specs
        if spec.policy or spec.settings()
    ]
    return {"policy options": "; ".join(described)} if described else {}


def sampled_specs(specs: list[PolicySpec], seeds: int, temperature: float) -> list[SampledScorerSpec]:
    """The sampled rows of --sampled-seeds: one per learned scorer (none when seeds is 0)."""
    if seeds < 0:
        raise ValueError(f"--sampled-seeds must be 0 (off) or at least 1, got {seeds}")
    try:
        check_temperature(temperature)
    except ValueError as error:
        raise ValueError(f"--sample-temperature: {error}") from None
    learned = [spec for spec in specs if isinstance(spec, ScorerSpec)]
    if seeds and not learned:
        raise ValueError("--sampled-seeds samples the learned policy's evictions: give --scorer DIR_OR_HUB_ID")
    return [SampledScorerSpec.of(spec, seeds, temperature) for spec in learned] if seeds else []


def sampled_settings(seeds: int, temperature: float) -> dict[str, str]:
    """The report's line on the sampled rows (none without them)."""
    if not seeds:
        return {}
    return {
        "sampled rows": f"mean of {seeds} replays per trace (seeds 0..{seeds - 1}) at temperature τ = {temperature}"
    }


def regime_notes(specs: Sequence[PolicySpec], regime: Regime) -> list[str]:
    """A warning per learned scorer trained for another regime than the one evaluated (it still runs: comparing
    regimes is a user's experiment, not a mistake)."""
    return [
        f"{spec.name} was trained for the {spec.scorer.config.regime.value} regime and runs here in the "
        f"{regime.value} regime (--regime {spec.scorer.config.regime.value} evaluates it as trained)"
        for spec in specs
        if isinstance(spec, ScorerSpec) and spec.scorer.config.regime is not regime
    ]


def trained_on(specs: list[PolicySpec], evaluated: set[str]) -> dict[str, str]:
    """Per learned scorer: the sources it was trained on (from its config) and which evaluated ones it never saw."""
    lines = {}
    for spec in specs:
        if not isinstance(spec, ScorerSpec) or isinstance(spec, SampledScorerSpec):
            continue
        trained = spec.scorer.config.training_sources
        if not trained:
            lines[f"{spec.name} trained on"] = "not recorded in its config"
            continue
        unseen = sorted(evaluated - set(trained))
        lines[f"{spec.name} trained on"] = ", ".join(trained)
        lines[f"sources {spec.name} never saw"] = ", ".join(unseen) if unseen else "none (in distribution)"
    return lines


def run(args: argparse.Namespace) -> int:
    if (args.traces is None) == (not args.prompts):
        raise ValueError("give either --traces (teacher-forced) or --prompts (generation), not both or neither")
    specs, notes = policy_specs(args.policies, args.scorer, args.option)
    if args.prompts:
        if args.sampled_seeds:
            raise ValueError("--sampled-seeds averages teacher-forced replays: use it with --traces, not --prompts")
        return _generation.run(args, specs, notes)
    specs += sampled_specs(specs, args.sampled_seeds, args.sample_temperature)
    check_distinct_names(specs)
    started = time.perf_counter()
    store = TraceStore(args.traces)
    made_with = model_of_traces(args, args.traces, store.settings["model"])
    traces = list(select_traces(store, args.holdout, args.holdout_seed, args.max_traces, args.sources, args.per_source))
    if not traces:
        raise ValueError(
            f"no traces to evaluate in {args.traces} (holdout={args.holdout}, max-traces={args.max_traces})"
        )
    model, _ = load_model(made_with, **model_options(args))
    weight = next(model.parameters())
    replays = ReplayStore(
        args.out / "replays",
        {
            "model": made_with,
            "dtype": str(weight.dtype),
            "device": weight.device.type,
            "label kind": args.label_kind,
            "regime": args.regime.value,
        },
    )
    result = evaluate(
        model,
        traces,
        specs,
        args.budgets,
        args.interval,
        labels_root=args.traces,
        label_kind=args.label_kind,
        batch_size=args.batch_size or TRACE_BATCH,
        share_prefix=args.share_prefix,
        replays=replays,
        regime=args.regime,
    )
    warnings = regime_notes(specs, args.regime)
    for warning in warnings:
        log.warning(warning)
    result.notes[:0] = notes + warnings
    settings = {
        "traces": str(args.traces),
        "model": made_with,
        "evaluated traces": describe_traces(traces),
        "policies": ", ".join(spec.name for spec in specs),
        "budgets": ", ".join(map(str, args.budgets)),
        "interval": args.interval,
        "regime": args.regime.value,
        **option_settings(specs),
        **sampled_settings(args.sampled_seeds, args.sample_temperature),
        **trained_on(specs, {t.source for t in traces}),
    }
    paths = write_evaluation(result, args.out, settings)
    for note in result.notes:
        log.info("note: %s", note)
    print(evaluation_table(result.rows))
    print(
        f"evaluated {len(traces)} traces x {len(specs)} policies x {len(args.budgets)} budgets in "
        f"{time.perf_counter() - started:.1f} s; results written to {args.out} ({', '.join(p.name for p in paths)})"
    )
    return 0
