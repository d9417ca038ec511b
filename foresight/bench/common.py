"""What the benchmarks of the eviction runtime share: their settings (the model, its device and dtype,
the policies, the cadence), the prompt, and a line naming the machine. Nothing here reads a command
line: `foresight.commands.bench` turns one into these settings."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch

from foresight.models import load_for_benchmark
from foresight.runtime.engine import EvictionConfig
from foresight.data.tasks import chat_prompt_ids

PROMPT = "Solve step by step: a train leaves at 9:40 and travels 3 hours 35 minutes. When does it arrive?"


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """A benchmark run of the eviction runtime: `model` is a name, folder, Hub id or architecture config
    (configs/models/*.json: random weights, since speed and memory depend on the shape alone), `device`
    and `dtype` are resolved (no `auto`), `policies` starts with the full cache, and `command` is the
    command that reproduces the report (written into it)."""

    model: str
    device: str
    dtype: torch.dtype
    policies: list[str]
    budget: int
    interval: int
    command: str

    @property
    def eviction(self) -> EvictionConfig:
        return EvictionConfig(self.budget, self.interval)


def load_benchmark_model(settings: BenchSettings):
    """The model (an architecture config builds a seeded random one) and its tokenizer (None then)."""
    return load_for_benchmark(settings.model, device=settings.device, dtype=settings.dtype)


def prompt_ids(tokenizer, vocab_size: int) -> list[int]:
    """The benchmark prompt: PROMPT in the model's chat format, or, for a model without a tokenizer,
    64 seeded random token ids (about as long)."""
    if tokenizer is not None:
        return chat_prompt_ids(tokenizer, PROMPT)
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (64,), generator=generator).tolist()


def machine(device: str) -> str:
    """The device in words: the GPU's name, or the CPU threads torch uses."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{torch.get_num_threads()} CPU threads ({platform.processor() or platform.machine()})"


def threads_note() -> str:
    """The thread settings a CPU timing depends on, for the line after a report's command."""
    return f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {torch.get_num_threads()} torch thread(s))"


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16", as the --dtype option and worker processes spell it."""
    return str(dtype).removeprefix("torch.")
