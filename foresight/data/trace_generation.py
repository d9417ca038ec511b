"""Reasoning-trace generation (ForesightKV §3.2 and App. E.1): sample with the full cache into shards.

Each problem samples with its own generator seeded from (seed, problem index), so a trace does not
depend on the batch size, the shards, the other problems or an interruption. Every token's full-cache
loss and entropy come from the predictions made while sampling; the shards go through
`foresight.data.trace_store`.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from foresight.data.sampler import Completion, Request, auto_batch_size, chunked_losses, sample_completions
from foresight.data.tasks import Problem, chat_prompt_ids, check_answer, load_problems, recorded_source
from foresight.data.trace_store import ShardRows, ShardWriter, TraceCounts, TraceRunSummary, TraceSettings
from foresight.runtime.sampling import REASONING_SAMPLING, Draws, SamplingConfig

LOSS_CHUNK = 1024  # positions per LM-head chunk: 1024 x 49K vocab x 4 bytes = 200 MB of logits


def check_plain_logits(model) -> None:
    """Refuse a model whose logits are soft-capped: the stored losses read the LM head directly."""
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"model {model.name_or_path!r} soft-caps its logits, which trace losses do not apply")


@torch.inference_mode()
def token_losses(model, input_ids: torch.Tensor, chunk_size: int = LOSS_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-cache teacher-forced loss and entropy of one sequence, both [T - 1] float32 on CPU.

    One forward through the decoder, then the LM head over chunks of positions so that the
    [T, vocab] logits never exist at once.
    """
    check_plain_logits(model)
    ids = input_ids.to(model.device).unsqueeze(0)
    hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
    return chunked_losses(model.get_output_embeddings(), hidden, ids[0, 1:], chunk_size)


def generate_traces(
    model,
    tokenizer,
    source: str,
    *,
    num: int,
    max_new_tokens: int,
    out_dir: str | os.PathLike,
    temperature: float = REASONING_SAMPLING.temperature,
    top_k: int = REASONING_SAMPLING.top_k,
    top_p: float = REASONING_SAMPLING.top_p,
    min_tokens: int = 0,
    only_correct: bool = False,
    batch_size: int | None = None,
    shard_size: int = 64,
    shard: tuple[int, int] = (0, 1),
    seed: int = 0,
    draws: str | Draws | None = None,
    progress: bool = True,
    model_name: str | None = None,
) -> TraceRunSummary:
    """Sample one trace per problem of ``source`` (see foresight.data.tasks; a weighted mixture of
    sources too) into ``out_dir``.

    Sampling follows the paper's evaluation settings (T = 0.6, top-k 20, top-p 0.95; temperature 0
    is greedy; the model's ``generation_config`` is not read). Up to ``batch_size`` problems decode
    together by continuous batching (None: sized to the machine, `foresight.data.sampler.auto_batch_size`).
    A trace is kept when its length (prompt + completion) is at least ``min_tokens`` and, with
    ``only_correct``, its answer checks as correct (App. E.1 keeps correct traces over 4096 tokens).
    ``shard=(i, n)`` makes this call write only shards k with k % n == i. ``draws``: where each problem's
    random numbers come from (`foresight.runtime.sampling.Draws`; None: the device's, `Draws.resolve`), recorded, since
    the two sample different traces. ``model_name`` (default: the model's ``name_or_path``) is recorded and
    checked on reruns.
    """
    index, count = shard
    if not 0 <= index < count:
        raise ValueError(f"shard must be i/n with 0 <= i < n, got {index}/{count}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    settings = TraceSettings(
        model=model.name_or_path if model_name is None else model_name,
        source=recorded_source(source),
        num=num,
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_k=top_k,
        top_p=float(top_p),
        min_tokens=min_tokens,
        only_correct=only_correct,
        seed=seed,
        shard_size=shard_size,
        draws=Draws.resolve(draws, model.device, temperature).value,
    )
    check_plain_logits(model)
    eos_ids = eos_token_ids(model, tokenizer, settings.model)
    problems = load_problems(source, num, seed)
    writer = ShardWriter(Path(out_dir), settings)
    owned, todo = writer.claim(index, count)
    prompts = {i: chat_prompt_ids(tokenizer, problems[i].prompt) for k in todo for i in settings.shard_range(k)}
    if batch_size is None:
        batch_size = auto_batch_size(model, max(map(len, prompts.values()), default=0) + max_new_tokens)
    batch_size = min(batch_size, max(len(prompts), 1))  # a slot no problem takes would hold memory for nothing
    requests = (Request(i, prompt, problem_seed(seed, i)) for i, prompt in prompts.items())
    sampling = SamplingConfig(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p)
    shards = {k: ShardRows(settings.shard_range(k)) for k in todo}
    shard_of = {i: k for k in todo for i in settings.shard_range(k)}
    with tqdm(total=len(prompts), disable=not progress, unit="problem", desc="traces") as bar:
        tokens = Counter()

        def count(n: int) -> None:
            tokens["sampled"] += n
            bar.set_postfix_str(f"{tokens['sampled']} tokens, {n} rows", refresh=False)

        completions = sample_completions(
            model,
            requests,
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos_ids,
            sampling=sampling,
            batch_size=batch_size,
            draws=settings.draws,
            on_token=count,
        )
        for completion in completions:
            k = shard_of[completion.key]
            rows = shards[k]
            rows.add(*sampled_trace(problems[completion.key], completion, tokenizer, settings))
            bar.update()
            if rows.is_complete():
                writer.write(k, rows.columns(), {"batch_size": batch_size, **rows.record()})
                del shards[k]
    return writer.summary(owned, written=len(todo))


def eos_token_ids(model, tokenizer, name: str) -> list[int]:
    """The ids that end a completion: the model's generation config, else the tokenizer's EOS."""
    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    if eos is None:
        raise ValueError(f"model {name!r} has no EOS token id, so a trace could never end")
    return [eos] if isinstance(eos, int) else list(eos)


def problem_seed(seed: int, index: int) -> int:
    """The sampling seed of one problem: a function of (seed, problem index) only."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def sampled_trace(
    problem: Problem, completion: Completion, tokenizer, settings: TraceSettings
) -> tuple[int, str, dict[str, Any] | None, TraceCounts]:
    """A sampled completion checked and filtered: (index, source, trace row or None, counts)."""
    return build_trace(
        problem,
        completion.prompt,
        completion.tokens,
        completion.truncated,
        tokenizer,
        settings.min_tokens,
        settings.only_correct,
        lambda: (completion.token_nll, completion.token_entropy),
    )


def build_trace(
    problem: Problem,
    prompt: list[int],
    completion: list[int],
    truncated: bool,
    tokenizer,
    min_tokens: int,
    only_correct: bool,
    losses: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[int, str, dict[str, Any] | None, TraceCounts]:
    """Check and filter one trace (kept when at least ``min_tokens`` long and, with ``only_correct``,
    correct); ``losses`` is called only for a kept trace. Returns (index, source, row or None, counts)."""
    text = tokenizer.decode(completion, skip_special_tokens=True)
    correct = check_answer(problem, text)
    counts = dict(generated=1, checked=int(correct is not None), correct=int(bool(correct)), truncated=int(truncated))
    input_ids = prompt + completion
    if len(input_ids) < min_tokens:
        return problem.index, problem.source, None, TraceCounts(too_short=1, **counts)
    if only_correct and not correct:
        return problem.index, problem.source, None, TraceCounts(incorrect=1, **counts)
    nll, entropy = losses()
    trace = dict(
        index=problem.index,
        source=problem.source,
        input_ids=input_ids,
        prompt_length=len(prompt),
        token_nll=nll.numpy(),
        token_entropy=entropy.numpy(),
        answer=problem.answer,
        correct=correct,
        prompt=problem.prompt,
        completion=text,
    )
    return problem.index, problem.source, trace, TraceCounts(kept=1, tokens=len(input_ids), **counts)
