"""Teacher-forced mean NLL of a text under eviction, against the full cache."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from foresight.commands._model import add_model_arguments, model_options
from foresight.commands._policy import add_policy_arguments, policy_from_args
from foresight.metrics import loss_ratio, scored_tokens
from foresight.models import load_model
from foresight.policies import make_policy
from foresight.runtime.engine import EvictionEngine, ReplayOutput


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file", type=Path, help="a text file (one document) or a JSONL file of {'text'} or {'prompt', 'completion'}"
    )
    add_model_arguments(parser)
    add_policy_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=2048, help="truncate each document to this many tokens")


def read_documents(path: Path, tokenizer, max_tokens: int) -> list[tuple[torch.Tensor, int]]:
    """(token ids, prompt length) per document; plain text is one document with a one-token prompt."""
    text = path.read_text()
    if path.suffix != ".jsonl":
        return [(torch.tensor(tokenizer.encode(text)[:max_tokens]), 1)]
    documents = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{number} is not JSON; a JSONL file has one JSON object per line") from None
        if "text" in record:
            prompt, completion = "", record["text"]
        elif "prompt" in record and "completion" in record:
            prompt, completion = record["prompt"], record["completion"]
        else:
            raise ValueError(f"{path}:{number} has neither 'text' nor 'prompt' and 'completion'")
        prompt_ids = tokenizer.encode(prompt) if prompt else []
        ids = (prompt_ids + tokenizer.encode(completion, add_special_tokens=not prompt_ids))[:max_tokens]
        documents.append((torch.tensor(ids), max(1, min(len(prompt_ids), len(ids)))))
    return documents


def loss_ratio_after_first_eviction(full: ReplayOutput, evicted: ReplayOutput) -> tuple[float, int]:
    """Mean NLL with eviction / with the full cache over tokens predicted after each row's first
    eviction (docs/algorithms.md section 8), and how many tokens that is (0: nothing was evicted)."""
    masks = [scored_tokens(len(nll), first) for nll, first in zip(evicted.nll, evicted.first_eviction)]
    scored = sum(int(m.sum()) for m in masks)
    if scored == 0:
        return float("nan"), 0
    evicted_nll = torch.cat([n[m] for n, m in zip(evicted.nll, masks)])
    full_nll = torch.cat([n[m] for n, m in zip(full.nll, masks)])
    return loss_ratio(evicted_nll, full_nll), scored


def run(args: argparse.Namespace) -> int:
    policy, config = policy_from_args(args)
    if config is None:
        raise ValueError("replay compares an evicting policy with the full cache; choose a policy other than 'full'")
    if not args.file.is_file():
        raise ValueError(f"replay file {str(args.file)!r} does not exist")
    model, tokenizer = load_model(args.model, **model_options(args))
    documents = read_documents(args.file, tokenizer, args.max_tokens)
    sequences, prompt_lengths = [d[0] for d in documents], [d[1] for d in documents]
    total = sum(len(s) - p for s, p in documents)
    results = {}
    for name, engine in (
        ("full", EvictionEngine(model, make_policy("full"))),
        (policy.name, EvictionEngine(model, policy, config)),
    ):
        with tqdm(total=total, desc=f"{name} replay", unit="tok") as bar:
            results[name] = engine.replay(sequences, prompt_lengths, on_tokens=bar.update)
    ratio, scored = loss_ratio_after_first_eviction(results["full"], results[policy.name])
    if scored == 0:
        print(f"no eviction: every document is shorter than B + L = {config.budget + config.interval} tokens")
        return 0
    print(
        f"{policy.name} B={config.budget} L={config.interval}: loss ratio {ratio:.4f} over {scored} tokens after the first eviction"
    )
    return 0
