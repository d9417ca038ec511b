"""Helpers shared by several test modules: the tiny models' tokenizer and prompt files, random eviction
steps of the policy tests, the scorer as independent MLPs, and synthetic supervised examples.

Test modules import from here (or take fixtures from conftest.py), never from one another.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from torch import nn
from transformers import PreTrainedTokenizerFast

from foresight.models import describe, tiny_model
from foresight.policies import POLICIES, EvictionContext, make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.scorer.model import ForesightScorer, ScorerConfig

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


STANDARDISED_NAMES = ("last_8", "last_16", "last_32", "recent_128", "decayed", "cumulative_rate", "log_age")


def loop_standardised_features(attention, state, positions, query_positions, names=STANDARDISED_NAMES):
    """A standardised set's features (`names`, per query head) before standardisation and the new state,
    one python float at a time: attention [batch, Hkv, G, l, N]; state {cumulative, decayed, recent:
    [batch, Hkv, N, G], observed: [batch, Hkv, N]}; positions [batch, Hkv, N]; query_positions [batch, l].
    Every query weighs factor ** (1 / tokens) per token it is older than the block's newest; "pooled_last_8"
    is the largest "last_8" among the slots n - 3 .. n + 3."""
    batch, kv_heads, group, rows, entries = attention.shape
    width = len(names)
    features = torch.zeros(batch, kv_heads, entries, group * width, dtype=torch.float64)
    new = {name: torch.zeros_like(value, dtype=torch.float64) for name, value in state.items()}

    def last(b, h, g, n, size):
        return sum(float(attention[b, h, g, q, n]) for q in range(max(0, rows - size), rows))

    for b, h, n in itertools.product(range(batch), range(kv_heads), range(entries)):
        position, queries = int(positions[b, h, n]), [int(q) for q in query_positions[b]]
        new["observed"][b, h, n] = float(state["observed"][b, h, n]) + sum(0 <= q and position <= q for q in queries)
        age = max(max(queries) - position, 0)
        for g in range(group):
            column = [float(attention[b, h, g, q, n]) for q in range(rows)]
            new["cumulative"][b, h, n, g] = float(state["cumulative"][b, h, n, g]) + sum(column)
            for name, factor, tokens in (("decayed", 0.9, 256), ("recent", 0.5, 128)):
                per_token = factor ** (1 / tokens)
                history = per_token**rows * float(state[name][b, h, n, g])
                new[name][b, h, n, g] = history + sum(per_token ** (rows - 1 - q) * a for q, a in enumerate(column))
            values = {f"last_{size}": last(b, h, g, n, size) for size in (1, 8, 16, 32)}
            values["pooled_last_8"] = max(last(b, h, g, m, 8) for m in range(max(0, n - 3), min(entries, n + 4)))
            values["recent_128"] = float(new["recent"][b, h, n, g])
            values["decayed"] = float(new["decayed"][b, h, n, g])
            values["cumulative_rate"] = float(new["cumulative"][b, h, n, g]) / max(float(new["observed"][b, h, n]), 1)
            for f, name in enumerate(names):
                value = math.log1p(age) if name == "log_age" else math.log(values[name] + 1e-6)
                features[b, h, n, g * width + f] = value
    return features, new


def loop_standardise(features: torch.Tensor, valid: torch.Tensor, eps: float = 1e-2) -> torch.Tensor:
    """Each column of features [batch, Hkv, C, W] standardised over the valid candidates valid [batch, Hkv, C]
    of its (row, head): (x - mean) / (population std + eps); invalid candidates 0."""
    out = torch.zeros_like(features, dtype=torch.float64)
    batch, kv_heads, candidates, width = features.shape
    for b, h, w in itertools.product(range(batch), range(kv_heads), range(width)):
        kept = [c for c in range(candidates) if valid[b, h, c]]
        xs = [float(features[b, h, c, w]) for c in kept]
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
        for c, x in zip(kept, xs):
            out[b, h, c, w] = (x - mean) / (std + eps)
    return out


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


# -- a random eviction step as the engine builds it ---------------------------------------------------
DIM, INTERVAL, CANDIDATES = 8, 4, 14
BATCH = len(INVALID_PER_ROW)
SCALING = DIM**-0.5


def clustered_keys(generator: torch.Generator, count: int) -> torch.Tensor:
    """Keys [batch, Hkv, count, D], half of them near one of three directions, so some pairs have
    cosine similarity above 0.5 and others do not."""
    centres = torch.randn(3, DIM, generator=generator) * 2.0
    near = centres[torch.randint(0, 3, (BATCH, KV_HEADS, count), generator=generator)]
    noise = torch.randn(BATCH, KV_HEADS, count, DIM, generator=generator)
    use_centre = torch.rand(BATCH, KV_HEADS, count, 1, generator=generator) < 0.5
    return torch.where(use_centre, near + noise, noise * 2.0)


def random_context(group: int, seed: int = 0, query_start: int | None = None) -> EvictionContext:
    """An eviction step as the engine builds it: C candidates below position 40, then the recent
    window of L entries at 40..43, whose tokens are the L buffered queries. `query_start` moves the
    queries back among the candidates, so the causal mask matters for candidates too."""
    generator = torch.Generator().manual_seed(seed)
    window_start = 40
    recent = torch.arange(window_start, window_start + INTERVAL)
    positions = torch.cat([candidate_positions(generator, window_start, CANDIDATES), recent.expand(BATCH, KV_HEADS, -1)], dim=-1)
    keys = clustered_keys(generator, CANDIDATES + INTERVAL)
    first_query = window_start if query_start is None else query_start
    return EvictionContext(
        layer_idx=0,
        num_layers=1,
        keys=keys,
        values=torch.randn(keys.shape, generator=generator),
        positions=positions,
        num_candidates=CANDIDATES,
        scaling=SCALING,
        queries=torch.randn(BATCH, KV_HEADS * group, INTERVAL, DIM, generator=generator) * 1.5,
        query_positions=torch.arange(first_query, first_query + INTERVAL).expand(BATCH, -1),
    )


def constructible_policies() -> list[str]:
    """Registered evicting policies that need no external artifact (labels, a scorer) to be built."""
    names = []
    for name, cls in sorted(POLICIES.items()):
        try:
            cls()
        except TypeError:
            continue
        if cls.evicts:
            names.append(name)
    return names


def prompts(lengths, seed=0, vocab=128):
    """Prompts of the given lengths, of random ids in 1..vocab - 1."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in lengths]


def random_scorer(model, seed: int = 0, **overrides) -> ForesightScorer:
    """A scorer for `model` (B = 12, L = 4 unless overridden) with weights large enough that its keep
    scores are far apart."""
    shape = describe(model)
    options = dict(num_layers=shape.num_layers, num_query_heads=shape.num_query_heads, num_kv_heads=shape.num_kv_heads,
                   head_dim=shape.head_dim, budget=12, interval=4, base_model="tiny-llama")
    torch.manual_seed(seed)
    scorer = ForesightScorer(ScorerConfig(**{**options, **overrides}))
    with torch.no_grad():  # larger weights than nn.Linear's init: keep scores far apart, evictions decisive
        scorer.w1.mul_(4)
    return scorer


# -- policies in half precision and batches against their rows alone ----------------------------------
SCORED = ("knorm", "streaming", "random", "h2o", "tova", "snapkv", "rkv", "lagkv", "lazy", "raas", "foresight")
GROUP = 2


def make(name: str, model=None):
    """The policy `name`; foresight gets a random scorer for B = 14, L = 4."""
    if name != "foresight":
        return make_policy(name)
    model = model or tiny_model("llama", num_attention_heads=2 * GROUP, head_dim=8, num_hidden_layers=1)
    return make_policy("foresight", scorer=random_scorer(model, budget=14, interval=4))


def keep_scores(policy, context: EvictionContext) -> torch.Tensor:
    """The policy's keep scores of one step, from fresh per-entry state."""
    policy.reset()
    shape = context.positions.shape
    for field in policy.state_fields:
        trailing = (GROUP,) if field.per_query_head else ()
        context.state[field.name] = torch.full((*shape, *trailing), field.fill, device=context.positions.device)
    context.state.update(policy.observe(context))
    return policy.keep_scores(context)


ROUNDING = {torch.bfloat16: 0.02, torch.float16: 0.004, torch.float32: 1e-4}
"""Largest logit difference between a row in a batch and alone, as a share of the largest |logit|:
a few units in the last place of the dtype (kernels for different shapes round differently)."""


def assert_decodes_alike(tokens, logits, reference_tokens, reference_logits, dtype: torch.dtype) -> int:
    """Two greedy decodings of the same prompt agree up to rounding: their logits [steps, vocab] agree
    within ROUNDING of the largest |logit| up to and including the first step where the tokens part
    (rounding may pick the other one of two near-equal logits; every later step has other inputs).
    A fault (padding attended, a wrong entry kept) moves logits by far more than rounding before any
    token can part. Returns the number of steps compared."""
    parted = next((step for step, (a, b) in enumerate(zip(tokens, reference_tokens)) if a != b), None)
    compared = min(len(tokens), len(reference_tokens)) if parted is None else parted + 1
    expected = reference_logits[:compared].float()
    difference = float((logits[:compared].float() - expected).abs().max())
    assert difference <= ROUNDING[dtype] * float(expected.abs().max()), f"logits differ by {difference:.4g}"
    return compared


def assert_batch_decodes_as_each_row_alone(
    model, policy_name: str, batch: list[list[int]], new_tokens: int, budget: int = 12, interval: int = 4
) -> None:
    """Greedy decoding of a left-padded batch equals decoding each row alone, up to rounding: each row
    decoded alone agrees with its batch row up to their first near-tie (`assert_decodes_alike`), and
    replayed alone token by token along the batch row's tokens it gives every one of them the same
    log-probability (within rounding), so every step is compared, near-ties or not."""
    policy = make(policy_name, model)
    engine = EvictionEngine(model, policy, EvictionConfig(budget, interval) if policy.evicts else None)
    together = engine.generate(batch, new_tokens, return_logits=True)
    assert not policy.evicts or together.stats.evictions > 0
    for row, prompt in enumerate(batch):
        tokens, logits = together.tokens[row], together.logits[row, : len(together.tokens[row])].float()
        alone = engine.generate([prompt], new_tokens, return_logits=True)
        assert_decodes_alike(tokens, logits, alone.tokens[0], alone.logits[0], model.dtype)
        replayed = engine.replay([torch.tensor(prompt + tokens)], [len(prompt)], max_chunk=1)
        expected = replayed.nll[0][len(prompt) - 1 :]  # entry j predicts token j + 1
        nll = -torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens, device=logits.device)[:, None])
        tolerance = 2 * ROUNDING[model.dtype] * float(logits.abs().max())  # a log-softmax moves by twice the logits
        assert float((nll.squeeze(-1).cpu() - expected).abs().max()) <= tolerance, f"row {row}"


def eos_prone_model(eos: int = 2) -> torch.nn.Module:
    """The tiny Llama with the logit of token `eos` raised, so completions end at varied lengths (or not at all)."""
    model = tiny_model("llama", seed=0)
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    head.weight = model.lm_head.weight
    head.bias = torch.nn.Parameter(torch.zeros(head.out_features).index_fill_(0, torch.tensor([eos]), 0.3), False)
    model.lm_head = head
    return model
