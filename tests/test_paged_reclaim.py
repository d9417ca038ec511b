"""The paged-allocator reclaim (foresight/bench/paged_reclaim.py): the page counts against a slow loop, cases
checked by hand, the recorded states of a replay, and the benchmark end to end on the tiny model's traces."""

import itertools
from pathlib import Path

import pytest
import torch

from foresight.bench.paged_reclaim import (
    HeldPositions,
    held_after_steps,
    held_mask,
    page_reclaim,
    plot_reclaim,
)
from foresight.cadence import eviction_steps
from foresight.cli import main
from foresight.data.trace_store import TraceStore
from foresight.eval.specs import PolicySpec
from foresight.models import tiny_model


def loop_reclaim(held: torch.Tensor, page_size: int) -> tuple[int, int, tuple[int, int, int]]:
    """Kept and evicted entries and the entries freed in each layout, one slot at a time."""
    layers, heads, length = held.shape
    kept = sum(bool(held[l, h, p]) for l, h, p in itertools.product(range(layers), range(heads), range(length)))
    sequence = layer_pages = per_head = 0
    for page in range(length // page_size):
        slots = range(page * page_size, (page + 1) * page_size)
        empty = [
            [all(not held[layer, head, slot] for slot in slots) for head in range(heads)] for layer in range(layers)
        ]
        per_head += page_size * sum(map(sum, empty))
        layer_pages += page_size * heads * sum(map(all, empty))
        sequence += page_size * heads * layers if all(map(all, empty)) else 0
    return kept, held.numel() - kept, (sequence, layer_pages, per_head)


@pytest.mark.parametrize("seed", range(6))
def test_page_counts_match_the_loop_on_random_keep_masks(seed):
    generator = torch.Generator().manual_seed(seed)
    length = int(torch.randint(20, 90, (), generator=generator))  # not a multiple of the page size in general
    density = float(torch.rand((), generator=generator))
    held = torch.rand(3, 2, length, generator=generator) < density
    held[..., -1] = True  # the newest position is always held
    for page_size in (1, 2, 4, 8, 16):
        reclaim = page_reclaim(held, page_size)
        assert (reclaim.kept, reclaim.evicted, reclaim.freed) == loop_reclaim(held, page_size)
        sequence, layer, per_head = reclaim.freed
        assert sequence <= layer <= per_head  # layouts from the most shared page to the least


def test_evicting_whole_aligned_pages_frees_all_of_them():
    held = torch.ones(2, 3, 40, dtype=torch.bool)
    held[..., 8:24] = False  # pages 1 and 2 of size 8, in every head
    for page_size in (2, 4, 8):
        reclaim = page_reclaim(held, page_size)
        assert reclaim.shares == reclaim.held_per_kept == (1.0, 1.0, 1.0)


def test_alternating_evictions_free_nothing_from_two_slots_on():
    held = torch.ones(2, 3, 64, dtype=torch.bool)
    held[..., 0:48:2] = False
    assert page_reclaim(held, 1).shares == (1.0, 1.0, 1.0)
    for page_size in (2, 4, 16):
        reclaim = page_reclaim(held, page_size)
        assert reclaim.shares == (0.0, 0.0, 0.0) and reclaim.held_per_kept == (64 / 40,) * 3


def test_a_page_another_head_or_layer_still_uses_is_not_freed_in_the_shared_layouts():
    held = torch.ones(2, 2, 17, dtype=torch.bool)
    held[0, :, :8] = False  # layer 0 evicted page 0 of size 8 in both heads; layer 1 holds it
    held[1, 0, 8:16] = False  # head 0 of layer 1 evicted page 1; head 1 holds it
    assert page_reclaim(held, 8).freed == (0, 16, 24)


def test_held_mask_marks_the_positions_a_cache_holds():
    positions = torch.tensor([[[-1, 0, 3, 5], [1, 2, 3, 5]]])
    expected = torch.tensor([[[1, 0, 0, 1, 0, 1], [0, 1, 1, 1, 0, 1]]], dtype=torch.bool)
    assert torch.equal(held_mask(positions), expected)


@pytest.mark.parametrize("name", ["streaming", "h2o"])
def test_a_replay_yields_the_state_after_every_eviction_step(traces_dir, name):
    budget, interval = 16, 4
    trace = max(TraceStore(traces_dir), key=lambda t: t.input_ids.numel())
    model = tiny_model("llama")
    states = held_after_steps(model, PolicySpec(name), trace, budget, interval, None)
    length = trace.input_ids.numel()
    assert len(states) == eviction_steps(length, budget, interval)
    for step, held in enumerate(states, start=1):  # step t runs after position B + tL - 1 and keeps B entries
        assert held.shape == (
            model.config.num_hidden_layers,
            model.config.num_key_value_heads,
            budget + step * interval,
        )
        assert bool((held.sum(-1) == budget).all()) and bool(held[..., -interval:].all())
    for before, after in itertools.pairwise(states):  # an evicted entry never comes back
        assert not bool((after[..., : before.shape[-1]] & ~before).any())


def test_the_recorder_passes_every_call_through():
    policy = PolicySpec("snapkv").build(None)
    recorder = HeldPositions(policy)
    assert (recorder.name, recorder.needs_attention, recorder.latest_queries) == ("snapkv", True, policy.latest_queries)


def test_the_benchmark_reports_one_row_per_policy_page_size_and_budget(traces_dir, tmp_path):
    out = tmp_path / "bench.md"
    argv = [
        "bench",
        "paged-reclaim",
        "--traces",
        str(traces_dir),
        "--policies",
        "random,streaming",
        "-B",
        "16,24",
        "-L",
        "4",
        "--page-sizes",
        "4,8",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    text = out.read_text()
    assert "<!-- paged-reclaim:start -->" in text and f"--traces {traces_dir}" in text
    rows = [
        line.strip("| ").split(" | ") for line in text.splitlines() if line.startswith(("| random ", "| streaming "))
    ]
    assert sorted((row[0], int(row[1]), int(row[2])) for row in rows) == sorted(
        itertools.product(["random", "streaming"], [16, 24], [4, 8])
    )
    for row in rows:
        sequence, layer, per_head = (float(cell.rstrip("%")) for cell in row[4:7])
        assert int(row[3]) > 0 and 0 <= sequence <= layer <= per_head <= 100
    assert (tmp_path / "paged-reclaim.png").read_bytes().startswith(b"\x89PNG")


def test_the_committed_reclaim_tables_redraw_their_figures(tmp_path):
    """scripts/draw_results.py reads a paged-reclaim results file as the benchmark's plot reads its rows: every row,
    its percentages as shares, in the layouts' order."""
    import importlib.util

    from foresight.eval.published import ResultsFile

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("draw_results", root / "scripts" / "draw_results.py")
    draw_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(draw_results)
    table = ResultsFile.load(root / "docs" / "figures" / "paged-reclaim.json")
    rows = draw_results.reclaim_rows(table)
    assert len(rows) == len(table.rows) and {row["budget"] for row in rows} == {128, 256}
    streaming = next(r for r in rows if (r["policy"], r["budget"], r["page_size"]) == ("streaming", 128, 16))
    cells = next(r for r in table.rows if r[:3] == ["streaming", "128", "16"])
    assert streaming["shares"] == [float(cell.rstrip("%")) / 100 for cell in cells[4:7]]
    plot_reclaim(rows, tmp_path / "reclaim.png", interval=32)
    assert (tmp_path / "reclaim.png").read_bytes().startswith(b"\x89PNG")
