"""Generate text with the KV cache held to a budget by an eviction policy."""

from __future__ import annotations

import argparse

from tqdm import tqdm

from foresight.commands._model import add_model_arguments, model_options
from foresight.commands._policy import add_policy_arguments, policy_from_args
from foresight.commands._sampling import add_sampling_arguments
from foresight.data.tasks import chat_prompt_ids
from foresight.models import load_model
from foresight.runtime.engine import EvictionEngine
from foresight.runtime.sampling import SamplingConfig
from foresight.runtime.static_decode import DecodeStep


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="+", help="one or more prompts (several are decoded as one batch)")
    add_model_arguments(parser)
    add_policy_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=512, help="most tokens generated per prompt")
    parser.add_argument(
        "--decode-step",
        choices=[step.value for step in DecodeStep],
        default=DecodeStep.EAGER.value,
        help="how decode forwards run: eager; static, at fixed shapes over every slot; graph, that step in a CUDA "
        "graph replayed at every token (CUDA only; docs/algorithms.md section 1)",
    )
    add_sampling_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    parser.add_argument("--no-chat-template", action="store_true", help="encode the prompt as plain text")


def run(args: argparse.Namespace) -> int:
    policy, config = policy_from_args(args)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
    model, tokenizer = load_model(args.model, **model_options(args))
    prompts = [
        tokenizer.encode(text) if args.no_chat_template else chat_prompt_ids(tokenizer, text) for text in args.prompt
    ]
    engine = EvictionEngine(model, policy, config, decode_step=args.decode_step)
    with tqdm(total=args.max_new_tokens, desc=f"{policy.name} decode", unit="tok") as bar:
        output = engine.generate(
            prompts,
            args.max_new_tokens,
            sampling,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id or 0,
            on_token=lambda count: bar.update(count - bar.n),
        )
    for tokens in output.tokens:
        print(tokenizer.decode(tokens, skip_special_tokens=True))
        print()
    stats = output.stats
    decoded = sum(len(t) for t in output.tokens)
    seconds = sum(stats.step_seconds)
    note = (
        ""
        if stats.evictions or config is None
        else f" (no eviction: the sequence never reached B + L = {config.budget + config.interval})"
    )
    print(
        f"{decoded} tokens at {len(stats.step_seconds) * len(prompts) / max(seconds, 1e-9):.1f} tokens/s, "
        f"largest cache held {stats.max_entries} entries, {stats.evictions} eviction steps{note}"
    )
    return 0
