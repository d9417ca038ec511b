"""Fit a scorer with the supervised stage (ForesightKV §3.2): the orchestration behind `trainers.fit` and
`foresight fit`.

Runs the steps that make the data, then the LightningCLI of `trainers.cli`, on a YAML config
(configs/default.yaml for the embedded default on CPU). Each step is the function of its verb, logs one
line, and skips what is already made, so a rerun resumes: traces (sampled from the config's `traces` recipe
unless `traces` names an existing folder), their golden labels, the example cache (skipped when
data.examples_dir is null, which replays the traces on every pass), then training. Everything goes under
`out`: traces/ and its labels, examples/, checkpoints/ (last.ckpt; resume with ckpt_path "last"),
lightning_logs/ (TensorBoard) and scorer/ (config.json, model.safetensors, README.md).

On-policy rounds (docs/algorithms.md §6): round r replays the training traces under round r-1's scorer,
labels the states its own evictions reach with their future scores, adds them to the golden examples and
all earlier rounds' and refits from round r-1's weights, in out/round-r; the last round's scorer is also
out/scorer. A rerun skips the rounds whose scorer exists.

A seed ensemble fits the recipe N times instead, member i in out/member-i with seed_everything + i, and
writes the mean of their keep scores to out/scorer as one wider scorer (`foresight.scorer.ensemble`). Under
a DDP strategy every process runs the same call; the steps run under a file lock in `out`, so one process
makes the data and the others find it made.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import yaml
from filelock import FileLock, Timeout

from foresight.data.trace_store import folder_sources
from foresight.labels import LabelKind
from foresight.scorer.ensemble import ensemble
from foresight.scorer.model import ScorerConfig, load_scorer
from trainers.data_stage import make_labels, make_traces
from trainers.example_cache import ExampleCache
from trainers.export import ensemble_record, export_scorer, reported_metrics
from trainers.preparation import OnPolicyRounds, SeedEnsemble, make_examples, make_on_policy_examples, scorer_trajectory
from trainers.run_config import RunRequest, one_line_config_errors, override_args

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class FitRequest(RunRequest):
    """One supervised run: a `RunRequest` and the fit's own settings (None: the config's), checked by the
    settings classes the config sections use."""

    label_kind: LabelKind | None = None
    on_policy_rounds: int | None = None
    round_steps: int | None = None
    ensemble: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.label_kind is not None:
            object.__setattr__(self, "label_kind", LabelKind.parse(self.label_kind))
        if self.on_policy_rounds is not None:
            OnPolicyRounds(rounds=self.on_policy_rounds)
        if self.round_steps is not None:
            OnPolicyRounds(steps=self.round_steps)
        if self.ensemble is not None:
            SeedEnsemble(members=self.ensemble)


TRAINING_RECORD = "training.json"
"""A seed ensemble's member keeps its training record here (member-i/), for the ensemble's model card."""

MEMBER_LOCK = ".member.lock"
"""The lock in member-i/ that the process fitting that member holds."""


def lightning_args(request: FitRequest) -> list[str]:
    """The LightningCLI arguments of a fit (no subcommand: `prepare` drives the trainer)."""
    out = request.out
    cli_args = [*request.common_args(), f"--data.traces_dir={request.traces or out / 'traces'}"]
    data = (yaml.safe_load(request.config.read_text()) or {}).get("data") or {}
    if data.get("examples_dir") is not None:  # a config that replays (null) keeps doing so
        cli_args.append(f"--data.examples_dir={out / 'examples'}")
    if request.traces is not None:
        cli_args.append("--traces=null")
    if request.regime is not None:
        cli_args.append(f"--data.regime={request.regime.value}")
    if request.label_kind is not None:
        cli_args.append(f"--data.label_kind={request.label_kind.value}")
    return cli_args + override_args(request.overrides)  # `fit_scorer` hands ckpt_path to trainer.fit


def _built_cli(request: FitRequest, extra: list[str] | None = None):
    """The supervised LightningCLI of this run (with `extra` arguments last), built but not run."""
    from trainers.cli import cli_main  # Lightning is imported on the first fit, not with the request

    with warnings.catch_warnings():  # LightningCLI warns when given args beside a command line: intended here
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        with one_line_config_errors():
            return cli_main(lightning_args(request) + (extra or []), run=False, exit_on_error=False)


def prepare(request: FitRequest, cli=None):
    """Build the run from its config (unless `cli`, the built LightningCLI, is given), then make what its
    data module reads: traces (with a recipe), labels, examples. Returns the LightningCLI, ready to fit."""
    cli = cli or _built_cli(request)
    data, recipe = cli.datamodule, cli.config_init.get("traces")
    show = cli.trainer.is_global_zero
    request.out.mkdir(parents=True, exist_ok=True)
    with FileLock(str(request.out / ".steps.lock")):
        if recipe is not None:
            _report("traces", make_traces(data.frozen, recipe, data.traces_dir, progress=show), show)
            record_sources(cli.model.scorer.config, data.traces_dir)
        labels = make_labels(
            data.frozen,
            data.traces_dir,
            data.budget,
            data.interval,
            progress=show,
            kind=data.labels.kind,
            regime=data.regime,
            per_source=data.per_source,
        )
        _report("labels", labels, show)
        if data.examples is not None:
            examples = make_examples(
                data.frozen,
                data.examples,
                replay_batch_size=data.replay_batch_size,
                progress=show,
                per_source=data.per_source,
            )
            _report("examples", examples, show)
    return cli


def record_sources(config: ScorerConfig, traces_dir: str | os.PathLike) -> None:
    """The traces' prompt sources in the scorer's config when the run sampled them after the config was
    built (a fresh run: the data module read an empty folder)."""
    if not config.training_sources:
        config.training_sources = folder_sources(traces_dir)


def _report(step: str, summary, show: bool) -> None:
    if show:
        log.info("%s: %s", step, summary.describe())


def fit_scorer(request: FitRequest) -> Path:
    cli = _built_cli(request)
    rounds = _rounds_of(request, cli.config_init.get("on_policy"))
    members = request.ensemble or (cli.config_init.get("ensemble") or SeedEnsemble()).members
    if members > 1:
        seed = _ensemble_seed(request, members)  # refused before any data is made
        _fit_ensemble(request, prepare(request, cli), members, seed, rounds)
    else:
        prepare(request, cli)
        _fit_with_rounds(request, cli, rounds, request.out, request.ckpt_path)
    return request.out / "scorer"


def _fit_with_rounds(
    request: FitRequest,
    cli,
    rounds: OnPolicyRounds,
    out: Path,
    ckpt_path: str | None,
    member: tuple[str, ...] = (),
) -> dict | None:
    """The golden fit in `out`, then `rounds` on-policy rounds in out/round-r, the last scorer in out/scorer.
    `member` holds a seed ensemble member's LightningCLI arguments, which every round's refit keeps.
    Returns the last fit's training record (None on the processes that do not export)."""
    if rounds.rounds == 0:
        return _fit_and_export(cli, ckpt_path, out / "scorer")
    if cli.datamodule.examples is None:
        raise ValueError("on-policy rounds need the golden examples in a cache (data.examples_dir, not null)")
    scorer, record = _round_scorer(out, 0), None
    if not (scorer / "config.json").is_file():
        record = _fit_and_export(cli, ckpt_path, scorer)
    cli.datamodule.setup("fit")
    for round_ in range(1, rounds.rounds + 1):
        scorer, made = _on_policy_round(request, cli, out, round_, rounds.steps, member)
        record = made or record
    if cli.trainer.is_global_zero:
        shutil.copytree(scorer, out / "scorer", dirs_exist_ok=True)
        print(f"{out / 'scorer'}: the scorer of on-policy round {rounds.rounds}")
    return record


def _ensemble_seed(request: FitRequest, members: int) -> int:
    """The seed of member 0 (member i's is + i), as the config and --set give it: a seed ensemble needs an
    integer there (LightningCLI replaces `true` by a random one, which a rerun would not find again) and no
    resume but from each member's last checkpoint."""
    if request.ckpt_path not in (None, "last"):
        raise ValueError(
            f"a seed ensemble resumes each member from its own last checkpoint: --ckpt-path last, not {request.ckpt_path!r}"
        )
    seed = (yaml.safe_load(request.config.read_text()) or {}).get("seed_everything")
    for text in request.overrides:
        key, _, value = text.partition("=")
        if key.strip() == "seed_everything":
            seed = yaml.safe_load(value)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(
            f"a seed ensemble needs an integer seed_everything to count its members' seeds from, got {seed!r}"
        )
    return seed


def _fit_ensemble(request: FitRequest, cli, members: int, seed: int, rounds: OnPolicyRounds) -> None:
    """Fit member i in --out/member-i with seed + i, its on-policy rounds in member-i/round-r (skipped when
    its scorer exists; resumed with --ckpt-path last), keeping its training record in member-i/training.json,
    then export the mean of the members' keep scores to --out/scorer.

    One process fits a member at a time, under a lock in its folder: the same command started in several
    processes (one per core) shares out the members, then each waits for the members others hold (fitting
    any whose process stopped) before the mean. Under DDP every rank fits every member together, so the
    ranks take no member lock."""
    folders = [request.out / f"member-{member}" for member in range(members)]
    shared = cli.trainer.world_size == 1
    for wait in (False, True) if shared else (True,):  # first the members no other process holds
        for member, folder in enumerate(folders):
            with _claimed(folder, shared, wait) as mine:
                if not mine or _member_done(folder):
                    continue
                member_args = (f"--seed_everything={seed + member}",)
                extra = [f"--trainer.default_root_dir={folder}", f"--checkpoint.dirpath={folder / 'checkpoints'}"]
                member_cli = _built_cli(request, [*member_args, *extra])
                record = _fit_with_rounds(
                    request, member_cli, rounds, folder, _resume_from(request, folder), member_args
                )
                if record is not None:
                    (folder / TRAINING_RECORD).write_text(json.dumps(record, indent=1))
    if not cli.trainer.is_global_zero:
        return
    seeds = f"{seed}..{seed + members - 1}" if members > 2 else f"{seed} and {seed + 1}"
    records = [
        json.loads(path.read_text()) if path.is_file() else {} for path in (f / TRAINING_RECORD for f in folders)
    ]
    record = {**ensemble_record(records), "seeds": seeds}
    with FileLock(str(request.out / ".steps.lock")):  # every process that shared the members writes the same mean
        export_scorer(
            ensemble([load_scorer(folder / "scorer") for folder in folders]), request.out / "scorer", training=record
        )
    print(f"{request.out / 'scorer'}: the mean of {members} fits (seed_everything {seeds})", flush=True)


def _member_done(folder: Path) -> bool:
    return (folder / "scorer" / "config.json").is_file()


@contextmanager
def _claimed(folder: Path, shared: bool, wait: bool) -> Iterator[bool]:
    """Whether this process may fit the member, holding its lock until the block ends: at once, or after
    the process holding it lets go (`wait`); False when another holds it and `wait` is off. Without
    `shared` (the ranks of one DDP run, which fit every member together) no lock is taken."""
    if not shared:
        yield True
        return
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder / MEMBER_LOCK))
    try:
        lock.acquire(timeout=-1 if wait else 0)
    except Timeout:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def _rounds_of(request: FitRequest, configured: OnPolicyRounds | None) -> OnPolicyRounds:
    """The config's `on_policy` section, with --on-policy-rounds and --round-steps over it."""
    rounds = configured or OnPolicyRounds(rounds=0)
    if request.on_policy_rounds is not None:
        rounds = replace(rounds, rounds=request.on_policy_rounds)
    if request.round_steps is not None:
        rounds = replace(rounds, steps=request.round_steps)
    return rounds


def _round_scorer(out: Path, round_: int) -> Path:
    return out / f"round-{round_}" / "scorer"


def _on_policy_round(
    request: FitRequest, cli, out: Path, round_: int, steps: int | None, member: tuple[str, ...]
) -> tuple[Path, dict | None]:
    """Round `round_` in out/round-r: the previous round's scorer replays the training traces, its states
    join the training examples, and a refit starts from its weights. Returns the round's scorer folder and
    its training record (None when it was made before, or on the processes that do not export)."""
    folder, scorer = out / f"round-{round_}", _round_scorer(out, round_)
    if (scorer / "config.json").is_file():
        return scorer, None
    previous, data, show = _round_scorer(out, round_ - 1), cli.datamodule, cli.trainer.is_global_zero
    driver = load_scorer(previous)
    cache = ExampleCache(
        folder / "examples", data.traces_dir, replace(data.examples.key, trajectory=scorer_trajectory(driver))
    )
    with FileLock(str(out / ".steps.lock")):
        made = make_on_policy_examples(
            data.frozen, cache, driver, data.train_indices, replay_batch_size=data.replay_batch_size, progress=show
        )
        _report(f"round {round_} examples", made, show)
    dirs = [str(out / f"round-{r}" / "examples") for r in range(1, round_ + 1)]
    round_args = [
        *member,
        f"--trainer.default_root_dir={folder}",
        f"--checkpoint.dirpath={folder / 'checkpoints'}",
        f"--data.on_policy_dirs=[{','.join(dirs)}]",
        f"--model.init_scorer={previous}",
    ]
    if steps is not None:
        round_args.append(f"--trainer.max_steps={steps}")
    round_cli = _built_cli(request, round_args)
    return scorer, _fit_and_export(round_cli, _resume_from(request, folder), scorer)


def _resume_from(request: FitRequest, folder: Path) -> str | None:
    """ "last" when --ckpt-path last asks to resume and `folder` holds a last checkpoint, else None (a fresh fit)."""
    return "last" if request.ckpt_path == "last" and (folder / "checkpoints" / "last.ckpt").is_file() else None


def _fit_and_export(cli, ckpt_path: str | None, folder: Path) -> dict | None:
    """Train, validate once more (the final figures of the scorer being exported) and export to `folder`.
    Returns the training record on the process that exports (None on the others)."""
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    train_metrics = {name: value for name, value in cli.trainer.callback_metrics.items() if name.startswith("train/")}
    if cli.datamodule.val_dataloader():
        cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    if not cli.trainer.is_global_zero:
        return None
    module = cli.model
    record = module.training_record(extra_metrics=train_metrics)
    export_scorer(module.scorer, folder, training=record)
    metrics = ", ".join(f"{name} {value:.4f}" for name, value in reported_metrics(record).items())
    print(f"{folder}: scorer trained for {module.global_step} steps; {metrics}", flush=True)
    return record
