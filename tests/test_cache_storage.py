"""The cache's static storage: allocated once per run and stacked across layers, held flat after the first
eviction, and bit-for-bit equal to the concatenating cache it replaced (`tests/reference_cache.py`)."""

from __future__ import annotations

import pytest
import torch

import foresight.runtime.engine as engine_module
from foresight.models import tiny_model
from foresight.runtime.cache import EntryLayout, EntryStorage, StateField
from foresight.runtime.engine import EvictionEngine
from tests.policy_lists import constructible_policies
from tests.prompts import prompts
from tests.reference_cache import ConcatenatingCache
from tests.storage_engines import B, L, make


@pytest.fixture(scope="module")
def qwen3():
    return tiny_model("qwen3", num_hidden_layers=3)


# -- equal to the concatenating cache -------------------------------------------------------------
@pytest.mark.parametrize("name", ["full", "foresight", *constructible_policies()])
def test_generation_equals_the_concatenating_cache_bit_for_bit(qwen3, monkeypatch, name):
    batch = prompts([5, 11, 20], seed=1)  # padding, and a prompt that evicts right after prefill
    static = make(name, qwen3).generate(batch, 30, return_logits=True)
    monkeypatch.setattr(engine_module, "EvictionCache", ConcatenatingCache)
    concatenating = make(name, qwen3).generate(batch, 30, return_logits=True)
    assert static.stats.evictions == concatenating.stats.evictions
    assert name == "full" or static.stats.evictions >= 3
    assert static.tokens == concatenating.tokens
    assert torch.equal(static.logits, concatenating.logits)


@pytest.mark.parametrize("name", ["h2o", "lagkv", "epikv"])
def test_replay_equals_the_concatenating_cache_bit_for_bit(qwen3, monkeypatch, name):
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(3, 128, (n,), generator=generator) for n in (45, 60)]
    static = make(name, qwen3).replay(sequences, [6, 25])
    monkeypatch.setattr(engine_module, "EvictionCache", ConcatenatingCache)
    concatenating = make(name, qwen3).replay(sequences, [6, 25])
    for ours, theirs in zip(static.nll, concatenating.nll):
        assert torch.equal(ours, theirs)


# -- allocated once, held flat --------------------------------------------------------------------
class StorageLog:
    """After every generated token: the data pointers of every storage buffer and the bytes of the entry storage."""

    def __init__(self, engine: EvictionEngine):
        self.engine = engine
        self.pointers: list[tuple[int, ...]] = []
        self.held: list[int] = []

    def __call__(self, count: int) -> None:
        cache = self.engine.last_cache
        storage = cache.layers[0].storage
        buffers = [*storage.buffers.values(), *(layer.queries for layer in cache.layers if layer.queries is not None)]
        self.pointers.append(tuple(b.data_ptr() for b in buffers))
        self.held.append(storage.nbytes)


@pytest.mark.parametrize("name", ["knorm", "h2o", "snapkv", "foresight"])
def test_storage_is_allocated_once_and_sized_for_the_budget(qwen3, name):
    engine = make(name, qwen3)
    log = StorageLog(engine)
    output = engine.generate(prompts([5, 9]), 40, on_token=log)
    assert output.stats.evictions > 5
    assert len(set(log.pointers)) == 1 and len(set(log.held)) == 1
    layers = engine.last_cache.layers
    storage = layers[0].storage
    assert all(layer.storage is storage for layer in layers)  # one storage, every layer's tensors its slices
    assert storage.allocations == 1 and storage.slots == B + L
    kv_heads, dim = qwen3.config.num_key_value_heads, qwen3.config.head_dim
    fields = engine.policy.state_fields
    state_bytes = sum((engine.group_size if f.per_query_head else 1) * f.dtype.itemsize for f in fields)
    per_entry = 2 * dim * 4 + 4 + state_bytes  # float32 K and V, an int32 position, the state at its declared dtypes
    assert storage.nbytes == len(layers) * 2 * kv_heads * (B + L) * per_entry
    assert all(layer.keys.data_ptr() == storage.buffers["keys"][index].data_ptr() for index, layer in enumerate(layers))


def test_a_prefill_longer_than_the_budget_is_held_flat_from_its_eviction(qwen3):
    engine = make("knorm", qwen3)
    log = StorageLog(engine)
    engine.generate(prompts([4, 30]), 30, on_token=log)  # the 30-token prompt does not fit B + L
    assert len(set(log.pointers)) == 1 and len(set(log.held)) == 1  # first entry: after the prefill eviction
    storage = engine.last_cache.layers[0].storage
    assert storage.allocations == 2 and storage.slots == B + L


def test_full_cache_is_sized_for_the_whole_run(qwen3):
    """Sized once for the prompt and the tokens fed after it (the last sampled token is never fed)."""
    engine = make("full", qwen3)
    engine.generate(prompts([7]), 20)
    storage = engine.last_cache.layers[0].storage
    assert storage.allocations == 1 and storage.slots == storage.entries == 7 + 19


# -- EntryStorage ---------------------------------------------------------------------------------
def storage(slots: int, capacity: int | None = None, layers: int = 1) -> EntryStorage:
    layouts = {
        "keys": EntryLayout((3,), torch.float32),
        "mark": EntryLayout((), torch.long),
        "sum": EntryLayout((), torch.float32, fill=0.5),  # a state field: new entries start at 0.5
    }
    return EntryStorage(layouts, layers, batch=2, heads=2, slots=slots, device=torch.device("cpu"), capacity=capacity)


def test_appends_grow_by_doubling_and_keep_every_entry():
    held = storage(slots=2, layers=2)
    keys = torch.randn(2, 2, 2, 11, 3)
    for start, count in [(0, 2), (2, 1), (3, 4), (7, 4)]:  # needs 2 -> 4 -> 8 -> 16 slots
        for layer in range(2):  # as a forward does: layer 0 grows the buffers of both
            new = keys[layer, :, :, start : start + count]
            held.append(layer, count, {"keys": new, "mark": torch.full(new.shape[:3], 7)})
            held.view("sum", layer)[..., start:].add_(layer + 1)  # a policy's update of its new entries
            assert torch.equal(held.view("keys", layer), keys[layer, :, :, : start + count])
    assert held.slots == 16 and held.allocations == 4 and held.filled == [11, 11]
    assert torch.equal(held.view("keys"), keys)
    assert bool((held.view("mark") == 7).all())
    assert held.view("sum")[:, 0, 0].tolist() == [[1.5] * 11, [2.5] * 11]  # a grown buffer kept the written sums


def test_compaction_gathers_every_layer_in_place_and_shrinks_to_capacity():
    held = storage(slots=9, capacity=6, layers=2)
    keys = torch.randn(2, 2, 2, 9, 3)
    for layer in range(2):
        held.append(layer, 9, {"keys": keys[layer], "mark": (torch.arange(9) + 10 * layer).expand(2, 2, 9)})
    held.view("sum").copy_(torch.arange(9.0))
    kept = [[0, 2, 3, 7, 8], [1, 2, 4, 5, 6]]
    held.compact(torch.tensor(kept)[:, None, None, :].expand(2, 2, 2, 5))
    assert held.slots == 6 and held.filled == [5, 5] and held.allocations == 2
    for layer in range(2):
        assert torch.equal(held.view("keys", layer), keys[layer, :, :, kept[layer]])
        assert held.view("sum", layer)[0, 0].tolist() == [float(slot) for slot in kept[layer]]
    pointer = held.buffers["keys"].data_ptr()
    for layer in range(2):
        held.append(layer, 1, {"keys": keys[layer, :, :, :1], "mark": torch.full((2, 2, 1), -1)})
    assert held.view("sum")[:, 0, 0, -1].tolist() == [0.5, 0.5]  # the new entry's state starts at its fill
    held.compact(torch.tensor([[[1, 5], [0, 3]]]).expand(2, 2, 2, 2))
    assert held.buffers["keys"].data_ptr() == pointer and held.allocations == 2
    assert held.view("mark").tolist() == [[[[2, -1], [0, 7]]] * 2, [[[12, -1], [11, 15]]] * 2]
    assert held.view("sum").tolist() == [[[[2.0, 0.5], [0.0, 7.0]]] * 2, [[[2.0, 0.5], [1.0, 5.0]]] * 2]
    for layer in range(2):  # every slot past the kept ones starts anew
        held.append(layer, 4, {"keys": keys[layer, :, :, :4], "mark": torch.zeros(2, 2, 4, dtype=torch.long)})
    assert bool((held.view("sum")[:, :, :, 2:] == 0.5).all())


def test_a_state_field_may_not_shadow_an_entry_tensor():
    with pytest.raises(ValueError, match="state field name 'keys' is taken") as error:
        StateField("keys")
    assert "\n" not in str(error.value)
