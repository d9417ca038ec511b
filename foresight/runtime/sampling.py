"""Sampling settings and their defaults: one home for the decoding rule every sampler shares.

`REASONING_SAMPLING` is the paper's evaluation setting (T = 0.6, top-k 20, top-p 0.95; ForesightKV
App. E.1), the default of trace generation, accuracy evaluation and their verbs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper



@dataclass(frozen=True)
class SamplingConfig:
    """Decoding settings: temperature 0 is greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


def logits_processors(sampling: SamplingConfig) -> LogitsProcessorList:
    """The sampling filters in transformers' order: temperature, then top-k, then top-p (none when greedy)."""
    processors = LogitsProcessorList()
    if sampling.temperature > 0:
        processors.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k > 0:
            processors.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            processors.append(TopPLogitsWarper(sampling.top_p))
    return processors


def next_token(logits, processors, sampling, generators: list[torch.Generator]) -> torch.Tensor:
    """Greedy, or a draw from one generator for the batch or one generator per row."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    probabilities = torch.softmax(processors(None, logits.float()), -1)
    if len(generators) == 1:
        return torch.multinomial(probabilities, 1, generator=generators[0]).squeeze(1)
    draws = [torch.multinomial(row, 1, generator=g) for row, g in zip(probabilities, generators, strict=True)]
    return torch.cat(draws)


REASONING_SAMPLING = SamplingConfig(temperature=0.6, top_k=20, top_p=0.95)
