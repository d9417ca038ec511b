"""Continuous-batching sampler (foresight.data.sampler) against a slow one-request-at-a-time reference."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from foresight.data.sampler import (
    GPU_MEMORY_SHARE,
    MAX_GPU_BATCH,
    Request,
    SamplerSeconds,
    auto_batch_size,
    sample_completions,
)
from foresight.data.slot_cache import SlotLayer
from foresight.runtime.sampling import Draws, SamplingConfig, counter_gumbel, logits_processors
from tests.decoding import eos_prone_model
from tests.prompts import random_prompts

EOS = 2
SAMPLING = SamplingConfig(temperature=0.8, top_k=20, top_p=0.95)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """The tiny Llama with its EOS logit raised, so rows end at many different steps."""
    return eos_prone_model(EOS).eval()


def requests(count: int = 9) -> list[Request]:
    prompts = random_prompts([3 + (7 * i) % 11 for i in range(count)], seed=4)
    return [Request(key=i, prompt=p, seed=1000 + 17 * i) for i, p in enumerate(prompts)]


def reference_sample(
    model, request: Request, max_new_tokens: int, sampling: SamplingConfig, draws: Draws = Draws.GENERATOR
) -> list[int]:
    """The rule written plainly: the request alone, the whole sequence re-run at every step, its own
    generator (or, with counter draws, the argmax of the filtered logits plus its (seed, step) noise)."""
    generator = torch.Generator().manual_seed(request.seed)
    processors = logits_processors(sampling)
    ids = list(request.prompt)
    tokens: list[int] = []
    while len(tokens) < max_new_tokens:
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        if sampling.temperature == 0:
            token = int(logits.argmax())
        elif draws is Draws.COUNTER:
            noise = counter_gumbel(torch.tensor([request.seed]), torch.tensor([len(tokens)]), logits.numel())[0]
            token = int((processors(None, logits[None])[0] + noise).argmax())
        else:
            probs = torch.softmax(processors(None, logits[None]), dim=-1)[0]
            token = int(torch.multinomial(probs, 1, generator=generator))
        tokens.append(token)
        ids.append(token)
        if token == EOS:
            break
    return tokens


def full_cache_losses(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    nll = -log_probs.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    return nll, -(log_probs.exp() * log_probs).sum(-1)


@pytest.mark.parametrize("draws", list(Draws))
@pytest.mark.parametrize("sampling", [SAMPLING, SamplingConfig(temperature=0)], ids=["sampled", "greedy"])
def test_every_batch_size_samples_what_each_request_samples_alone(model, sampling, draws):
    work = requests()
    expected = {r.key: reference_sample(model, r, 24, sampling, draws) for r in work}
    assert len({len(tokens) for tokens in expected.values()}) > 3  # rows leave the batch at many steps
    assert any(len(tokens) == 24 and tokens[-1] != EOS for tokens in expected.values())  # and some run out
    for batch_size in (1, 2, 4, len(work) + 3):
        done = list(
            sample_completions(
                model,
                work,
                max_new_tokens=24,
                eos_token_ids=[EOS],
                sampling=sampling,
                batch_size=batch_size,
                draws=draws,
            )
        )
        assert sorted(c.key for c in done) == [r.key for r in work]
        for completion in done:
            assert completion.tokens == expected[completion.key], (batch_size, completion.key)
            assert completion.truncated == (completion.tokens[-1] != EOS)
            assert completion.prompt == list(work[completion.key].prompt)


def expected_end_order(lengths: list[int], batch_size: int) -> list[int]:
    """Continuous batching simulated: a free slot takes the next request before each step, every row
    samples one token per step, and a row leaves at the step of its last token (ties: earlier row first)."""
    active: list[tuple[int, int]] = []  # (key, tokens still to sample)
    waiting, order = list(range(len(lengths))), []
    while waiting or active:
        while waiting and len(active) < batch_size:
            key = waiting.pop(0)
            active.append((key, lengths[key]))
        active = [(key, left - 1) for key, left in active]
        order += [key for key, left in active if left == 0]
        active = [(key, left) for key, left in active if left > 0]
    return order


def test_rows_leave_as_they_end_and_the_next_request_takes_their_place(model):
    """Completions come back in the order rows end, a new request entering each freed slot at once
    (static batching, waiting for the longest row, would give another order)."""
    work = requests()
    lengths = [len(reference_sample(model, r, 24, SAMPLING)) for r in work]
    order = [
        c.key
        for c in sample_completions(
            model, work, max_new_tokens=24, eos_token_ids=[EOS], sampling=SAMPLING, batch_size=3
        )
    ]
    assert order == expected_end_order(lengths, 3)
    assert order != sorted(order)


def test_losses_are_the_full_cache_losses_of_the_whole_sequence(model):
    for completion in sample_completions(
        model, requests(5), max_new_tokens=24, eos_token_ids=[EOS], sampling=SAMPLING, batch_size=3
    ):
        ids = completion.prompt + completion.tokens
        nll, entropy = full_cache_losses(model, ids)
        assert completion.token_nll.shape == (len(ids) - 1,) and completion.token_nll.dtype == torch.float32
        torch.testing.assert_close(completion.token_nll, nll, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(completion.token_entropy, entropy, atol=1e-5, rtol=1e-5)


def test_rows_joining_and_leaving_copy_no_cache_and_each_step_reads_back_once(model, monkeypatch):
    """Fixed slots: the cache's buffers are allocated once for the longest request (no growth, no copy of
    other rows when a row joins or leaves), a decode step reads back one tensor (`tolist`), and the slots
    above the highest busy one are not run."""
    work = sorted(requests(), key=lambda r: -len(r.prompt))  # the longest prompt first: one reservation
    grown, read_backs = [], []
    grow = SlotLayer.grow
    monkeypatch.setattr(SlotLayer, "grow", lambda self, capacity: grown.append(capacity) or grow(self, capacity))
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: read_backs.append(self.shape) or tolist(self))
    steps = []
    done = list(
        sample_completions(
            model,
            work,
            max_new_tokens=24,
            eos_token_ids=[EOS],
            sampling=SAMPLING,
            batch_size=3,
            draws="counter",
            on_token=steps.append,
        )
    )
    assert len(done) == len(work)
    assert len(set(grown)) == 1  # every layer grew once, to the first (longest) request's room
    assert len(read_backs) == len(steps) and all(shape[0] <= 3 and shape[1] == 3 for shape in read_backs)
    read_backs.clear()
    done = list(
        sample_completions(
            model, work[:2], max_new_tokens=24, eos_token_ids=[EOS], sampling=SAMPLING, batch_size=8, draws="counter"
        )
    )
    assert len(done) == 2 and read_backs and all(shape[0] <= 2 for shape in read_backs)  # idle slots above run nothing


def test_requests_admitted_together_share_one_prefill_and_admission_is_timed_apart(model):
    """The requests that take free slots before a step are prefilled in one forward (rows of several prompt
    lengths, right-padded), and the run's admission and decode seconds are reported apart."""
    work = requests()
    assert len({len(r.prompt) for r in work}) > 3
    prefills = []
    hook = model.base_model.register_forward_pre_hook(
        lambda module, args, kwargs: prefills.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    seconds = SamplerSeconds()
    started = time.perf_counter()
    try:
        done = list(
            sample_completions(
                model, work, max_new_tokens=24, eos_token_ids=[EOS], sampling=SAMPLING, batch_size=4, seconds=seconds
            )
        )
    finally:
        hook.remove()
    wall = time.perf_counter() - started
    prefill_rows = [rows for rows, width in prefills if width > 1]
    assert prefill_rows[0] == 4 and sum(prefill_rows) == len(work) == seconds.admitted == len(done)
    assert seconds.admissions == len(prefill_rows) < len(work)
    assert 0 < seconds.admission_seconds and 0 < seconds.decode_seconds
    assert seconds.admission_seconds + seconds.decode_seconds <= wall


def test_bad_arguments_are_refused(model):
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1, got 0"):
        list(sample_completions(model, requests(1), max_new_tokens=0, eos_token_ids=[EOS]))
    with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
        list(sample_completions(model, requests(1), max_new_tokens=4, eos_token_ids=[EOS], batch_size=0))
    with pytest.raises(ValueError, match="request 7 has an empty prompt"):
        list(sample_completions(model, [Request(7, [], 0)], max_new_tokens=4, eos_token_ids=[EOS]))
    assert list(sample_completions(model, [], max_new_tokens=4, eos_token_ids=[EOS])) == []
    with pytest.raises(ValueError, match="'bogus'.*'generator', 'counter'"):
        list(sample_completions(model, requests(1), max_new_tokens=4, eos_token_ids=[EOS], draws="bogus"))


def test_auto_batch_size_on_a_cpu_is_the_measured_default(model):
    assert auto_batch_size(model, max_length=4096) == 16


def test_auto_batch_size_on_a_gpu_counts_a_slot_at_max_length(model, monkeypatch):
    """Rows x (a slot's cache at max_length + logits) fit in GPU_MEMORY_SHARE of the free memory, and one
    more row would not."""
    text = model.config
    on_gpu = SimpleNamespace(device=torch.device("cuda"), config=text, dtype=torch.float32)
    per_token = (
        2 * text.num_hidden_layers * text.num_key_value_heads * (text.hidden_size // text.num_attention_heads) * 4
    )
    row = per_token * 1000 + 16 * text.vocab_size
    free = 10 * row
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, 4 * free))
    rows = auto_batch_size(on_gpu, max_length=1000)
    assert rows * row <= GPU_MEMORY_SHARE * free < (rows + 1) * row
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10**15, 10**15))
    assert auto_batch_size(on_gpu, max_length=1000) == MAX_GPU_BATCH
