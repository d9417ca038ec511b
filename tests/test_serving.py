"""The serving benchmark's parts (foresight.bench.serve) on a tiny model whose cache bytes are known by
arithmetic, a decoder whose true capacity is known, and `foresight bench serve` end to end."""

from __future__ import annotations

import pytest

from foresight import cli
from foresight.bench import common as _bench_common
from foresight.bench.serve import (
    CapTooSmall,
    EngineDecoder,
    bytes_per_entry,
    check_one_sequence_fits,
    max_batch,
    parse_memory_cap,
)
from foresight.bench.watched_run import RunResult, held_bytes
from foresight.data.tasks import chat_prompt_ids
from foresight.policies import make_policy
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from tests.prompts import CHAT_TEMPLATE, char_tokenizer, random_prompts
from tests.scorers import random_scorer

B, L = 16, 4
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16  # foresight.models.tiny_model
ENTRY = LAYERS * KV_HEADS * (2 * HEAD_DIM * 4 + 4)  # K and V in float32 and an int32 position, every layer and KV head
PROMPT, NEW = 10, 30
OVERHEAD = 1024  # per-row lengths and the positions of the tokens being added: a few int64 per row


def test_parse_memory_cap():
    assert parse_memory_cap("512MiB", "cpu") == 512 * 2**20
    assert parse_memory_cap("2GiB", "cpu") == 2 * 2**30
    assert parse_memory_cap("1.5 gib", "cpu") == int(1.5 * 2**30)
    assert parse_memory_cap("300MB", "cpu") == 300 * 10**6
    assert parse_memory_cap("4096", "cpu") == 4096
    assert 0 < parse_memory_cap("0.25", "cpu") < parse_memory_cap("0.5", "cpu")
    for text, message in [
        ("2XB", "KV memory cap '2XB' is not a size such as 512MiB or 2GiB"),
        ("0MiB", "KV memory cap '0MiB' is not a size"),
        ("1.5", "KV memory cap '1.5': a fraction of free memory must be in (0, 1)"),
        ("lots", "KV memory cap 'lots' is not a size"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_memory_cap(text, "cpu")


@pytest.mark.parametrize("batch", [1, 3])
def test_held_bytes_are_the_caches_tensors(llama, batch):
    engine = EvictionEngine(llama, make_policy("full"))
    engine.generate(random_prompts([PROMPT] * batch), NEW)
    entries = PROMPT + NEW - 1  # the last token is sampled, never fed
    held = held_bytes(engine.last_cache)
    assert batch * entries * ENTRY <= held <= batch * entries * ENTRY + OVERHEAD


def test_held_bytes_count_a_learned_policys_state(llama):
    """The learned policy's per-entry sums are a read-only mapping of views on each layer: the bench's count of the
    cache's tensors includes them: the runtime's own account (`storage_bytes`) and a few bytes of bookkeeping."""
    policy = make_policy("foresight", scorer=random_scorer(llama, B, L, feature_set="standardised"))
    engine = EvictionEngine(llama, policy, EvictionConfig(B, L))
    engine.generate(random_prompts([PROMPT]), B + L)
    cache = engine.last_cache
    storage = cache.layers[0].storage
    state = sum(buffer.nbytes for name, buffer in storage.buffers.items() if name not in storage.copied)
    extra = held_bytes(cache) - cache.storage_bytes()  # besides: each layer's lengths and announced positions
    assert state > 0 and 0 <= extra < 64


@pytest.mark.parametrize(("policy", "probe_tokens"), [("full", 16), ("streaming", B + L - PROMPT + 1 + 16)])
def test_bytes_per_entry_of_a_short_probe(llama, monkeypatch, policy, probe_tokens):
    """The probe stops 16 tokens past the fullest cache (at once for the full cache)."""
    decoder = EngineDecoder(policy, llama, make_policy(policy), EvictionConfig(B, L), random_prompts([PROMPT])[0])
    runs = []
    run = decoder.run
    monkeypatch.setattr(decoder, "run", lambda *args: runs.append(args) or run(*args))
    assert ENTRY <= bytes_per_entry(decoder, 1000) <= ENTRY * 1.05
    assert runs == [(1, probe_tokens, None)]


@pytest.mark.parametrize(("policy", "entries"), [("full", PROMPT + NEW - 1), ("streaming", B + L)])
def test_max_batch_under_a_cap_is_what_the_arithmetic_says(llama, policy, entries):
    """Cap = 3.5 full sequences: the full cache runs 3; streaming, holding B + L entries, runs
    floor(3.5 x 39 / 20) = 6. The search proves both by a run that fits and a run one larger that does not."""
    cap = int(3.5 * (PROMPT + NEW - 1) * ENTRY)
    decoder = EngineDecoder(policy, llama, make_policy(policy), EvictionConfig(B, L), random_prompts([PROMPT])[0])
    assert decoder.held_entries(NEW) == entries
    search = max_batch(decoder, NEW, cap, bytes_per_entry(decoder, NEW))
    expected = int(cap // (entries * ENTRY))
    assert expected == (3 if policy == "full" else 6)
    assert search.batch == expected and search.best.fits and search.best.peak_bytes <= cap
    assert search.best.peak_entries == entries and search.best.tokens_per_second > 0
    over = [run for run in search.runs if not run.fits]
    assert [run.batch for run in over] == [expected + 1] and over[0].peak_bytes > cap
    assert (search.best.eviction_share > 0) == (policy != "full")


class CountingDecoder:
    """A decoder that fits at most `capacity` sequences, whatever the guess said."""

    name = "counting"

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.batches: list[int] = []

    evicts, prompt_length = True, 4

    def held_entries(self, new_tokens: int) -> int:
        return 10

    def run(self, batch: int, new_tokens: int, cap_bytes: int | None) -> RunResult:
        self.batches.append(batch)
        fits = batch <= self.capacity
        return RunResult(self.name, batch, new_tokens, fits, batch * 100, 10, 1.0 if fits else None)


@pytest.mark.parametrize(
    ("per_entry", "tried"), [(1.0, [9, 8, 7, 6, 5, 6]), (4.5, [2, 3, 4, 5, 6]), (10.0, [1, 2, 3, 4, 5, 6])]
)
def test_the_search_runs_down_then_up_whatever_the_guess(per_entry, tried):
    decoder = CountingDecoder(capacity=5)
    search = max_batch(decoder, 8, cap_bytes=90, per_entry=per_entry)  # guess = floor(90 / (per_entry x 10))
    assert search.batch == 5 and decoder.batches == tried


def test_a_cap_smaller_than_one_sequence_is_one_line():
    with pytest.raises(
        CapTooSmall, match=r"KV memory cap 0.0 MiB is smaller than one sequence of counting at 8 new tokens"
    ):
        max_batch(CountingDecoder(capacity=0), 8, cap_bytes=90, per_entry=1.0)
    with pytest.raises(
        CapTooSmall,
        match=r"is smaller than one sequence of counting at 8 new tokens \(0.0 MiB: 10 entries x 100 bytes\)",
    ):
        check_one_sequence_fits(CountingDecoder(capacity=1), 8, cap_bytes=900, per_entry=100.0)


@pytest.fixture
def patched_load(monkeypatch, llama):
    monkeypatch.setattr("foresight.bench.serve.load_model", lambda name, **kw: (llama, char_tokenizer(CHAT_TEMPLATE)))


def test_bench_serve_end_to_end(tmp_path, patched_load, capsys):
    out = tmp_path / "bench.md"
    prompt = len(chat_prompt_ids(char_tokenizer(CHAT_TEMPLATE), _bench_common.PROMPT))
    assert prompt < 128 + 8  # the prefill does not evict
    cap = int(2.5 * (prompt + 119) * ENTRY)  # 2.5 full sequences at the longer length
    argv = [
        "bench",
        "serve",
        "--policies",
        "streaming,knorm,foresight",
        "-B",
        "128",
        "-L",
        "8",
        "--lengths",
        "60,120",
        "--kv-memory",
        str(cap),
        "--device",
        "cpu",
        "--out",
        str(out),
        "--results",
        str(tmp_path / "runs.json"),
    ]
    assert cli.main(argv) == 0
    text = out.read_text()
    assert "### Serving under a KV-memory cap (cpu)" in text and "--kv-memory" in text
    full_row = next(line for line in text.splitlines() if line.startswith("| full |"))
    assert "(1.00x)" in full_row
    streaming_row = next(line for line in text.splitlines() if line.startswith("| streaming |"))
    batch_at_120 = int(streaming_row.split("|")[3].split()[0])
    assert batch_at_120 == int(cap // (136 * ENTRY)) == 4  # B + L = 136 entries per sequence
    assert full_row.split("|")[3].split()[0] == "2"
    assert "Load average" in text and "random weights (seed 0)" in text
    learned = next(line for line in text.splitlines() if line.startswith("| foresight | 120 |")).split(" | ")
    assert 1 <= int(learned[2]) <= batch_at_120 and float(learned[5].rstrip("%")) > 0  # its feature state costs memory


def test_bench_serve_bad_input_is_one_line(tmp_path, patched_load, capsys):
    base = [
        "bench",
        "serve",
        "--policies",
        "knorm",
        "-B",
        "32",
        "-L",
        "8",
        "--lengths",
        "60,120",
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "b.md"),
    ]
    for extra, message in [
        (["--kv-memory", "4KiB"], "KV memory cap 0.0 MiB is smaller than one sequence of full at 120 new tokens"),
        (["--kv-memory", "2XB"], "KV memory cap '2XB' is not a size"),
        (["--kv-memory", "1GiB", "--policies", "nope"], "unknown policy 'nope'"),
    ]:
        assert cli.main([*base, *extra]) == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith("foresight bench: error: ") and message in error and "\n" not in error
    assert not (tmp_path / "b.md").exists()


def test_a_decoder_that_cannot_hold_one_sequence_is_served_zero_rows(tmp_path, patched_load):
    """A cap below one full-cache sequence at the longer length but above B + L entries: the full cache serves 0
    rows there (no ratio against it), streaming its batch, and the run ends well."""
    out = tmp_path / "bench.md"
    prompt = len(chat_prompt_ids(char_tokenizer(CHAT_TEMPLATE), _bench_common.PROMPT))
    cap = int(1.5 * 136 * ENTRY)  # one streaming sequence (B + L = 136 entries), less than prompt + 119 entries
    assert prompt + 119 > 1.5 * 136
    argv = ["bench", "serve", "--policies", "streaming", "-B", "128", "-L", "8", "--lengths", "120"]
    argv += ["--kv-memory", str(cap), "--device", "cpu", "--out", str(out)]
    assert cli.main(argv) == 0
    lines = out.read_text().splitlines()
    full, streaming = (next(line for line in lines if line.startswith(f"| {name} |")) for name in ("full", "streaming"))
    assert full == "| full | 0 (–) | – |"
    assert streaming.split(" | ")[1] == "1 (–)"
    assert "| full | 120 | 0 | – | – | – | not one sequence fits the cap |" in out.read_text()
