"""Sampling many completions with the full cache by continuous batching.

Up to `batch_size` requests decode together; a row that ends (EOS, or `max_new_tokens` reached)
leaves the batch at once and the next request's prompt takes its place, so the batch never waits
for its longest row. Each row samples with its own `torch.Generator` seeded by its request, so a
completion depends on its request only, not on the batch it shared or the order of the requests;
padding slots are masked out of attention, so a row decodes as it would alone (up to the rounding
of batched kernels).

Every prediction the model makes along the way is kept: the full-cache loss and entropy of each
token of the sequence given the ones before it (temperature 1, no filtering), the two numbers a
trace stores, so no second teacher-forced pass is needed.

Layout: a `transformers` cache (`foresight.data.growing_cache`, filled in place) whose rows hold their
tokens in their last `lengths[r]` slots (a new row's prompt is prefilled alone, then left-padded to
the batch's width), a 2D attention mask that hides the rest, and position ids counted per row.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from foresight.data.growing_cache import SPARE_SHARE, growing_cache
from foresight.runtime.sampling import SamplingConfig, logits_processors

LOSS_CHUNK = 1024  # positions per LM-head chunk: 1024 x 49K vocab x 4 bytes = 200 MB of logits
CPU_BATCH = 16  # rows decoded together on a CPU when the caller does not say (docs/benchmarks.md)
MAX_GPU_BATCH = 256
GPU_MEMORY_SHARE = 0.8  # of the free accelerator memory that the KV cache and logits may take


@dataclass(frozen=True)
class Request:
    """One completion to sample: `key` names it in the results, `seed` seeds its own generator."""

    key: int
    prompt: Sequence[int]
    seed: int


@dataclass
class Completion:
    """A sampled completion. `token_nll[j]` and `token_entropy[j]` are the full-cache loss and
    entropy of predicting token j + 1 of prompt + tokens from the tokens before it."""

    key: int
    prompt: list[int]
    tokens: list[int]  # EOS included when the row ended with one
    truncated: bool  # reached max_new_tokens without an EOS
    token_nll: torch.Tensor = field(repr=False)  # [len(prompt) + len(tokens) - 1] float32, CPU
    token_entropy: torch.Tensor = field(repr=False)


@dataclass
class _Row:
    """A request being decoded: its generator, the tokens so far and the losses of every prediction."""

    request: Request
    generator: torch.Generator
    prompt_nll: torch.Tensor  # [len(prompt) - 1]
    prompt_entropy: torch.Tensor
    tokens: list[int] = field(default_factory=list)
    nll: list[float] = field(default_factory=list)  # one per sampled token
    entropy: list[float] = field(default_factory=list)

    def completion(self, truncated: bool) -> Completion:
        return Completion(
            key=self.request.key,
            prompt=list(self.request.prompt),
            tokens=self.tokens,
            truncated=truncated,
            token_nll=torch.cat([self.prompt_nll, torch.tensor(self.nll, dtype=torch.float32)]),
            token_entropy=torch.cat([self.prompt_entropy, torch.tensor(self.entropy, dtype=torch.float32)]),
        )


def auto_batch_size(model, max_length: int) -> int:
    """Rows to decode together: on a GPU as many as the free memory holds at `max_length` tokens
    (the growing cache's buffers, spare room included, plus a few [vocab] float32 rows of logits
    each), at most 256; `CPU_BATCH` on a CPU. Counting the cache without its spare room ran an H100
    out of memory at 256 rows of ~1-4K tokens (docs/traces.md)."""
    if model.device.type != "cuda":
        return CPU_BATCH
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    kv_bytes = 2 * text.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize * max_length
    row_bytes = int((1 + SPARE_SHARE) * kv_bytes) + 4 * 4 * text.vocab_size
    free, _ = torch.cuda.mem_get_info(model.device)
    return max(1, min(MAX_GPU_BATCH, int(GPU_MEMORY_SHARE * free) // row_bytes))


@torch.inference_mode()
def sample_completions(
    model,
    requests: Iterable[Request],
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    sampling: SamplingConfig = SamplingConfig(),
    batch_size: int = CPU_BATCH,
    on_token: Callable[[int], None] | None = None,
) -> Iterator[Completion]:
    """Sample a completion of every request, `batch_size` rows at a time, yielded as rows end.

    `sampling` gives temperature (0: greedy), top-k and top-p (its `seed` is not used: each row has
    its request's). `on_token(n)` is called after each decode step with the tokens it sampled."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    batch = _Batch(model, sampling)
    eos = torch.tensor(sorted(set(eos_token_ids)), device=model.device)
    pending = iter(requests)
    while True:
        for request in itertools.islice(pending, batch_size - len(batch.rows)):
            batch.admit(request)
        if not batch.rows:
            return
        tokens = batch.sample()
        if on_token is not None:
            on_token(len(tokens))
        is_eos = torch.isin(tokens, eos)
        ended = is_eos | torch.tensor([len(row.tokens) == max_new_tokens for row in batch.rows], device=eos.device)
        yield from batch.release(ended, is_eos)
        if batch.rows:
            batch.step(tokens[~ended])


class _Batch:
    """The rows decoding together: their cache, valid lengths, next-token logits and sampling state."""

    def __init__(self, model, sampling: SamplingConfig) -> None:
        self.model = model.eval()
        self.sampling = sampling
        self.processors = logits_processors(sampling)
        self.device = model.device
        self.rows: list[_Row] = []
        self.cache = growing_cache()
        self.lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # [rows] tokens held per row
        self.logits = None  # [rows, vocab] float32: each row's prediction of its next token

    def admit(self, request: Request) -> None:
        """Prefill the request's prompt alone, keep its losses, and append it as the batch's last row."""
        if not request.prompt:
            raise ValueError(f"request {request.key} has an empty prompt")
        ids = torch.as_tensor(list(request.prompt), dtype=torch.long, device=self.device)[None]
        cache = growing_cache()
        hidden = self.model.base_model(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state[0]
        nll, entropy = chunked_losses(self.model.get_output_embeddings(), hidden[:-1], ids[0, 1:])
        generator = torch.Generator(device=self.device).manual_seed(request.seed)
        self.rows.append(_Row(request, generator, nll, entropy))
        last = self.model.get_output_embeddings()(hidden[-1:]).float()
        self.logits = last if self.logits is None else torch.cat([self.logits, last])
        self._append_cache(cache, ids.shape[1])

    def sample(self) -> torch.Tensor:
        """Draw each row's next token [rows] and record its full-cache loss and entropy."""
        log_probs = torch.log_softmax(self.logits, dim=-1)
        if self.sampling.temperature == 0:
            tokens = self.logits.argmax(-1)
        else:
            probs = torch.softmax(self.processors(None, self.logits), dim=-1)
            tokens = torch.cat([
                torch.multinomial(probs[r], 1, generator=row.generator) for r, row in enumerate(self.rows)
            ])
        nll = -log_probs.gather(-1, tokens[:, None]).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        for row, token, loss, spread in zip(self.rows, tokens.tolist(), nll.tolist(), entropy.tolist()):
            row.tokens.append(token)
            row.nll.append(loss)
            row.entropy.append(spread)
        return tokens

    def release(self, ended: torch.Tensor, is_eos: torch.Tensor) -> Iterator[Completion]:
        """Yield the completions of the rows that `ended` [rows] (truncated unless `is_eos`) and drop them."""
        if not bool(ended.any()):
            return
        flags = list(zip(self.rows, ended.tolist(), is_eos.tolist()))
        keep = ~ended
        self.rows = [row for row, done, _ in flags if not done]
        self.lengths, self.logits = self.lengths[keep], self.logits[keep]
        if self.rows:
            self.cache.batch_select_indices(keep.nonzero().squeeze(1))
            self._narrow(int(self.lengths.max()))
        else:
            self.cache = growing_cache()
        for row, done, eos in flags:
            if done:
                yield row.completion(truncated=not eos)

    def step(self, tokens: torch.Tensor) -> None:
        """Feed each row its last sampled token; the logits become the rows' next predictions."""
        width = self.cache.get_seq_length() + 1
        slots = torch.arange(width, device=self.device)
        self.lengths = self.lengths + 1
        mask = (slots[None, :] >= width - self.lengths[:, None]).long()
        output = self.model(
            input_ids=tokens[:, None],
            attention_mask=mask,
            position_ids=(self.lengths - 1)[:, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.logits = output.logits[:, -1].float()

    def _append_cache(self, cache: DynamicCache, length: int) -> None:
        """Append a prefilled one-row cache as the last row, left-padding it or the batch to one width."""
        if len(self.rows) == 1:
            self.cache = cache
        else:
            width = max(self.cache.get_seq_length(), length)
            for mine, theirs in zip(self.cache.layers, cache.layers):
                mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
                mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)])
        self.lengths = torch.cat([self.lengths, self.lengths.new_tensor([length])])

    def _narrow(self, width: int) -> None:
        """Drop leading slots that no row uses any more."""
        if width < self.cache.get_seq_length():
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, -width:], layer.values[:, :, -width:]


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, heads, n, dim] -> [rows, heads, width, dim] with zeros in front (masked out of attention)."""
    missing = width - tensor.shape[2]
    if missing == 0:
        return tensor
    return torch.cat([tensor.new_zeros(*tensor.shape[:2], missing, tensor.shape[3]), tensor], dim=2)


def chunked_losses(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk_size: int = LOSS_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss of `targets` [T] and entropy of the predictions from `hidden` [T, d] through the LM head,
    both [T] float32 on CPU, over chunks of positions so that the [T, vocab] logits never exist at once."""
    nll, entropy = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        log_probs = torch.log_softmax(head(hidden[start : start + chunk_size]).float(), dim=-1)
        nll.append(-log_probs.gather(-1, targets[start : start + chunk_size, None]).squeeze(-1))
        entropy.append(-(log_probs.exp() * log_probs).sum(-1))
    if not nll:
        return torch.zeros(0), torch.zeros(0)
    return torch.cat(nll).cpu(), torch.cat(entropy).cpu()
