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
