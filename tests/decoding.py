"""Greedy decodings compared up to the rounding of their dtype: a row in a batch against the row alone, and a
tiny model that ends its completions at varied lengths."""

from __future__ import annotations

import torch

from foresight.models import tiny_model
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from tests.policy_lists import make

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
