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

Layout: a cache of fixed row slots (`foresight.data.slot_cache`): the requests that take free slots before
a step are prefilled together (right-padded: under the causal mask a prompt's tokens never see the padding
after them) and each copied into its slot, each step writes every row's token at its own length, and a row that ends
frees its slot; nothing else is copied when rows join or leave. An additive attention mask built on the
device shows each row its own tokens, and position ids are counted per row; slots fill lowest first and a
step runs the slots up to the highest busy one. A decode step reads back one tensor (the sampled tokens
and their losses); with `Draws.COUNTER` the draws of every row are one kernel, so on an accelerator
nothing else waits for the host. `SamplerSeconds` reports the device's seconds of admission (the prefills)
and of decoding apart.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from foresight.cache_argument import cache_argument
from foresight.data.slot_cache import SlotCache
from foresight.models import describe
from foresight.runtime.device_clock import DeviceClock, adding_to
from foresight.runtime.sampling import Draws, SamplingConfig, counter_draw, logits_processors

LOSS_CHUNK = 1024  # positions per LM-head chunk: 1024 x 49K vocab x 4 bytes = 200 MB of logits
CPU_BATCH = 16  # rows decoded together on a CPU when the caller does not say (docs/notes/trace-generation.md)
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
class SamplerSeconds:
    """Where a sampling run's time went, on the device (`DeviceClock`): admitting requests (their prompts'
    prefills, losses and slot copies, `admissions` batched forwards of `admitted` rows) and decoding (each
    step's draw, read-back and forward)."""

    admission_seconds: float = 0.0
    decode_seconds: float = 0.0
    admissions: int = 0
    admitted: int = 0


@dataclass
class _Row:
    """A request being decoded: its generator, the tokens so far and the losses of every prediction."""

    request: Request
    generator: torch.Generator
    prompt_nll: torch.Tensor  # [len(prompt) - 1]
    prompt_entropy: torch.Tensor
    order: int = 0  # when the row was admitted (rows ending at one step come back in this order)
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
    (a slot's keys and values at that length, plus a few [vocab] float32 rows of logits each), at most
    256; `CPU_BATCH` on a CPU."""
    if model.device.type != "cuda":
        return CPU_BATCH
    shape = describe(model)
    kv_bytes = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * model.dtype.itemsize * max_length
    row_bytes = kv_bytes + 4 * 4 * model.config.get_text_config().vocab_size
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
    draws: str | Draws | None = None,
    on_token: Callable[[int], None] | None = None,
    seconds: SamplerSeconds | None = None,
) -> Iterator[Completion]:
    """Sample a completion of every request, `batch_size` rows at a time, yielded as rows end.

    `sampling` gives temperature (0: greedy), top-k and top-p (its `seed` is not used: each row has
    its request's). `draws`: where each row's random numbers come from (`foresight.runtime.sampling.Draws`;
    None: the device's, `Draws.resolve`). `on_token(n)` is called after each decode step with the tokens it sampled.
    `seconds`, if given, receives the admission and decode seconds (complete once the iterator is exhausted)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    draws = Draws.resolve(draws, model.device, sampling.temperature)
    batch = _Slots(model, sampling, draws, batch_size, max_new_tokens, set(eos_token_ids))
    seconds = SamplerSeconds() if seconds is None else seconds
    clock = DeviceClock(model.device)
    pending = iter(requests)
    try:
        while True:
            arrivals = list(zip(batch.free_slots(), pending))
            if arrivals:
                start = clock.start()
                batch.admit(arrivals)
                clock.stop(start, adding_to(seconds, "admission_seconds"))
                seconds.admissions, seconds.admitted = seconds.admissions + 1, seconds.admitted + len(arrivals)
            if not batch.rows:
                return
            start = clock.start()
            sampled = batch.sample()
            clock.stop(start, adding_to(seconds, "decode_seconds"))
            if on_token is not None:
                on_token(len(batch.rows))
            yield from batch.release_ended(sampled)
            if batch.rows:
                start = clock.start()
                batch.step()
                clock.stop(start, adding_to(seconds, "decode_seconds"))
    finally:
        clock.settle()


class _Slots:
    """The rows decoding together, each in a fixed slot of one `SlotCache` (free slots decode padding that
    nothing reads). Per decode step the host reads back one tensor, the sampled tokens with their losses,
    and sends nothing: what the step needs per slot lives on the device, set when a row is admitted or freed."""

    def __init__(
        self,
        model: torch.nn.Module,
        sampling: SamplingConfig,
        draws: Draws,
        slots: int,
        max_new_tokens: int,
        eos: set[int],
    ) -> None:
        self.model = model.eval()
        self.sampling, self.draws = sampling, draws
        self.processors = logits_processors(sampling)
        self.max_new_tokens, self.eos = max_new_tokens, eos
        self.device = model.device
        self.cache = SlotCache(model, slots)
        self.rows: dict[int, _Row] = {}  # slot -> the request decoding there
        self.lengths = torch.zeros(slots, dtype=torch.long, device=self.device)  # tokens each slot holds
        self.seeds = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.sampled = torch.zeros(slots, dtype=torch.long, device=self.device)  # tokens each row has sampled
        self.busy = torch.zeros(slots, dtype=torch.bool, device=self.device)
        self.logits = torch.zeros(slots, model.config.get_text_config().vocab_size, device=self.device)
        self.tokens = torch.zeros(slots, dtype=torch.long, device=self.device)  # the tokens sampled last
        self.admitted = 0

    def free_slots(self) -> list[int]:
        """The slots no row holds, lowest first (a new request takes the lowest)."""
        return [slot for slot in range(self.lengths.numel()) if slot not in self.rows]

    def admit(self, arrivals: Sequence[tuple[int, Request]]) -> None:
        """Prefill the arrivals' prompts in one forward, keep their losses and next-token logits, and copy
        each row's cache into its slot (the other slots are not touched). The prompts are right-padded: the
        causal mask keeps every prompt token from seeing the padding after it, so a row's keys, values and
        predictions are those of its prompt alone (up to the rounding of batched kernels)."""
        for _, request in arrivals:
            if not request.prompt:
                raise ValueError(f"request {request.key} has an empty prompt")
        lengths = [len(request.prompt) for _, request in arrivals]
        ids = torch.zeros(len(arrivals), max(lengths), dtype=torch.long)
        for row, (_, request) in enumerate(arrivals):
            ids[row, : lengths[row]] = torch.as_tensor(list(request.prompt), dtype=torch.long)
        ids = ids.to(self.device)
        prefilled = DynamicCache()
        hidden = self.model.base_model(
            input_ids=ids, **cache_argument(self.model.base_model, prefilled), use_cache=True
        ).last_hidden_state
        # Every prediction inside a prompt, of every row, through the LM head at once.
        inside = torch.arange(ids.shape[1] - 1)[None, :] < torch.tensor(lengths)[:, None] - 1
        inside = inside.to(self.device)
        nll, entropy = chunked_losses(self.model.get_output_embeddings(), hidden[:, :-1][inside], ids[:, 1:][inside])
        slots = torch.tensor([slot for slot, _ in arrivals], device=self.device)
        last = torch.tensor(lengths, device=self.device) - 1
        self.logits[slots] = self.model.get_output_embeddings()(hidden[torch.arange(len(arrivals)), last]).float()
        self.cache.reserve(max(lengths) + self.max_new_tokens)
        self.cache.admit(slots, prefilled)
        self.lengths[slots] = last + 1
        self.seeds[slots] = torch.tensor([request.seed for _, request in arrivals], device=self.device)
        self.sampled[slots] = 0
        self.busy[slots] = True
        starts = [0, *itertools.accumulate(length - 1 for length in lengths)]
        for row, (slot, request) in enumerate(arrivals):
            generator = torch.Generator(device=self.device).manual_seed(request.seed)
            span = slice(starts[row], starts[row + 1])
            self.rows[slot] = _Row(request, generator, nll[span], entropy[span], order=self.admitted)
            self.admitted += 1

    def sample(self) -> dict[int, tuple[int, float, float]]:
        """Draw each row's next token, with its full-cache loss and entropy: {slot: (token, nll, entropy)}."""
        active = self._active()
        logits = self.logits[:active]
        log_probs = torch.log_softmax(logits, dim=-1)
        if self.sampling.temperature == 0:
            tokens = logits.argmax(-1)
        elif self.draws is Draws.COUNTER:
            tokens = counter_draw(self.processors(None, logits), self.seeds[:active], self.sampled[:active])
        else:
            probs = torch.softmax(self.processors(None, logits), dim=-1)
            tokens = self.tokens[:active].clone()
            for slot, row in self.rows.items():
                tokens[slot : slot + 1] = torch.multinomial(probs[slot], 1, generator=row.generator)
        self.tokens[:active] = tokens
        self.sampled += 1
        nll = -log_probs.gather(-1, tokens[:, None]).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        read = torch.stack([tokens.double(), nll.double(), entropy.double()], 1).tolist()  # the step's one read-back
        sampled = {}
        for slot, row in self.rows.items():
            token, loss, spread = read[slot]
            sampled[slot] = (int(token), loss, spread)
            row.tokens.append(int(token))
            row.nll.append(loss)
            row.entropy.append(spread)
        return sampled

    def release_ended(self, sampled: dict[int, tuple[int, float, float]]) -> Iterator[Completion]:
        """Yield the completions of the rows that sampled an EOS or their last token, in the order they
        were admitted, and free their slots."""
        ended = [
            slot
            for slot, (token, _, _) in sampled.items()
            if token in self.eos or len(self.rows[slot].tokens) == self.max_new_tokens
        ]
        for slot in sorted(ended, key=lambda slot: self.rows[slot].order):
            row = self.rows.pop(slot)
            self.busy[slot] = False
            yield row.completion(truncated=row.tokens[-1] not in self.eos)

    def step(self) -> None:
        """Feed every active slot its last sampled token; the logits become the rows' next predictions."""
        active = self._active()
        width = max(len(row.request.prompt) + len(row.tokens) for row in self.rows.values())
        self.lengths = torch.where(self.busy, self.lengths + 1, 0)  # a free slot holds nothing
        self.cache.step.write_index = (self.lengths - 1).clamp_min(0)
        self.cache.step.width, self.cache.step.active = width, active
        output = self.model(
            input_ids=self.tokens[:active, None],
            attention_mask=self._attention_mask(active, width),
            position_ids=self.cache.step.write_index[:active, None],
            **cache_argument(self.model, self.cache),
            use_cache=True,
        )
        self.logits[:active] = output.logits[:, -1].float()

    def _active(self) -> int:
        """The slots a step runs: up to the highest busy one (slots fill lowest first)."""
        return max(self.rows) + 1

    def _attention_mask(self, active: int, width: int) -> torch.Tensor:
        """Each active slot's own tokens (a free one: its first position), as the additive [active, 1, 1,
        width] mask the model uses as it is: from a 2D mask `transformers` would first test whether any
        entry is masked, a read-back per step."""
        lengths = self.lengths[:active].clamp_min(1)
        shown = torch.arange(width, device=self.device)[None, :] < lengths[:, None]
        hidden = torch.finfo(self.model.dtype).min
        return torch.zeros(shown.shape, dtype=self.model.dtype, device=self.device).masked_fill(~shown, hidden)[
            :, None, None
        ]


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
