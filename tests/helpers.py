"""Helpers shared by several test modules: the tiny models' tokenizer and prompt files, random eviction
steps of the policy tests, the scorer as independent MLPs, and synthetic supervised examples.

Test modules import from here (or take fixtures from conftest.py), never from one another.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from torch import nn
from transformers import PreTrainedTokenizerFast

from foresight.models import describe, tiny_model
from foresight.scorer import ForesightScorer

# -- prompts and the character tokenizer of the tiny models ----------------------------------------
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
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths, of random ids in 3..127 (no special token of the tiny models)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=generator).tolist() for n in lengths]


# -- random eviction steps of the policy tests ------------------------------------------------------
KV_HEADS = 2
INVALID_PER_ROW = (0, 3)  # left padding / eviction leftovers in front of row 1


def candidate_positions(generator: torch.Generator, window_start: int, candidates: int) -> torch.Tensor:
    """[batch, Hkv, C]: each head its own sorted candidate positions below `window_start`,
    after the row's invalid (-1) slots."""
    rows = []
    for invalid in INVALID_PER_ROW:
        heads = []
        for _ in range(KV_HEADS):
            chosen = torch.randperm(window_start, generator=generator)[: candidates - invalid].sort().values
            heads.append(torch.cat([torch.full((invalid,), -1), chosen]))
        rows.append(torch.stack(heads))
    return torch.stack(rows)


# -- the learned scorer -----------------------------------------------------------------------------
def independent_mlp(scorer: ForesightScorer, layer: int, head: int) -> nn.Sequential:
    """The paper's per-(layer, head) MLP as plain modules, holding the stacked weights of that slice."""
    config = scorer.config
    mlp = nn.Sequential(nn.Linear(config.input_dim, config.hidden), nn.GELU(), nn.Linear(config.hidden, 1))
    with torch.no_grad():
        mlp[0].weight.copy_(scorer.w1[layer, head].T)
        mlp[0].bias.copy_(scorer.b1[layer, head])
        mlp[2].weight.copy_(scorer.w2[layer, head][None])
        mlp[2].bias.copy_(scorer.b2[layer, head][None])
    return mlp


# -- synthetic examples of the supervised stage -----------------------------------------------------
SUPERVISED_B, SUPERVISED_L = 16, 4


def scorer_spec(model=None) -> dict:
    """The scorer fields the data module fixes, for a tiny Llama (or `model`) at B=16, L=4."""
    shape = describe(model or tiny_model("llama"))
    return dict(num_layers=shape.num_layers, num_query_heads=shape.num_query_heads, num_kv_heads=shape.num_kv_heads,
                head_dim=shape.head_dim, budget=SUPERVISED_B, interval=SUPERVISED_L, base_model="tiny",
                feature_set="paper")


def synthetic_traces(count: int, steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Traces whose α is a fixed linear function of the keys plus one feature: learnable by the scorer."""
    spec = scorer_spec()
    generator = torch.Generator().manual_seed(seed)
    direction = torch.randn(spec["head_dim"], generator=torch.Generator().manual_seed(99))
    shape = (steps, spec["num_layers"], spec["num_kv_heads"], SUPERVISED_B)
    traces = []
    for _ in range(count):
        keys = torch.randn(*shape, spec["head_dim"], generator=generator)
        features = torch.rand(*shape, 6 * spec["num_query_heads"] // spec["num_kv_heads"], generator=generator)
        alpha = torch.sigmoid(keys @ direction + 2 * features[..., 4])
        traces.append({"keys": keys, "values": torch.randn(*shape, spec["head_dim"], generator=generator),
                       "features": features, "alpha": alpha})
    return traces
