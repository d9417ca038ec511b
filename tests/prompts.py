"""Prompts of the tests: the character tokenizer of the tiny models and its chat template, the prompt files
under data/, traces sampled from its arithmetic prompts, and random prompts of given lengths."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from foresight.data.trace_generation import generate_traces
from foresight.models import tiny_model

DATA = Path(__file__).resolve().parents[1] / "data"
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def char_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """One token per printable ASCII character (id = code point) plus <pad> 0, <s> 1, </s> 2: the
    special ids of foresight.models.tiny_model, whose 128-token vocabulary it fits."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "\n": 10, **{chr(code): code for code in range(32, 127)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = chat_template
    return tokenizer


def arithmetic_traces(model, out: Path, num: int, max_new_tokens: int) -> Path:
    """`num` traces of data/arithmetic.jsonl's prompts that `model` (with the character tokenizer) completes
    to at most `max_new_tokens`, written to `out` as the traces of model "tiny"."""
    tokenizer = char_tokenizer(CHAT_TEMPLATE)
    path = str(DATA / "arithmetic.jsonl")
    generate_traces(
        model, tokenizer, path, out_dir=out, num=num, max_new_tokens=max_new_tokens, progress=False, model_name="tiny"
    )
    return out


def sampled_tiny_traces(source: str, out: Path, num: int, model_name: str) -> Path:
    """`num` traces of `source` that the tiny Llama samples at temperature 1 (no filtering), at most 40 new tokens,
    written to `out` as the traces of `model_name` (the folder the tiny model was saved to)."""
    model, tokenizer = tiny_model("llama"), char_tokenizer(CHAT_TEMPLATE)
    generate_traces(
        model,
        tokenizer,
        source,
        out_dir=out,
        num=num,
        max_new_tokens=40,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        progress=False,
        model_name=model_name,
    )
    return out


def write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths, of random ids in 3..127 (no special token of the tiny models)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=generator).tolist() for n in lengths]


def prompts(lengths, seed=0, vocab=128):
    """Prompts of the given lengths, of random ids in 1..vocab - 1."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in lengths]
