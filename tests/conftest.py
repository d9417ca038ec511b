"""Shared test set-up: one torch thread (tiny models run faster without thread hand-offs) and the
fixtures several test modules use. Plain helpers live in tests/helpers.py."""

import pytest
import torch

from foresight.models import tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llama():
    """The tiny random Llama (GQA: 4 query heads, 2 KV heads), built once per test module."""
    return tiny_model("llama")


@pytest.fixture(scope="module")
def peaked_llama():
    """The tiny Llama with peaked attention (a larger init), for tests where attention must discriminate:
    at the default init attention is near uniform, so thresholds pass everything and H2O, summing every
    query, keeps the oldest entries on every head."""
    return tiny_model("llama", initializer_range=0.1)
