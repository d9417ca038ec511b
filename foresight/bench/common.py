"""What the benchmarks share: their common options, declared once as settings to inherit or fields to
reuse (the report, the device and dtype, the model, the policies and cadence of the runtime benchmarks,
the learned scorer), the prompt, and a line naming the machine. `foresight.bench.options` turns the
fields into the command line."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import torch

from foresight.bench.options import (
    BUDGET_FLAGS,
    BUDGET_HELP,
    BUDGETS_FLAGS,
    BUDGETS_HELP,
    DEFAULT_CADENCE,
    INTERVAL_FLAGS,
    INTERVAL_HELP,
    OPTION_FLAGS,
    OPTION_HELP,
    OPTION_METAVAR,
    REGIME_HELP,
    SCORER_FLAGS,
    SCORER_HELP,
    SCORER_METAVAR,
    command_line,
    declaring_module,
)
from foresight.cadence import Regime
from foresight.data.tasks import chat_prompt_ids
from foresight.eval.specs import one_scorer, options_by_row
from foresight.models import DEFAULT_MODEL, ModelShape, check_device, describe, load_for_benchmark, placement
from foresight.policies import POLICIES, Policy, constructible, make_policy
from foresight.policies.options import typed_options
from foresight.runtime.engine import EvictionConfig
from foresight.scorer.model import ForesightScorer, ScorerConfig, load_scorer

PROMPT = "Solve step by step: a train leaves at 9:40 and travels 3 hours 35 minutes. When does it arrive?"
LEARNED = "foresight"
RUNS = Path("runs/bench")
DtypeName = Literal["float32", "bfloat16", "float16", "auto"]


def device_field(default: str = "cpu") -> Any:
    return field(
        default=default,
        metadata={"help": "where the model runs: cpu, cuda, cuda:N, mps, or auto (cuda if available, else cpu)"},
    )


def dtype_field(default: str = "float32") -> Any:
    return field(
        default=default,
        metadata={"help": "dtype of the model's weights and activations; auto: bfloat16 on cuda, float32 elsewhere"},
    )


def model_field(architecture_configs: bool = True) -> Any:
    configs = ", or an architecture config (configs/models/*.json: random weights)" if architecture_configs else ""
    return field(
        default=DEFAULT_MODEL,
        metadata={
            "help": f"{DEFAULT_MODEL!r} (the embedded SmolLM2-135M-Instruct), a local model folder or a Hub id{configs}"
        },
    )


def budget_field(default: int = DEFAULT_CADENCE[0]) -> Any:
    return field(default=default, metadata={"help": BUDGET_HELP, "flags": BUDGET_FLAGS})


def budgets_field(default: tuple[int, ...]) -> Any:
    return field(default=default, metadata={"help": BUDGETS_HELP, "flags": BUDGETS_FLAGS})


def interval_field(default: int = DEFAULT_CADENCE[1]) -> Any:
    return field(default=default, metadata={"help": INTERVAL_HELP, "flags": INTERVAL_FLAGS})


def regime_field() -> Any:
    """--regime: where the eviction steps fall (`foresight.cadence.Regime`), as every verb spells it."""
    return field(default=Regime.STREAMING.value, metadata={"help": REGIME_HELP})


def scorer_field(what: str = "", default: tuple[str, ...] = (), required: bool = False) -> Any:
    """--scorer [NAME=]DIR_OR_HUB_ID, repeatable (a tuple of texts; `foresight.eval.specs.one_scorer` reads the one
    of a benchmark that runs one); `what` adds what the benchmark does with it to the shared help."""
    metadata = {"help": SCORER_HELP + (f"; {what}" if what else ""), "flags": SCORER_FLAGS, "metavar": SCORER_METAVAR}
    return field(metadata=metadata) if required else field(default=default, metadata=metadata)


def option_field() -> Any:
    """-o [ROW.]KEY=VALUE, repeatable: options of the rows of --policies (`foresight.eval.specs.policy_specs`)."""
    return field(default=(), metadata={"help": OPTION_HELP, "flags": OPTION_FLAGS, "metavar": OPTION_METAVAR})


def policies_field(all_means: str) -> Any:
    return field(
        default="all",
        metadata={
            "help": f"'all' ({all_means}) or a comma-separated list of: {', '.join(sorted(POLICIES))}",
            "metavar": "all|NAME,...",
        },
    )


def trace_sets_field() -> Any:
    """--set NAME=DIR,... (repeatable): a trace set and the `foresight eval` folders of its traces."""
    return field(
        metadata={
            "help": "a trace set and the `foresight eval` folders of its traces (repeat per set)",
            "flags": ("--set",),
            "metavar": "NAME=DIR,...",
        }
    )


def traces_field(help_text: str = "traces folder (`foresight traces`)") -> Any:
    return field(metadata={"help": help_text})


def default_report(module: ModuleType) -> Path:
    """Where a benchmark's report goes without --out: runs/bench/NAME.md (a study's REPORTS folder instead)."""
    return getattr(module, "REPORTS", RUNS) / f"{module.NAME}.md"


@dataclass(frozen=True, kw_only=True)
class ReportSettings:
    """Where the report goes: its section of a markdown file under runs/ unless --out says otherwise."""

    out: Path | None = field(
        default=None,
        metadata={
            "help": "markdown report whose section is rewritten (default: runs/bench/BENCHMARK.md)",
            "report": True,
        },
    )
    section: str | None = field(
        default=None,
        metadata={"help": "name of the report section to rewrite (default: BENCHMARK-DEVICE)", "report": True},
    )

    @property
    def command(self) -> str:
        """The command that reproduces the report (written into it)."""
        return command_line(self)

    @property
    def report(self) -> Path:
        """The markdown file of the report: --out, or runs/bench/BENCHMARK.md."""
        return self.out or default_report(declaring_module(self))


@dataclass(frozen=True, kw_only=True)
class PlacedSettings(ReportSettings):
    """A report of a run on one device in one dtype, as given (`auto` included); `run_device` and
    `run_dtype` are what they resolve to."""

    device: str = device_field()
    dtype: DtypeName = dtype_field()

    def __post_init__(self) -> None:
        check_device(self.device)

    @property
    def run_device(self) -> str:
        return placement(self.device, self.dtype)[0]

    @property
    def run_dtype(self) -> torch.dtype:
        return placement(self.device, self.dtype)[1]


@dataclass(frozen=True, kw_only=True)
class ModelSettings(PlacedSettings):
    """A run of one model: a name, folder, Hub id or (where the benchmark builds it with `load_for_benchmark`)
    an architecture config."""

    model: str = model_field()


class OneScorer:
    """Settings with a `scorer` field (`scorer_field`) of which a run reads one: `learned` is it."""

    scorer: tuple[str, ...]

    @property
    def learned(self) -> tuple[str, str] | None:
        """(row name, folder or Hub id) of the one --scorer (None without one; several are refused)."""
        module = declaring_module(self)
        return one_scorer(self.scorer, " ".join([*getattr(module, "COMMAND", "foresight bench").split(), module.NAME]))


@dataclass(frozen=True, kw_only=True)
class PolicyOptions:
    """Settings whose rows (`policy_names`, the full cache among them, and `policies` as given) take -o options."""

    policies: str
    option: tuple[str, ...] = option_field()

    @property
    def policy_names(self) -> list[str]:
        """The rows, in order (each settings class names its own)."""
        raise NotImplementedError

    def check_options(self) -> None:
        """Unknown or unrunnable policies, several scorers, options a policy does not have and options of no row are
        refused before any model loads."""
        for name in self.policy_names:
            self.policy_options(name)
        unknown = set(options_by_row(self.option)) - {None, *self.policy_names}
        if unknown:
            raise ValueError(
                f"-o {sorted(unknown)[0]}.KEY=VALUE names no policy of --policies {self.policies!r}; rows: "
                f"{', '.join(self.policy_names)}"
            )

    def policy_options(self, name: str) -> dict[str, Any]:
        """Policy `name`'s -o options, typed: those given as NAME.KEY=VALUE, and as KEY=VALUE where it is the one
        evicting policy (`-o observation=forward` for a run of the learned policy alone)."""
        rows = options_by_row(self.option)
        evicting = [row for row in self.policy_names if row != "full"]
        texts = {**(rows.get(None, {}) if evicting == [name] else {}), **rows.get(name, {})}
        if rows.get(None) and len(evicting) > 1:
            raise ValueError(f"-o {next(iter(rows[None]))}=...: name its policy, e.g. -o {evicting[-1]}.KEY=VALUE")
        return typed_options(POLICIES[name], texts)


@dataclass(frozen=True, kw_only=True)
class RuntimeSettings(OneScorer, PolicyOptions, ModelSettings):
    """A benchmark of the eviction runtime: the full cache and `policies` at (budget, interval) on the
    model (an architecture config: random weights, since speed and memory depend on the shape alone). The
    learned policy runs `scorer`, or without one a scorer of the model's shape with seeded random weights:
    its cost does not depend on its weights."""

    device: str = device_field("auto")
    dtype: DtypeName = dtype_field("auto")
    policies: str = policies_field(
        "every policy that needs no labels or scorer, and the learned one with --scorer; full is always included"
    )
    budget: int = budget_field()
    interval: int = interval_field()
    scorer: tuple[str, ...] = scorer_field(
        "without it, --policies ...,foresight runs a scorer of the model's shape with seeded random weights (the same "
        "cost)"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_options()

    def policy(self, name: str, scorer: ForesightScorer | None) -> Policy:
        """A fresh policy of the run with its -o options; the learned one runs `scorer`."""
        return bench_policy(name, scorer, self.policy_options(name))

    @property
    def eviction(self) -> EvictionConfig:
        return EvictionConfig(self.budget, self.interval)

    @property
    def policy_names(self) -> list[str]:
        """The full cache first; the learned policy when named, or in 'all' when --scorer is given."""
        names = selected_policies(self.policies, learned=True)
        return [name for name in names if name != LEARNED or self.policies != "all" or self.learned is not None]

    def learned_scorer(self, model) -> ForesightScorer | None:
        """The scorer of the learned policy on the model's device (None when it is not among the policies)."""
        if LEARNED not in self.policy_names:
            return None
        if self.learned is None:
            return random_scorer(model, self.budget, self.interval)
        scorer = load_scorer(self.learned[1])
        trained = (scorer.config.budget, scorer.config.interval)
        if trained != (self.budget, self.interval):
            raise ValueError(
                f"--scorer {self.learned[1]} was trained for B = {trained[0]}, L = {trained[1]}; run with "
                f"--budget {trained[0]} --interval {trained[1]}"
            )
        return scorer.to(model.device)

    def scorer_note(self) -> str:
        """What the learned policy ran, for the report ('' when it did not run)."""
        if LEARNED not in self.policy_names:
            return ""
        if self.learned is None:
            return " The learned policy `foresight` ran a scorer of the model's shape with random weights (seed 0)."
        name, source = self.learned
        return f" The learned policy `foresight` ran {source}" + ("." if name == LEARNED else f" ({name}).")


def named(texts: tuple[str, ...], option: str, kind: str) -> tuple[tuple[str, str], ...]:
    """(NAME, VALUE) of each NAME=VALUE text given to `option`; `kind` says what VALUE is."""
    pairs = []
    for text in texts:
        name, sep, value = text.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ValueError(f"{option} {text!r} must look like NAME={kind}")
        pairs.append((name.strip(), value.strip()))
    return tuple(pairs)


def trace_sets(texts: tuple[str, ...]) -> tuple[tuple[str, tuple[Path, ...]], ...]:
    """(name, `foresight eval` folders) of each --set NAME=DIR,DIR,... text."""
    return tuple(
        (name, tuple(Path(folder) for folder in folders.split(",")))
        for name, folders in named(texts, "--set", "DIR,DIR,...")
    )


def selected_policies(text: str, learned: bool) -> list[str]:
    """The full cache and the policies of --policies: 'all' is every policy that needs no labels or scorer,
    and the learned one where `learned` (its scorer is provided)."""

    def runnable(name: str) -> bool:
        return constructible(POLICIES[name]) or (learned and name == LEARNED)

    names = sorted(filter(runnable, POLICIES)) if text == "all" else text.split(",")
    for name in names:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose from: {', '.join(sorted(POLICIES))}")
        if not runnable(name):
            raise ValueError(f"policy {name!r} needs labels, which a benchmark of the runtime does not have")
    return ["full"] + [n for n in names if n != "full"]


def bench_policy(name: str, scorer: ForesightScorer | None, options: dict[str, Any] | None = None) -> Policy:
    """A fresh policy of a runtime benchmark with `options`; the learned one runs `scorer`."""
    options = options or {}
    return make_policy(name, scorer=scorer, **options) if name == LEARNED else make_policy(name, **options)


def random_scorer(
    model: Any,
    budget: int,
    interval: int,
    *,
    seed: int = 0,
    spread: float = 1.0,
    base_model: str = "random",
    **config: Any,
) -> ForesightScorer:
    """A scorer of the shape of `model` (a model, its config or a `ModelShape`) at (B, L) with weights drawn
    from `seed`, leaving the caller's random state as it was: what the learned policy costs does not depend
    on its weights. `spread` scales the first layer's weights (tests take 4: keep scores far apart,
    evictions decisive); `config` sets or replaces other `ScorerConfig` fields (e.g. feature_set, num_layers)."""
    shape = model if isinstance(model, ModelShape) else describe(model)
    fields = ScorerConfig(
        **{**asdict(shape), "budget": budget, "interval": interval, "base_model": base_model, **config}
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        scorer = ForesightScorer(fields)
    with torch.no_grad():
        scorer.w1.mul_(spread)
    if scorer.needs_output_factors and isinstance(model, torch.nn.Module):
        scorer.set_output_factors(model)
    return scorer.to(model.device) if hasattr(model, "device") else scorer


def load_benchmark_model(settings: ModelSettings):
    """The model (an architecture config builds a seeded random one) and its tokenizer (None then)."""
    return load_for_benchmark(settings.model, device=settings.run_device, dtype=settings.run_dtype)


def prompt_ids(tokenizer, vocab_size: int) -> list[int]:
    """The benchmark prompt: PROMPT in the model's chat format, or, for a model without a tokenizer,
    64 seeded random token ids (about as long)."""
    if tokenizer is not None:
        return chat_prompt_ids(tokenizer, PROMPT)
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (64,), generator=generator).tolist()


def machine(device: str) -> str:
    """The device in words: the GPU's name, or the CPU threads torch uses."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return f"{torch.get_num_threads()} CPU threads ({platform.processor() or platform.machine()})"


def threads_note() -> str:
    """The thread settings a CPU timing depends on, for the line after a report's command."""
    return f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {torch.get_num_threads()} torch thread(s))"
