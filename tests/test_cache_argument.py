"""Every call of this project that hands a model its KV cache passes it under the name the installed
transformers expects (`foresight.cache_argument`): each call site runs on a tiny model with deprecation
warnings as errors, so a renamed keyword fails here before a release removes the old one."""

from __future__ import annotations

import warnings

import pytest
import torch

from foresight.cache_argument import CACHE_NAMES, cache_argument, cache_name, passed_cache
from foresight.data.sampler import Request, sample_completions
from foresight.labels import compute_golden_labels
from foresight.models import tiny_model
from foresight.policies import make_policy
from foresight.policies.triattention_stats import calibrate
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from tests.prompts import prompts

B, L = 16, 4


def _engine(model, name: str) -> list[object]:
    engine = EvictionEngine(model, make_policy(name), EvictionConfig(B, L))
    return [engine.generate(prompts([5, 20]), 12), engine.replay([torch.tensor(p) for p in prompts([30, 40])], [5, 5])]


CALLS = {
    "engine (generate and replay)": lambda model: _engine(model, "h2o"),
    "golden labels": lambda model: compute_golden_labels(model, torch.tensor(prompts([40])[0]), B, L),
    "trace sampler": lambda model: list(
        sample_completions(model, [Request(key=0, prompt=prompts([6])[0], seed=0)], max_new_tokens=8, eos_token_ids=[])
    ),
    "TriAttention calibration": lambda model: calibrate(model, [torch.tensor(prompts([30])[0])], chunk_size=16),
}


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_model_calls_raise_no_deprecation_warning(architecture, call):
    model = tiny_model(architecture)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        assert CALLS[call](model)


def test_the_keyword_is_the_newest_the_forward_takes():
    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return past_key_values

    class Both(torch.nn.Module):  # a release that still accepts the deprecated name beside the new one
        def forward(self, input_ids, cache=None, past_key_values=None):
            return cache

    class Neither(torch.nn.Module):
        def forward(self, input_ids):
            return input_ids

    assert cache_name(Old) == "past_key_values" and cache_argument(Old(), "C") == {"past_key_values": "C"}
    assert cache_name(Both) == "cache" == CACHE_NAMES[0]
    assert cache_name(type(tiny_model("llama"))) in CACHE_NAMES
    with pytest.raises(ValueError, match="Neither.forward takes no cache"):
        cache_name(Neither)
    assert passed_cache({"past_key_values": "C"}) == passed_cache({"cache": "C"}) == "C"
    assert passed_cache({"cache": None}) is None
