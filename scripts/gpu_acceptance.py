"""The GPU acceptance run: every check and figure a lent CUDA machine is for, as one command that fits its
minutes, and the same steps at tiny shapes on the CPU (`--cpu-dry-run`, run by CI so the script cannot rot).

Each step runs in its own process under its own time cap (a hung kernel or an out-of-memory error ends one
step, not the run), in the order of `STEPS`, the most important first and the slowest last, continuing past a
failed step; a deadline for the whole run (`--total-seconds`) shortens the last caps and skips what no time is
left for. Speed figures use random-weight models of configs/models/ (speed depends on the shape alone); the
pipeline's stages (traces, labels, examples, fit, rollouts) run on a random-weight Qwen3-1.7B-shaped model
folder with a character tokenizer, made by the `prepare` step. Writes into the output folder:
acceptance.md (the report), acceptance.json (the same, raw), acceptance.log (every step's output) and
bench.md (the sections of the benchmarks run through `foresight bench`).

    scripts/gpu-acceptance.sh --out "$OUT"                  # on a CUDA machine (installs wheels/gpu first)
    python scripts/gpu_acceptance.py --cpu-dry-run --out runs/gpu-acceptance
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_TESTS = "tests/test_gpu.py"
SDPA_FLASH_TEST = f"{GPU_TESTS}::test_unpadded_batches_run_on_the_sdpa_flash_kernel_alone"
SYNC_DEBUG_TEST = f"{GPU_TESTS}::test_eviction_step_of_rows_in_step_never_synchronises"
PACKAGES = {  # module: distribution
    "torch": "torch",
    "transformers": "transformers",
    "lightning": "lightning",
    "torchmetrics": "torchmetrics",
    "tensorboard": "tensorboard",
    "safetensors": "safetensors",
    "pyarrow": "pyarrow",
    "datasets": "datasets",
    "reasoning_gym": "reasoning-gym",
    "math_verify": "math-verify",
    "jsonargparse": "jsonargparse",
    "importlinter": "import-linter",
    "gguf": "gguf",
    "pytest": "pytest",
    "huggingface_hub": "huggingface-hub",
    "numpy": "numpy",
}
OPTIONAL_PACKAGES = {  # module: distributions it ships as; recorded present (with its version) or absent
    "flash_attn": ("flash-attn", "flash_attn"),
    "flashinfer": ("flashinfer-python", "flashinfer"),
    "triton": ("triton", "pytorch-triton"),
    "vllm": ("vllm",),
}
LEAST_STEP_SECONDS = 5.0  # a step that would have less of the deadline left is skipped
FIGURES = "FIGURES "  # the prefix of a figure step's last line: its figures as JSON


@dataclass(frozen=True)
class Scale:
    """The shapes of one mode: the CUDA machine's (the paper's settings where a step has them) or the dry run's."""

    device: str
    dtype: str
    tiny: bool = False  # every model shrunk to foresight.models.TINY_SIZES (dry run)
    sampler_rows: int = 256
    sampler_prompt: int = 64
    sampler_tokens: int = 64  # an H200 decodes 3-11 steps/s here (launch-bound): docs/notes/gpu-acceptance.md
    traces: int = 8
    trace_tokens: int = 512
    budget: int = 128
    interval: int = 32
    group_size: int = 8
    fit_steps: int = 20
    pipeline_fit_steps: int = 10
    capacity_lengths: str = "8192,32768"
    capacity_budget: int = 1024
    capacity_interval: int = 256
    capacity_time_limit: float = 10.0
    graph_rows: str = "1,16,101"
    graph_prompt: int = 192  # past B + L = 160: every row evicts at its prefill and every 32 tokens after
    graph_tokens: int = 96


CUDA_SCALE = Scale(device="cuda", dtype="bfloat16")
DRY_SCALE = Scale(
    device="cpu",
    dtype="float32",
    tiny=True,
    sampler_rows=4,
    sampler_prompt=8,
    sampler_tokens=8,
    traces=2,
    trace_tokens=100,
    budget=32,
    interval=8,
    group_size=2,
    fit_steps=3,
    pipeline_fit_steps=3,
    capacity_lengths="64,128",
    capacity_budget=32,
    capacity_interval=8,
    capacity_time_limit=1.0,
    graph_rows="1,2",
    graph_prompt=48,
    graph_tokens=24,
)
SAMPLER_MODEL = "configs/models/qwen3-4b.json"
WORK_MODEL = "configs/models/qwen3-1.7b.json"
CAPACITY_MODEL = "configs/models/qwen3-4b.json"
# The full cache and a heuristic at the paper's B, L (the learned policy needs a scorer trained for the model).
CAPACITY_POLICIES = "full,snapkv"


@dataclass(frozen=True)
class Step:
    """One step: `command(context)` is the process it runs; `gpu_only`: without CUDA, `dry_command` (a check
    that the step's tests or flags still resolve) runs instead and the step reports 'skipped: no CUDA'."""

    name: str
    what: str
    cap_seconds: float
    command: Callable[[Context], list[str]]
    gpu_only: bool = False
    dry_command: Callable[[Context], list[str]] | None = None
    needs_work: bool = False  # reads the model folder, traces and labels of `prepare`


@dataclass(frozen=True)
class Context:
    """Where a run writes (`out`: the report; `work`: scratch) and at what `scale`; `command` reproduces it."""

    scale: Scale
    dry_run: bool
    out: Path
    work: Path
    command: str = "scripts/gpu-acceptance.sh"
    python: str = sys.executable

    def figure_step(self, name: str) -> list[str]:
        mode = "--cpu-dry-run" if self.dry_run else "--cuda"
        return [self.python, str(Path(__file__).resolve()), mode, "--step", name, "--work", str(self.work)]

    def pytest(self, *selection: str, junit: str | None = None) -> list[str]:
        """pytest of `selection`, its results in the JUnit XML file `junit`; without one, collect the tests only."""
        report = [f"--junitxml={self.work / junit}"] if junit else ["--collect-only"]
        return [self.python, "-m", "pytest", *selection, "-q", "-p", "no:cacheprovider", *report]

    def bench(self, verb: str, *flags: str) -> list[str]:
        placement = ["--device", self.scale.device, "--dtype", self.scale.dtype]
        return [
            self.python,
            "-m",
            "foresight.cli",
            "bench",
            verb,
            *flags,
            *placement,
            "--out",
            str(self.out / "bench.md"),
            "--section",
            f"{verb}-acceptance",
        ]


def _capacity(context: Context) -> list[str]:
    s = context.scale
    return context.bench(
        "capacity",
        "--model",
        CAPACITY_MODEL,
        "--policies",
        CAPACITY_POLICIES,
        "--budget",
        str(s.capacity_budget),
        "--interval",
        str(s.capacity_interval),
        "--lengths",
        s.capacity_lengths,
        "--time-limit",
        str(s.capacity_time_limit),
    )


def _pipeline(context: Context) -> list[str]:
    s = context.scale
    return context.bench(
        "pipeline",
        "--traces",
        str(context.work / "traces"),
        "--budget",
        str(s.budget),
        "--interval",
        str(s.interval),
        "--group-size",
        str(s.group_size),
        "--fit-steps",
        str(s.pipeline_fit_steps),
        "--batch-size",
        "2",
    )


def _one_test(name: str, what: str, cap_seconds: float, test: str) -> Step:
    """A GPU-only step running one test, its JUnit XML named after the step; the dry run collects the test."""
    return Step(
        name,
        what,
        cap_seconds,
        lambda c: c.pytest(test, junit=f"{name}.xml"),
        gpu_only=True,
        dry_command=lambda c: c.pytest(test),
    )


STEPS = (
    Step(
        "imports", "every package the steps import, the device and the versions", 60, lambda c: c.figure_step("imports")
    ),
    Step(
        "decode-graph",
        f"ms per decode step, the static step in a CUDA graph against eager and a bare transformers loop, random-weight "
        f"{SAMPLER_MODEL}, and the eviction steps' ms (CUDA events)",
        180,
        lambda c: c.figure_step("decode-graph"),
    ),
    Step(
        "gpu-tests",
        f"`pytest -m gpu {GPU_TESTS}` (every registered policy), less the two tests below",
        200,
        lambda c: c.pytest(
            "-m", "gpu", GPU_TESTS, "--deselect", SDPA_FLASH_TEST, "--deselect", SYNC_DEBUG_TEST, junit="gpu-tests.xml"
        ),
        gpu_only=True,
        dry_command=lambda c: c.pytest("-m", "gpu", GPU_TESTS),
    ),
    _one_test("sdpa-flash", "an unpadded batch decodes and replays on SDPA's flash kernel alone", 60, SDPA_FLASH_TEST),
    _one_test(
        "sync-debug",
        "no host synchronisation in an eviction step, under set_sync_debug_mode('error')",
        90,
        SYNC_DEBUG_TEST,
    ),
    Step(
        "sampler",
        f"the trace sampler's tokens/s, random-weight {SAMPLER_MODEL}",
        90,
        lambda c: c.figure_step("sampler"),
    ),
    Step(
        "prepare",
        f"random-weight {WORK_MODEL} folder, its sampled traces and their golden labels",
        120,
        lambda c: c.figure_step("prepare"),
    ),
    Step(
        "fit",
        "supervised fit steps/s from the example cache of the prepared traces",
        90,
        lambda c: c.figure_step("fit"),
        needs_work=True,
    ),
    Step(
        "rl",
        "reinforcement rollouts/s (G sampled replays of every prepared trace)",
        90,
        lambda c: c.figure_step("rl"),
        needs_work=True,
    ),
    Step(
        "capacity",
        f"`foresight bench capacity` of {CAPACITY_MODEL} ({CAPACITY_POLICIES})",
        240,
        _capacity,
        gpu_only=True,
        dry_command=lambda c: c.figure_step("capacity-flags"),
    ),
    Step("pipeline", "`foresight bench pipeline` on the prepared traces", 150, _pipeline, needs_work=True),
)


# -- the figure steps, each run in its own process ----------------------------------------------------------------
def _model_dtype(scale: Scale):
    import torch

    return getattr(torch, scale.dtype)


def _shrunk(scale: Scale) -> dict[str, int]:
    """The architecture overrides of the scale's models: the tiny sizes in the dry run, none on the GPU."""
    from foresight.models import TINY_SIZES

    return dict(TINY_SIZES) if scale.tiny else {}


def _synchronise(scale: Scale) -> float:
    import torch

    if scale.device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def optional_packages() -> dict[str, str]:
    """The installed version of each of `OPTIONAL_PACKAGES` (faster kernels and engines the runtime may use),
    or "absent", read from the installed metadata without importing them (vLLM's import alone takes seconds)."""
    import importlib.util
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for module, distributions in OPTIONAL_PACKAGES.items():
        found[module] = "absent"
        if importlib.util.find_spec(module) is None:
            continue
        for distribution in distributions:
            try:
                found[module] = version(distribution)
                break
            except PackageNotFoundError:
                found[module] = "present (version unknown)"
    return found


def step_imports(scale: Scale, work: Path) -> dict:
    """Import every package (naming all that fail), then the device, the versions and which optional kernel
    and engine packages are installed."""
    import importlib
    from importlib.metadata import version

    versions, missing = {}, []
    for name, distribution in PACKAGES.items():
        try:
            importlib.import_module(name)
            versions[distribution] = version(distribution)
        except Exception as error:  # noqa: BLE001 - every failure is reported, by name
            missing.append(f"{name} ({type(error).__name__}: {error})")
    import foresight.cli  # noqa: F401 - the project itself
    import trainers.supervised  # noqa: F401

    if missing:
        raise SystemExit("cannot import: " + "; ".join(missing))
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        properties = torch.cuda.get_device_properties(0)
        device = f"{properties.name}, {properties.total_memory / 2**30:.0f} GiB"
    else:
        device = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    return {
        "device": device,
        "cuda": torch.version.cuda if cuda else None,
        "python": platform.python_version(),
        "versions": versions,
        "optional": optional_packages(),
    }


def step_sampler(scale: Scale, work: Path) -> dict:
    """Tokens/s of `sample_completions` with every row decoding at once, no EOS (every row runs to the end), and
    the device's seconds of the rows' (batched) admission and of decoding apart."""
    import torch

    from foresight.data.sampler import Request, SamplerSeconds, sample_completions
    from foresight.models import random_model
    from foresight.runtime.sampling import REASONING_SAMPLING

    model = random_model(ROOT / SAMPLER_MODEL, dtype=_model_dtype(scale), device=scale.device, **_shrunk(scale))
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    requests = [
        Request(row, torch.randint(3, vocab, (scale.sampler_prompt,), generator=generator).tolist(), seed=row)
        for row in range(scale.sampler_rows)
    ]

    def sample(batch: list[Request], tokens: int, parts: SamplerSeconds) -> int:
        completions = sample_completions(
            model,
            batch,
            max_new_tokens=tokens,
            eos_token_ids=[],
            sampling=REASONING_SAMPLING,
            batch_size=len(batch),
            seconds=parts,
        )
        return sum(len(completion.tokens) for completion in completions)

    sample(requests[:2], 2, SamplerSeconds())  # warm-up: kernels and allocator
    parts = SamplerSeconds()
    started = _synchronise(scale)
    tokens = sample(requests, scale.sampler_tokens, parts)
    seconds = _synchronise(scale) - started
    return {
        "model": SAMPLER_MODEL,
        "dtype": scale.dtype,
        "rows": scale.sampler_rows,
        "prompt_tokens": scale.sampler_prompt,
        "new_tokens": scale.sampler_tokens,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds,
        "admission_seconds": parts.admission_seconds,
        "admission_forwards": parts.admissions,
        "decode_seconds": parts.decode_seconds,
        "decode_tokens_per_second": tokens / parts.decode_seconds,
    }


def step_decode_graph(scale: Scale, work: Path) -> dict:
    """Per batch size of `graph_rows`: the median ms of a decode step (the device's: CUDA events) of SnapKV and the
    learned policy (a random scorer of the model's shape) at B = budget, L = interval, eager and with the static step
    in a CUDA graph (on the CPU, run eagerly), their ms per eviction step, and a bare transformers loop's (a full
    DynamicCache, no eviction) over the same tokens. Every row evicts at its prefill and every L tokens after."""
    import statistics

    import torch
    from transformers import DynamicCache

    from foresight.bench.common import random_scorer
    from foresight.cache_argument import cache_argument
    from foresight.policies import make_policy
    from foresight.runtime.engine import EvictionConfig, EvictionEngine

    model = random_model_of(SAMPLER_MODEL, scale)
    scorer = random_scorer(model, scale.budget, scale.interval)
    config = EvictionConfig(scale.budget, scale.interval)
    graph = "graph" if scale.device == "cuda" else "static"
    generator = torch.Generator().manual_seed(0)
    rows = {}
    for batch in map(int, scale.graph_rows.split(",")):
        prompts = torch.randint(3, model.config.vocab_size, (batch, scale.graph_prompt), generator=generator).tolist()
        row = {"bare_ms": _bare_decode_ms(model, prompts, scale, DynamicCache, cache_argument)}
        for name, options in (("snapkv", {}), ("foresight", {"scorer": scorer})):
            for mode in ("eager", graph):
                engine = EvictionEngine(model, make_policy(name, **options), config, decode_step=mode)
                stats = engine.generate(prompts, scale.graph_tokens).stats
                row[f"{name}_{mode}_ms"] = 1000 * statistics.median(stats.step_seconds[2:])
                row[f"{name}_{mode}_eviction_ms"] = 1000 * stats.eviction_seconds / max(stats.evictions, 1)
            row[f"{name}_speedup"] = row[f"{name}_eager_ms"] / row[f"{name}_{graph}_ms"]
        rows[str(batch)] = row
    return {
        "model": SAMPLER_MODEL,
        "dtype": scale.dtype,
        "decode_step": graph,
        "budget": scale.budget,
        "interval": scale.interval,
        "prompt": scale.graph_prompt,
        "tokens": scale.graph_tokens,
        "rows": rows,
    }


def random_model_of(config: str, scale: Scale):
    from foresight.models import random_model

    return random_model(ROOT / config, dtype=_model_dtype(scale), device=scale.device, **_shrunk(scale))


def _bare_decode_ms(model, prompts: list[list[int]], scale: Scale, cache_class, cache_argument) -> float:
    """Median ms of a decode step of a plain transformers loop (greedy, a full DynamicCache), timed on the host
    after synchronising."""
    import statistics

    import torch

    cache = cache_class(config=model.config)
    tokens = torch.tensor(prompts, device=model.device)
    with torch.no_grad():
        logits = model(input_ids=tokens, **cache_argument(model, cache), use_cache=True).logits
        seconds = []
        for _ in range(scale.graph_tokens):
            started = _synchronise(scale)
            token = logits[:, -1].argmax(-1, keepdim=True)
            logits = model(input_ids=token, **cache_argument(model, cache), use_cache=True).logits
            seconds.append(_synchronise(scale) - started)
    return 1000 * statistics.median(seconds[2:])


def _work_model_dir(work: Path) -> Path:
    return work / "model"


def step_prepare(scale: Scale, work: Path) -> dict:
    """A random-weight model folder (the tests' character tokenizer, vocabulary 128), `traces` traces sampled
    from it to `trace_tokens` new tokens (no EOS) and their golden labels at (budget, interval)."""
    sys.path.insert(0, str(ROOT))
    from foresight.data.trace_generation import generate_traces
    from foresight.models import random_model
    from tests.prompts import CHAT_TEMPLATE, DATA, char_tokenizer
    from trainers.data_stage import FrozenModel, make_labels

    folder = _work_model_dir(work)
    started = time.perf_counter()
    model = random_model(
        ROOT / WORK_MODEL,
        dtype=_model_dtype(scale),
        device=scale.device,
        vocab_size=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        **_shrunk(scale),
    )
    tokenizer = char_tokenizer(CHAT_TEMPLATE)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model.generation_config.eos_token_id = []  # random weights: no EOS, every trace runs to its length
    summary = generate_traces(
        model,
        tokenizer,
        str(DATA / "arithmetic.jsonl"),
        num=scale.traces,
        max_new_tokens=scale.trace_tokens,
        out_dir=work / "traces",
        batch_size=scale.traces,
        progress=False,
        model_name=str(folder),
    )
    traced = time.perf_counter()
    del model
    make_labels(
        FrozenModel(str(folder), scale.device, _model_dtype(scale)),
        work / "traces",
        scale.budget,
        scale.interval,
        progress=False,
    )
    counts = summary.counts
    return {
        "model": WORK_MODEL,
        "traces": counts.kept,
        "tokens": counts.tokens,
        "new_tokens": scale.trace_tokens,
        "seconds_model_and_traces": traced - started,
        "seconds_labels": time.perf_counter() - traced,
    }


def _pipeline_settings(scale: Scale, work: Path):
    from foresight.bench.pipeline import Settings

    return Settings(
        traces=work / "traces",
        budget=scale.budget,
        interval=scale.interval,
        policy="snapkv",
        fit_steps=scale.fit_steps,
        batch_size=2,
        group_size=scale.group_size,
        device=scale.device,
        dtype=scale.dtype,
    )


def step_fit(scale: Scale, work: Path) -> dict:
    """The example cache of the prepared traces (`foresight examples`), then `fit_steps` steps of the supervised
    fit from it, as `foresight bench pipeline` times them (after the first)."""
    from foresight.bench.pipeline import _data_module, _fit
    from trainers.preparation import make_examples

    settings = _pipeline_settings(scale, work)
    data = _data_module(settings, str(_work_model_dir(work)), str(work / "examples"))
    started = time.perf_counter()
    make_examples(data.frozen, data.examples, progress=False)
    examples_seconds = time.perf_counter() - started
    row = _fit(data, settings)
    return {
        "examples_seconds": examples_seconds,
        "steps": row.work,
        "seconds": row.seconds,
        "steps_per_second": row.rate,
        "traces_per_step": settings.batch_size,
    }


def step_rl(scale: Scale, work: Path) -> dict:
    """G sampled rollouts of every prepared trace under a fresh scorer (`foresight bench pipeline`'s rollouts
    row), after one warm-up group."""
    from foresight.bench.common import random_scorer
    from foresight.bench.pipeline import _rollout_row
    from foresight.data.trace_store import TraceStore
    from trainers.data_stage import FrozenModel

    settings = _pipeline_settings(scale, work)
    model = FrozenModel(str(_work_model_dir(work)), scale.device, settings.run_dtype).load()[0]
    scorer = random_scorer(model, settings.budget, settings.interval)
    traces = list(TraceStore(settings.traces))
    _rollout_row(model, scorer, traces[:1], 2, "warm-up", "")
    row = _rollout_row(model, scorer, traces, scale.group_size, "rl rollouts", "")
    rollouts = scale.group_size * len(traces)
    return {
        "group_size": scale.group_size,
        "traces": len(traces),
        "trace_tokens": row.work / rollouts,
        "rollouts": rollouts,
        "seconds": row.seconds,
        "rollouts_per_second": rollouts / row.seconds,
        "tokens_per_second": row.rate,
        "forward_share": row.forward_share,
    }


def step_capacity_flags(scale: Scale, work: Path) -> dict:
    """The capacity step's command parsed by the CLI and turned into the benchmark's settings, not run (it needs CUDA)."""
    from foresight.cli import build_parser
    from foresight.commands._grammar import settings_from

    command = _capacity(Context(scale, True, work, work))
    args = build_parser().parse_args(command[command.index("foresight.cli") + 1 :])
    settings = settings_from(args.benchmark.Settings, args)
    return {
        "policies": settings.policy_names,
        "lengths": list(settings.lengths),
        "budget": settings.budget,
        "interval": settings.interval,
    }


FIGURE_STEPS = {
    "imports": step_imports,
    "decode-graph": step_decode_graph,
    "capacity-flags": step_capacity_flags,
    "sampler": step_sampler,
    "prepare": step_prepare,
    "fit": step_fit,
    "rl": step_rl,
}


# -- the driver ------------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    name: str
    what: str
    status: str
    seconds: float
    cap_seconds: float
    command: str
    figures: dict = field(default_factory=dict)
    output_tail: str = ""


def run_step(step: Step, context: Context, cap: float, log) -> Outcome:
    """Run one step's process under `cap` seconds; its status, seconds, figures and the tail of its output."""
    cuda_missing = step.gpu_only and context.dry_run
    command = (step.dry_command if cuda_missing else step.command)(context)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    started = time.perf_counter()
    log.write(f"\n===== {step.name}: {' '.join(command)}\n")
    log.flush()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=cap)
        output, rc, timed_out = done.stdout + done.stderr, done.returncode, False
    except subprocess.TimeoutExpired as expired:
        output = _text(expired.stdout) + _text(expired.stderr)
        rc, timed_out = None, True
    seconds = time.perf_counter() - started
    log.write(output)
    figures = _figures(step, context, output)
    if timed_out:
        status = f"timed out after {cap:.0f} s"
    elif rc != 0:
        status = f"failed (rc {rc})"
    elif cuda_missing:
        status = "skipped: no CUDA (its tests and flags resolve)"
    else:
        status = "passed"
    return Outcome(step.name, step.what, status, seconds, cap, " ".join(command), figures, output[-3000:])


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")


def _figures(step: Step, context: Context, output: str) -> dict:
    """A figure step's JSON line, a test step's counts (JUnit XML), a benchmark's report section."""
    lines = [line for line in output.splitlines() if line.startswith(FIGURES)]
    if lines:
        return json.loads(lines[-1][len(FIGURES) :])
    collected = re.search(r"^(\d+)(?:/\d+)? tests? collected", output, re.MULTILINE)
    if collected:  # a dry run's --collect-only
        return {"collected": int(collected[1])}
    junit = context.work / f"{step.name}.xml"
    if junit.exists():
        return _junit_counts(junit)
    report = context.out / "bench.md"
    marker = f"<!-- {step.name}-acceptance:start -->"
    if report.exists() and marker in (text := report.read_text()):
        return {"section": text.split(marker, 1)[1].split(f"<!-- {step.name}-acceptance:end -->", 1)[0].strip()}
    return {}


def _junit_counts(path: Path) -> dict:
    root = ElementTree.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    return {**counts, "failed_tests": failed}


def run_all(context: Context, total_seconds: float, only: list[str] | None = None) -> dict:
    """Every step in order (`only` and the imports step, if given) under its cap and what is left of
    `total_seconds`; the report is rewritten after each step, so a run cut short still leaves one."""
    context.out.mkdir(parents=True, exist_ok=True)
    if only is None or "prepare" in only:  # a fresh model folder, traces and example cache
        shutil.rmtree(context.work, ignore_errors=True)
    context.work.mkdir(parents=True, exist_ok=True)
    (context.out / "bench.md").unlink(missing_ok=True)
    started = time.perf_counter()
    outcomes: list[Outcome] = []
    with open(context.out / "acceptance.log", "w") as log:
        for step in STEPS:
            if only and step.name not in (*only, "imports"):
                continue
            left = total_seconds - (time.perf_counter() - started)
            prepare = next((o for o in outcomes if o.name == "prepare"), None)
            prepared = prepare.status == "passed" if prepare else (context.work / "traces").is_dir()  # an earlier run's
            if left < LEAST_STEP_SECONDS:
                outcomes.append(Outcome(step.name, step.what, "skipped: out of time", 0.0, 0.0, ""))
            elif step.needs_work and not prepared:
                outcomes.append(Outcome(step.name, step.what, "skipped: prepare did not pass", 0.0, 0.0, ""))
            else:
                outcomes.append(run_step(step, context, min(step.cap_seconds, left), log))
            print(f"{step.name}: {outcomes[-1].status} ({outcomes[-1].seconds:.1f} s)", flush=True)
            record = _record(context, outcomes, time.perf_counter() - started, total_seconds)
            (context.out / "acceptance.json").write_text(json.dumps(record, indent=2) + "\n")
            (context.out / "acceptance.md").write_text(markdown(record))
    return record


def _record(context: Context, outcomes: list[Outcome], seconds: float, total_seconds: float) -> dict:
    imports = next((o.figures for o in outcomes if o.name == "imports"), {})
    return {
        "mode": "cpu-dry-run" if context.dry_run else "cuda",
        "command": context.command,
        "device": imports.get("device", "unknown (the imports step did not pass)"),
        "cuda": imports.get("cuda"),
        "python": imports.get("python"),
        "versions": imports.get("versions", {}),
        "optional": imports.get("optional", {}),
        "scale": asdict(context.scale),
        "seconds": seconds,
        "total_seconds": total_seconds,
        "steps": [asdict(outcome) for outcome in outcomes],
    }


def markdown(record: dict) -> str:
    """The report: the device and versions, one row per step, then each step's figures."""
    versions = ", ".join(f"{name} {version}" for name, version in record["versions"].items())
    lines = [
        f"# GPU acceptance run ({record['mode']})",
        "",
        f"Device: {record['device']}"
        + (f", CUDA {record['cuda']}" if record["cuda"] else "")
        + f"; Python {record['python']}.",
        "",
        f"Versions: {versions or 'unknown'}.",
        "",
        "Optional kernels and engines: "
        + (", ".join(f"{name} {found}" for name, found in record["optional"].items()) or "unknown")
        + ".",
        "",
        f"Command: `{record['command']}`; {record['seconds']:.1f} s of the {record['total_seconds']:.0f} s allowed.",
        "",
        "| step | what it checks or measures | status | seconds | cap |",
        "|---|---|---|---:|---:|",
    ]
    for step in record["steps"]:
        lines.append(
            f"| {step['name']} | {step['what']} | {step['status']} | {step['seconds']:.1f} | {step['cap_seconds']:.0f} |"
        )
    for step in record["steps"]:
        figures = {
            key: value
            for key, value in step["figures"].items()
            if key not in ("versions", "optional", "device", "python")
        }
        section = figures.pop("section", None)
        if not step["command"]:  # not run
            continue
        lines += ["", f"## {step['name']}", "", f"Command: `{step['command']}`"]
        if figures:
            lines += [
                "",
                "| figure | value |",
                "|---|---|",
                *(f"| {key} | {_value(value)} |" for key, value in figures.items()),
            ]
        if section:
            lines += ["", section]
        if not step["status"].startswith(("passed", "skipped")):
            lines += ["", "Output (end):", "", "```", step["output_tail"][-1500:], "```"]
    return "\n".join(lines) + "\n"


def _value(value) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="tiny shapes on the CPU; GPU-only steps check that their tests and flags resolve",
    )
    mode.add_argument("--cuda", action="store_true", help="the CUDA machine's shapes (the default)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT", "runs/gpu-acceptance")),
        help="folder of the report (default: $OUT, else runs/gpu-acceptance)",
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "foresight-gpu-acceptance",
        help="scratch folder: the prepared model, traces and example cache, the tests' XML; kept, so that "
        "`--only fit,rl` reruns on what `prepare` made (default: %(default)s)",
    )
    parser.add_argument(
        "--total-seconds",
        type=float,
        default=None,
        help="deadline of the whole run (default: 510 with CUDA, 600 for the dry run)",
    )
    parser.add_argument(
        "--only", default=None, help=f"comma-separated steps to run, of: {', '.join(s.name for s in STEPS)}"
    )
    parser.add_argument(
        "--step", choices=sorted(FIGURE_STEPS), help=argparse.SUPPRESS
    )  # one figure step, in this process
    args = parser.parse_args(argv)
    scale = DRY_SCALE if args.cpu_dry_run else CUDA_SCALE
    if args.step:
        print(FIGURES + json.dumps(FIGURE_STEPS[args.step](scale, args.work)))
        return 0
    only = [name.strip() for name in args.only.split(",")] if args.only else None
    unknown = sorted(set(only or ()) - {s.name for s in STEPS})
    if unknown:
        parser.error(f"unknown step {unknown[0]!r}; choose from: {', '.join(s.name for s in STEPS)}")
    total = args.total_seconds or (600.0 if args.cpu_dry_run else 510.0)
    command = shlex.join(["scripts/gpu-acceptance.sh", *(sys.argv[1:] if argv is None else argv)])
    context = Context(scale, args.cpu_dry_run, args.out.resolve(), args.work.resolve(), command)
    record = run_all(context, total, only)
    failed = [s["name"] for s in record["steps"] if not s["status"].startswith(("passed", "skipped: no CUDA"))]
    print(
        f"wrote {context.out / 'acceptance.md'}: {len(record['steps']) - len(failed)} of {len(record['steps'])} steps "
        f"passed or skipped for want of CUDA" + (f"; not passed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
