"""Sampling settings and their defaults: one home for the decoding rule every sampler shares.

`REASONING_SAMPLING` is the paper's evaluation setting (T = 0.6, top-k 20, top-p 0.95; ForesightKV
App. E.1), the default of trace generation, accuracy evaluation and their verbs.

How a row's random draws are made (`Draws`), so that a row samples the same tokens whatever batch it
shares: from a `torch.Generator` of its own (one `torch.multinomial` launch per row and step), or from a
counter-based hash of (the row's seed, the token's index, the vocabulary entry) turned into Gumbel noise,
one kernel for every row: argmax(processed logits + Gumbel noise) is an exact draw from their softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from foresight.choices import Choice

MASK_32 = 0xFFFFFFFF
GOLDEN_32 = 0x9E3779B9
"""Odd 32-bit constants of the hash (`mix32`): the low-bias integer hash of C. Wellons' hash-prospector."""


class Draws(Choice):
    """Where a row's random numbers come from (module docstring). "generator" reproduces traces sampled
    before "counter" existed; "counter" is batched and never syncs with the host."""

    GENERATOR = "generator"
    COUNTER = "counter"

    @classmethod
    def for_device(cls, device: torch.device | str) -> Draws:
        """The default: batched draws on an accelerator, where one launch per row makes decoding
        host-bound; a generator per row on a CPU, so the shipped traces' commands sample them again."""
        return cls.GENERATOR if torch.device(device).type == "cpu" else cls.COUNTER

    @classmethod
    def resolve(cls, draws: str | Draws | None, device: torch.device | str, temperature: float) -> Draws:
        """The draws a run uses and records: `draws`, or the device's default when None; greedy decoding
        (temperature 0) draws nothing and counts as "generator", as folders made before draws existed."""
        chosen = cls.for_device(device) if draws is None else cls.parse(draws)  # a bad name is refused even so
        return cls.GENERATOR if temperature == 0 else chosen


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


def mix32(values: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 `values` in [0, 2^32), elementwise (lowbias32: xor-shift, multiply,
    xor-shift, multiply, xor-shift). Products are split in 16-bit halves so no int64 overflows."""
    values = values ^ (values >> 16)
    values = _mul32(values, 0x7FEB352D)
    values = values ^ (values >> 15)
    values = _mul32(values, 0x846CA68B)
    return values ^ (values >> 16)


def _mul32(values: torch.Tensor, factor: int) -> torch.Tensor:
    """(values * factor) mod 2^32 for values, factor < 2^32, without an int64 overflow."""
    high = ((values >> 16) * factor) & 0xFFFF
    return ((high << 16) + (values & 0xFFFF) * factor) & MASK_32


def counter_gumbel(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [rows, vocab] float32, a function of each row's seed and step (int64 [rows], seeds
    below 2^32) and the vocabulary index only: the same numbers for a row whatever rows share its batch."""
    row_keys = mix32((seeds + mix32((steps * GOLDEN_32) & MASK_32)) & MASK_32)
    entries = mix32((torch.arange(vocab, device=seeds.device) * GOLDEN_32 + 1) & MASK_32)
    bits = mix32(row_keys[:, None] ^ entries[None, :])
    uniform = ((bits >> 8).to(torch.float32) + 0.5) / 2**24  # 24 bits: exact in float32, never 0 or 1
    return -torch.log(-torch.log(uniform))


def counter_draw(processed: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One token per row [rows] drawn from softmax(processed) [rows, vocab] by the Gumbel-max trick with
    `counter_gumbel` noise (filtered entries are -inf, so never drawn)."""
    noise = counter_gumbel(seeds, steps, processed.shape[-1])
    return (processed.float() + noise).argmax(-1)


REASONING_SAMPLING = SamplingConfig(temperature=0.6, top_k=20, top_p=0.95)
