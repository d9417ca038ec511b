"""`foresight eval` end to end on a tiny model, against per-trace references computed without the
evaluation's batching and attention probe."""

from __future__ import annotations

import contextlib
import csv
import fcntl
import io
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface

from foresight import cli
from foresight.bench.common import random_scorer
from foresight.data.trace_generation import token_losses
from foresight.data.trace_store import Trace, TraceStore
from foresight.eval import replay as replay_module
from foresight.eval import replay_store as replay_store_module
from foresight.eval.equal_bytes import TOKEN_NLL, equal_bytes, load_token_losses
from foresight.eval.metric_registry import METRICS
from foresight.eval.replay import evaluate
from foresight.eval.replay_store import ReplayStore
from foresight.eval.specs import PolicySpec, resolve_policies
from foresight.eval.stats import bootstrap_interval
from foresight.labels import LabelStore, compute_golden_labels, save_labels
from foresight.metrics import attention_cosine
from foresight.models import tiny_model
from foresight.policies import POLICIES, make_policy
from foresight.policies.triattention_stats import calibrate
from foresight.runtime.capture import eviction_attention
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from studies.__main__ import main as studies_main
from tests.prompts import DATA, arithmetic_traces

B, L = 16, 4
UNLABELLED_B = 24


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", initializer_range=0.2)


@pytest.fixture(scope="module")
def traces_dir(tmp_path_factory, model) -> Path:
    """Four traces of the tiny model, with golden labels at (B, L) but not at (UNLABELLED_B, L)."""
    out = tmp_path_factory.mktemp("traces")
    arithmetic_traces(model, out, num=4, max_new_tokens=32)
    store = LabelStore(out, B, L)
    for trace in TraceStore(out):
        labels = compute_golden_labels(model, trace.input_ids, B, L, trace_index=trace.index, model_name="tiny")
        save_labels(labels, store.path(trace.index))
    return out


@pytest.fixture
def patched_model(monkeypatch, model):
    loads = []
    monkeypatch.setattr("foresight.commands.eval.load_model", lambda name, **kw: (loads.append(name), (model, None))[1])
    return loads


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, traces_dir, model):
    """`foresight eval --policies all` at a labelled and an unlabelled budget: (rows, the terminal's text, out);
    the notes on stderr come before the table and the last line on stdout."""
    out = tmp_path_factory.mktemp("eval")
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stdout):
        patch.setattr("foresight.commands.eval.load_model", lambda name, **kw: (model, None))
        code = cli.main(
            [
                "eval",
                "--traces",
                str(traces_dir),
                "--policies",
                "all",
                "--budgets",
                f"{B},{UNLABELLED_B}",
                "-L",
                str(L),
                "--out",
                str(out),
                "--batch-size",
                "3",
            ]
        )
    assert code == 0
    return json.loads((out / "results.json").read_text()), stdout.getvalue(), out


def rows_of(rows, budget):
    return {row["policy"]: row for row in rows if row["budget"] == budget}


RUNNABLE = {name for name in POLICIES if name not in ("foresight", "triattention")}  # these need a scorer / statistics


def test_every_runnable_policy_has_a_row_and_golden_only_where_labelled(evaluated):
    rows, stdout, _ = evaluated
    runnable = RUNNABLE
    assert set(rows_of(rows, B)) == runnable
    assert set(rows_of(rows, UNLABELLED_B)) == runnable - {"golden"}
    assert f"B={UNLABELLED_B}: golden skipped" in stdout
    if "foresight" in POLICIES:
        assert "foresight: skipped, it needs scorer" in stdout


def test_reference_golden_and_heuristic_rows(evaluated, traces_dir):
    rows, _, _ = evaluated
    lengths = [t.input_ids.numel() for t in TraceStore(traces_dir)]
    for budget in (B, UNLABELLED_B):
        by_policy = rows_of(rows, budget)
        full = by_policy["full"]
        assert full["loss_ratio"] == 1.0 and full["attn_cosine"] == 1.0 and full["low_entropy_damage"] == 0.0
        assert full["golden_overlap"] is None
        assert full["tokens"] == sum(n - 1 - (budget + L) for n in lengths)
        for name, row in by_policy.items():
            assert row["traces"] == len(lengths), name
            if name != "full" and not POLICIES[name].default_protect_prompt:  # those start later
                assert row["tokens"] == full["tokens"], name
            assert 0.0 < row["loss_ratio"] < 10.0, name
            assert 0.0 < row["attn_cosine"] <= 1.0 + 1e-6, name
            labelled = budget == B and name != "full"
            assert (row["golden_overlap"] is not None) == labelled, name
    golden = rows_of(rows, B)["golden"]
    assert golden["golden_overlap"] == 1.0
    assert all(row["golden_overlap"] < 1.0 for name, row in rows_of(rows, B).items() if name not in ("golden", "full"))


def test_report_files(evaluated):
    rows, stdout, out = evaluated
    with open(out / "results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert [(r["policy"], int(r["budget"])) for r in table] == [(r["policy"], r["budget"]) for r in rows]
    markdown = (out / "results.md").read_text()
    assert "| policy | B | L | KV MiB / sequence | loss ratio |" in markdown and f"| golden | {B} | {L} |" in markdown
    h2o = next(r for r in rows if r["policy"] == "h2o" and r["budget"] == B)
    interval = f"{h2o['loss_ratio']:.4f} [{h2o['loss_ratio_low']:.4f}, {h2o['loss_ratio_high']:.4f}]"
    assert f"| h2o | {B} | {L} | {h2o['kv_mib']:.2f} | {interval} |" in markdown
    assert {"loss_ratio_low", "loss_ratio_high", "golden_overlap_low"} <= set(table[0])
    for plot in ("loss_ratio", "low_entropy_damage", "attn_cosine", "golden_overlap", "loss_ratio_by_memory"):
        assert (out / f"{plot}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = stdout.strip().splitlines()
    assert "| policy | B | L | KV MiB / sequence | loss ratio |" in stdout
    assert lines[-1].startswith(f"evaluated 4 traces x {len(RUNNABLE)} policies x 2 budgets in ")
    plots = [f"{m.name}.png" for m in METRICS if m.plotted] + [
        f"{m.name}_by_memory.png" for m in METRICS if m.by_memory
    ]
    assert lines[-1].endswith(
        f"results written to {out} (results.json, results.csv, results.md, page.json, {', '.join(plots)}, "
        "traces.json, token_nll.pt)"
    )
    page = json.loads((out / "page.json").read_text())  # the results file to commit beside a docs page
    assert [str(B), str(L), f"{h2o['kv_mib']:.2f}", interval] in [row[1:5] for row in page["rows"] if row[0] == "h2o"]
    assert plots[:2] == ["loss_ratio.png", "low_entropy_damage.png"]


def test_every_registered_metric_is_in_every_row_the_table_and_the_plots(evaluated):
    """The metric registry is the one list: each metric is a key of every row (in results.json and the CSV),
    its label a column of results.md and of the printed table, its interval and plots where it declares them."""
    rows, stdout, out = evaluated
    with open(out / "results.csv") as handle:
        header = next(csv.reader(handle))
    markdown = (out / "results.md").read_text()
    table_header = next(line for line in markdown.splitlines() if line.startswith("| policy |"))
    for metric in METRICS:
        assert all(metric.name in row for row in rows) and metric.name in header, metric.name
        if metric.label is not None:
            assert f"| {metric.label} |" in table_header and f"| {metric.label} |" in stdout, metric.name
        assert (f"{metric.name}_low" in rows[0]) == metric.interval, metric.name
        assert (out / f"{metric.name}.png").is_file() == metric.plotted, metric.name
        assert (out / f"{metric.name}_by_memory.png").is_file() == metric.by_memory, metric.name


def test_each_row_pools_the_per_trace_sums_it_reports(evaluated):
    """A paired metric's row value is Σ numerator / Σ denominator of the per-trace sums in traces.json."""
    rows, _, out = evaluated
    scores = [s for s in json.loads((out / "traces.json").read_text()) if s["token_set"] == "all"]
    for row in rows:
        mine = [s for s in scores if s["policy"] == row["policy"] and s["budget"] == row["budget"]]
        for metric in (m for m in METRICS if m.paired):
            top, bottom = (sum(s[key] for s in mine) for key in (metric.numerator, metric.denominator))
            assert row[metric.name] == pytest.approx(top / bottom if bottom else metric.empty, rel=1e-12), row["policy"]


def test_rows_state_the_kv_memory_each_policy_holds(evaluated, traces_dir, model):
    """B + L entries per sequence, plus the mean prompt for a policy that protects it; the full cache
    holds the whole trace (the x axis of the memory plots). The MiB count what each policy holds with its
    entries: float32 K/V, an int32 position and its state per (layer, KV head, entry), and per layer its query
    ring (a float32 vector per query head and an int32 position per query) or, for a policy that observes
    every query, the L queries it may buffer."""
    rows, _, _ = evaluated
    traces = list(TraceStore(traces_dir))
    mean_length = sum(t.input_ids.numel() for t in traces) / len(traces)
    mean_prompt = sum(t.prompt_length for t in traces) / len(traces)
    config = model.config
    layers, kv_heads, query_heads = config.num_hidden_layers, config.num_key_value_heads, config.num_attention_heads
    dim, group = config.hidden_size // query_heads, query_heads // kv_heads
    for budget in (B, UNLABELLED_B):
        by_policy = rows_of(rows, budget)
        assert by_policy["full"]["kv_entries"] == pytest.approx(mean_length)
        assert by_policy["h2o"]["kv_entries"] == budget + L
        assert by_policy["random-prompt"]["kv_entries"] == pytest.approx(budget + L + mean_prompt)
        for name, row in by_policy.items():
            policy = POLICIES[name]
            state = sum((group if f.per_query_head else 1) * f.dtype.itemsize for f in policy.state_fields)
            entry = kv_heads * (2 * dim * 4 + 4 + state)
            every_query = policy.evicts and policy.observed_queries != "window"
            window = (
                0 if not (policy.evicts and policy.needs_attention) else min(L, {"snapkv": 8, "tova": 1}.get(name, L))
            )
            queries = L if every_query else window
            expected = layers * (row["kv_entries"] * entry + queries * (query_heads * dim * 4 + 4))
            assert row["kv_mib"] == pytest.approx(expected / 2**20, rel=1e-12), name


class _OutputRecorder:
    """Per-trace reference: attention outputs of every layer (o_proj inputs) and, through the runtime's
    attention function, the entries held at each forward; batch of one row, forwards in order."""

    def __init__(self, model):
        self.model = model
        self.outputs: dict[int, list[torch.Tensor]] = {}
        self.entries: list[tuple[int, list[int], torch.Tensor]] = []

    def __call__(self, module, query, key, value, attention_mask, eviction_cache=None, **kwargs):
        layer = eviction_cache.layers[module.layer_idx]
        self.entries.append((module.layer_idx, layer.pending_positions[0].tolist(), layer.entry_positions()[0].clone()))
        return eviction_attention(module, query, key, value, attention_mask, eviction_cache=eviction_cache, **kwargs)

    def hooks(self):
        def hook(index):
            return lambda module, args: self.outputs.setdefault(index, []).append(args[0][0])

        return [
            layer.self_attn.o_proj.register_forward_pre_hook(hook(i)) for i, layer in enumerate(self.model.model.layers)
        ]

    def per_layer(self) -> torch.Tensor:
        """[layers, T, Hq, D] attention outputs, every forward's tokens concatenated."""
        heads = self.model.config.num_attention_heads
        return torch.stack([torch.cat(chunks).unflatten(-1, (heads, -1)) for _, chunks in sorted(self.outputs.items())])


def reference_row(model, traces, build, config, labels_store):
    """Loss ratio, attention cosine, golden overlap of one policy by a loop over single traces, and the
    per-trace NLL sums (evicted, full) the loss ratio's interval resamples; `build(trace)` makes the
    policy for a trace."""
    evicted_nll, full_nll, cosines, hits, kept = [], [], [], 0, 0
    for trace in traces:
        full = _OutputRecorder(model)
        handles = full.hooks()
        with torch.no_grad():
            model(trace.input_ids[None])
        for handle in handles:
            handle.remove()
        recorder = _OutputRecorder(model)
        AttentionInterface.register("eval-test-recording", recorder)
        engine = EvictionEngine(model, build(trace), config, attention="eval-test-recording")
        prefill = trace.prompt_length if engine.protect_prompt else min(trace.prompt_length, B + L)
        handles = recorder.hooks()
        output = engine.replay([trace.input_ids], [prefill])
        for handle in handles:
            handle.remove()
        first = output.first_eviction[0]
        evicted_nll.append(output.nll[0][first:])
        full_nll.append(trace.token_nll[first:])
        predictions = trace.input_ids.numel() - 1
        cosine = attention_cosine(recorder.per_layer(), full.per_layer())[:, first:predictions]
        cosines.append(cosine.mean(dim=(0, 2)))
        golden = labels_store.load(trace.index, num_tokens=trace.input_ids.numel())
        for layer, positions, entries in recorder.entries:
            for step in range(1, golden.num_steps + 1):
                if B + step * L in positions:
                    golden_kept = [set(head) for head in golden.kept(step)[layer].tolist()]
                    for head, held in enumerate(entries.tolist()):
                        older = [p for p in held if 0 <= p <= B + step * L - 1 - L]
                        kept += len(older)
                        hits += sum(p in golden_kept[head] for p in older)
    evicted, full_cache = torch.cat(evicted_nll).double(), torch.cat(full_nll).double()
    sums = ([float(n.double().sum()) for n in evicted_nll], [float(n.double().sum()) for n in full_nll])
    return float(evicted.mean() / full_cache.mean()), float(torch.cat(cosines).mean()), hits / kept, sums


@pytest.mark.parametrize("name", ["h2o", "raas", "golden"])
def test_rows_equal_a_per_trace_reference(evaluated, traces_dir, model, name):
    rows, _, _ = evaluated
    row = rows_of(rows, B)[name]
    store = LabelStore(traces_dir, B, L)
    if name == "golden":

        def build(trace):
            return make_policy(name, labels=[store.load(trace.index, num_tokens=trace.input_ids.numel())])

        config = EvictionConfig(B, L, sinks=0, protect_prompt=False)
    else:

        def build(trace):
            return make_policy(name)

        config = EvictionConfig(B, L)
    ratio, cosine, overlap, sums = reference_row(model, list(TraceStore(traces_dir)), build, config, store)
    assert row["loss_ratio"] == pytest.approx(ratio, abs=1e-5)
    low, high = bootstrap_interval(*sums)
    assert (row["loss_ratio_low"], row["loss_ratio_high"]) == pytest.approx((low, high), abs=1e-5)
    assert row["loss_ratio_low"] <= row["loss_ratio"] <= row["loss_ratio_high"]
    for metric in ("attn_cosine", "low_entropy_damage", "golden_overlap"):
        assert row[f"{metric}_low"] <= row[metric] <= row[f"{metric}_high"], metric
    assert row["attn_cosine"] == pytest.approx(cosine, abs=1e-4)
    assert row["golden_overlap"] == pytest.approx(overlap, abs=1e-12)
    assert name != "golden" or overlap == 1.0


@pytest.fixture(scope="module")
def stats_dir(tmp_path_factory, traces_dir, model) -> Path:
    """TriAttention statistics of the eval model, calibrated on its own traces."""
    sequences = [trace.input_ids for trace in TraceStore(traces_dir)]
    return calibrate(model, sequences, model_name="tiny").save(tmp_path_factory.mktemp("stats"))


def test_policy_options_run_one_policy_under_two_settings(traces_dir, stats_dir, model, tmp_path, monkeypatch):
    """`-o ROW.KEY=VALUE` gives triattention its statistics; a second row of it (ROW=POLICY) runs with the
    prompt unprotected; each row equals its per-trace reference under those settings."""
    monkeypatch.setattr("foresight.commands.eval.load_model", lambda name, **kw: (model, None))
    out = tmp_path / "eval"
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(
            [
                "eval",
                "--traces",
                str(traces_dir),
                "--policies",
                "full,triattention,tri-open=triattention,tri-sink=triattention",
                "--budgets",
                str(B),
                "-L",
                str(L),
                "--out",
                str(out),
                "-o",
                f"triattention.stats={stats_dir}",
                "-o",
                f"tri-open.stats={stats_dir}",
                "-o",
                "tri-open.protect_prompt=false",
                "-o",
                f"tri-sink.stats={stats_dir}",
                "-o",
                "tri-sink.protect_prompt=false",
                "-o",
                "tri-sink.sinks=2",
            ]
        )
    assert code == 0
    rows = rows_of(json.loads((out / "results.json").read_text()), B)
    assert rows["tri-open"]["tokens"] == rows["full"]["tokens"] > rows["triattention"]["tokens"]
    assert "tri-open (policy triattention, stats=" in (out / "results.md").read_text()
    store, traces = LabelStore(traces_dir, B, L), list(TraceStore(traces_dir))
    assert "tri-sink (policy triattention, stats=" in (out / "results.md").read_text()
    assert rows["tri-sink"]["loss_ratio"] != rows["tri-open"]["loss_ratio"]  # two entries never evicted change it
    for row, protect, sinks in (("triattention", None, None), ("tri-open", False, None), ("tri-sink", False, 2)):
        ratio, *_ = reference_row(
            model,
            traces,
            lambda trace: make_policy("triattention", stats=str(stats_dir)),
            EvictionConfig(B, L, sinks=sinks, protect_prompt=protect),
            store,
        )
        assert rows[row]["loss_ratio"] == pytest.approx(ratio, abs=1e-5), row


def test_policy_options_refuse_bad_rows_keys_and_values(stats_dir):
    spec = resolve_policies("tri=triattention", {"tri": {"stats": str(stats_dir), "protect_prompt": "no"}})[0][0]
    assert (
        spec.name,
        spec.policy_class.name,
        spec.protects_prompt,
        spec.config(EvictionConfig(B, L)).protect_prompt,
    ) == (
        "tri",
        "triattention",
        False,
        False,
    )
    assert resolve_policies("triattention", {"triattention": {"stats": str(stats_dir)}})[0][0].protects_prompt
    with pytest.raises(ValueError, match=r"policy 'triattention': it needs stats: give -o triattention.stats=VALUE"):
        resolve_policies("h2o,triattention")
    with pytest.raises(ValueError, match="options for 'snapkv', which is not a row of --policies"):
        resolve_policies("h2o", {"snapkv": {"window": "4"}})
    with pytest.raises(ValueError, match="policy 'h2o' has no option 'nope'"):
        resolve_policies("h2o", {"h2o": {"nope": "1"}})
    with pytest.raises(ValueError, match=r"-o h2o.protect_prompt expects a bool \(true or false\), got 'maybe'"):
        resolve_policies("h2o", {"h2o": {"protect_prompt": "maybe"}})
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        resolve_policies("x=nope")
    with pytest.raises(ValueError, match="--policies row 'a' given twice \\(h2o, snapkv\\)"):
        resolve_policies("a=h2o,a=snapkv")
    with pytest.raises(ValueError, match="row 'snapkv' would run h2o"):
        resolve_policies("snapkv=h2o")
    with pytest.raises(ValueError, match="policy 'foresight' comes from a trained scorer: give --scorer"):
        resolve_policies("lf=foresight")
    with pytest.raises(ValueError, match="-o golden.protect_prompt: only a heuristic that evicts takes it"):
        resolve_policies("golden", {"golden": {"protect_prompt": "true"}})
    with pytest.raises(ValueError, match="is not a TriAttention stats folder"):  # refused before any replay
        resolve_policies("triattention", {"triattention": {"stats": str(stats_dir / "missing")}})
    with pytest.raises(ValueError, match=r"-o h2o.sinks expects an int, got 'x'"):
        resolve_policies("h2o", {"h2o": {"sinks": "x"}})
    with pytest.raises(ValueError, match=r"-o h2o.sinks must be 0 or more, got -1"):
        resolve_policies("h2o", {"h2o": {"sinks": "-1"}})
    assert resolve_policies("h2o", {"h2o": {"sinks": "4"}})[0][0].config(EvictionConfig(B, L)).sinks == 4
    with pytest.raises(ValueError, match="policy 'tri' has no option 'nope'; its options are: .*protect_prompt, sinks"):
        resolve_policies("tri=triattention", {"tri": {"nope": "1"}})
    notes = resolve_policies("all")[1]
    assert "triattention: skipped, it needs stats: give -o triattention.stats=VALUE" in notes
    assert "triattention" in {s.name for s in resolve_policies("all", {"triattention": {"stats": str(stats_dir)}})[0]}


def test_stored_full_cache_losses_match_a_full_cache_replay(traces_dir, model):
    traces = list(TraceStore(traces_dir))
    output = EvictionEngine(model, make_policy("full")).replay(
        [t.input_ids for t in traces], [t.prompt_length for t in traces]
    )
    for trace, nll in zip(traces, output.nll):
        torch.testing.assert_close(nll, trace.token_nll, atol=1e-5, rtol=0)
        torch.testing.assert_close(token_losses(model, trace.input_ids)[1], trace.token_entropy, atol=1e-5, rtol=0)


def synthetic_trace(model, index: int, length: int, prompt: int = 6) -> Trace:
    ids = torch.randint(3, 128, (length,), generator=torch.Generator().manual_seed(index))
    nll, entropy = token_losses(model, ids)
    return Trace(index, "synthetic", ids, prompt, nll, entropy, None, None, "", "")


def test_kv_memory_counts_the_scored_traces_and_none_without(model):
    """A budget no trace reaches gives rows without memory (no division by zero); a policy that protects the
    prompt counts only the traces it evicted on, each at most its length."""
    traces = [synthetic_trace(model, i, n, prompt=p) for i, (n, p) in enumerate([(40, 6), (30, 14)])]
    result = evaluate(model, traces, [PolicySpec("full"), PolicySpec("random-prompt")], [B, 64], L, progress=False)
    rows = {(row["policy"], row["budget"]): row for row in result.rows}
    assert rows["full", 64]["kv_entries"] is None and rows["random-prompt", 64]["kv_mib"] is None
    protected = rows["random-prompt", B]  # the 30-token trace (14 + 16 + 4 > 30 - 2) never evicts
    assert protected["never_evicted"] == 1 and protected["kv_entries"] == 6 + B + L
    assert rows["full", B]["kv_entries"] == 35


def test_short_traces_are_skipped_and_counted(model):
    traces = [synthetic_trace(model, i, n) for i, n in enumerate([40, B + L - 1, B + L, 33])]
    result = evaluate(model, traces, [PolicySpec("full"), PolicySpec("knorm")], [B], L, progress=False)
    assert result.notes == [
        f"B={B}: skipped 1 of 4 traces shorter than B + L = {B + L} tokens",
        f"B={B}: knorm never evicted on 1 trace(s) (too short for its cadence, e.g. after a protected prompt); "
        "its row leaves them out",
    ]
    knorm = rows_of(result.rows, B)["knorm"]
    # The trace of exactly B + L tokens evicts after its last token: nothing left to score.
    assert (knorm["traces"], knorm["never_evicted"]) == (2, 1)
    assert knorm["tokens"] == (40 - 1 - (B + L)) + (33 - 1 - (B + L))


def test_policy_selection():
    specs, notes = resolve_policies("all")
    names = [spec.name for spec in specs]
    assert "golden" in names and "full" in names and "foresight" not in names
    assert ("foresight" in POLICIES) == any(note.startswith("foresight: skipped") for note in notes)
    assert [s.name for s in resolve_policies(" h2o, snapkv,h2o")[0]] == ["h2o", "snapkv"]
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        resolve_policies("h2o,nope")
    with pytest.raises(ValueError, match="names no policy"):
        resolve_policies(",")


def test_the_shared_prefix_changes_no_figure(evaluated, traces_dir, tmp_path, model):
    """Every policy's row at both budgets, with the forwards before the first eviction shared (the
    default) and with the model run on every token (`--no-shared-prefix`)."""
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()):
        patch.setattr("foresight.commands.eval.load_model", lambda name, **kw: (model, None))
        code = cli.main(
            [
                "eval",
                "--traces",
                str(traces_dir),
                "--policies",
                "all",
                "--budgets",
                f"{B},{UNLABELLED_B}",
                "-L",
                str(L),
                "--out",
                str(tmp_path),
                "--batch-size",
                "3",
                "--no-shared-prefix",
            ]
        )
    assert code == 0
    unshared = json.loads((tmp_path / "results.json").read_text())
    shared = evaluated[0]
    assert len(unshared) == len(shared) > 10

    def figures(rows):
        return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]

    assert figures(unshared) == figures(shared)


def eval_args(traces_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["eval", "--traces", str(traces_dir), "-B", str(B), "-L", str(L), "--out", str(out), *extra]


def test_a_killed_eval_resumes_from_the_replays_it_kept(evaluated, traces_dir, tmp_path, model, monkeypatch, capsys):
    """Killed after it kept one policy's replay of the first batch, a rerun replays only what was not kept and
    reports the uninterrupted run's figures; a third run replays nothing; batches of other traces (another
    --batch-size) are replayed, and a run with another label kind is refused, not mixed in."""
    monkeypatch.setattr("foresight.commands.eval.load_model", lambda name, **kw: (model, None))
    args = eval_args(traces_dir, tmp_path, "--policies", "full,snapkv,h2o,golden", "--batch-size")
    replayed, tally_replay = [], replay_module._tally_replay

    def counted(model, spec, *rest):
        replayed.append(spec.name)
        return tally_replay(model, spec, *rest)

    monkeypatch.setattr(replay_module, "_tally_replay", counted)
    kept, save = [], ReplayStore.save

    def save_then_die(self, spec, *rest, **where):
        save(self, spec, *rest, **where)
        kept.append(spec.name)
        raise KeyboardInterrupt

    with monkeypatch.context() as patch, contextlib.redirect_stdout(io.StringIO()):
        patch.setattr(ReplayStore, "save", save_then_die)
        with pytest.raises(KeyboardInterrupt):
            cli.main([*args, "3"])
    assert len(kept) == 1 and not (tmp_path / "results.json").exists()

    def figures(rows):
        return {row["policy"]: {k: v for k, v in row.items() if k != "seconds"} for row in rows if row["budget"] == B}

    uninterrupted = figures(evaluated[0])
    for replays in (2 * 3 - 1, 0):  # 3 evicting policies x 2 batches (3 + 1 of the 4 traces), less what was kept
        replayed.clear()
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli.main([*args, "3"]) == 0
        assert len(replayed) == replays and kept[0] not in replayed[:2]
        resumed = figures(json.loads((tmp_path / "results.json").read_text()))
        assert resumed == {policy: uninterrupted[policy] for policy in resumed} and len(resumed) == 4
    replayed.clear()
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main([*args, "2"]) == 0
    assert len(replayed) == 3 * 2
    capsys.readouterr()
    assert cli.main([*args, "3", "--label-kind", "value"]) == 2
    assert "made with other settings (label kind='alpha', not 'value')" in capsys.readouterr().err


def test_cli_options_and_errors(traces_dir, tmp_path, patched_model, capsys):
    base = ["eval", "--traces", str(traces_dir), "--budgets", str(B), "-L", str(L), "--out", str(tmp_path)]
    assert cli.main([*base, "--policies", "knorm", "--max-traces", "2", "--model", "tiny"]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [(r["policy"], r["traces"]) for r in rows] == [("knorm", 2)]
    assert patched_model == ["tiny"]
    held_out = len(TraceStore(traces_dir).split(0.5, seed=1)[1])
    assert 0 < held_out < 4  # this seed's split holds some traces out, but not all
    assert cli.main([*base, "--policies", "full", "--holdout", "0.5", "--holdout-seed", "1"]) == 0
    assert json.loads((tmp_path / "results.json").read_text())[0]["traces"] == held_out
    capsys.readouterr()
    for extra, message in [
        (["--policies", "nope"], "unknown policy 'nope'"),
        (["--policies", "knorm", "--model", "other"], "--model 'other' is not the model that made the traces"),
        (["--policies", "knorm", "-L", str(B)], f"budget B={B} must be larger than the interval L={B}"),
        (["--policies", "knorm", "--max-traces", "0"], "--max-traces must be at least 1"),
    ]:
        assert cli.main([*base, *extra]) == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith("foresight eval: error: ") and message in error and "\n" not in error


def test_scorer_runs_as_the_learned_policy_only_at_its_own_budget(traces_dir, tmp_path, patched_model, model, capsys):
    """`--scorer DIR` adds a `foresight` row at the scorer's B and L, equal to a direct replay, and a
    note (no row) at another budget."""
    scorer_dir = tmp_path / "scorer"
    random_scorer(model, B, L, base_model="tiny").save_pretrained(scorer_dir)
    out = tmp_path / "eval"
    argv = [
        "eval",
        "--traces",
        str(traces_dir),
        "--policies",
        "h2o,golden",
        "--scorer",
        str(scorer_dir),
        "--budgets",
        f"{B},{UNLABELLED_B}",
        "-L",
        str(L),
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    rows = json.loads((out / "results.json").read_text())
    learned = [row for row in rows if row["policy"] == "foresight"]
    assert [row["budget"] for row in learned] == [B]
    assert 0 <= learned[0]["golden_overlap"] <= 1 and learned[0]["loss_ratio"] > 0
    assert f"foresight skipped at B={UNLABELLED_B}, L={L}" in capsys.readouterr().err
    loss_ratio, cosine, overlap, _ = reference_row(
        model,
        list(TraceStore(traces_dir)),
        lambda trace: make_policy("foresight", scorer=str(scorer_dir)),
        EvictionConfig(B, L, sinks=0, protect_prompt=False),
        LabelStore(traces_dir, B, L),
    )
    assert learned[0]["loss_ratio"] == pytest.approx(loss_ratio, abs=1e-5)
    assert learned[0]["golden_overlap"] == pytest.approx(overlap, abs=1e-9)
    report = (out / "results.md").read_text()
    assert "- foresight trained on: not recorded in its config" in report
    assert "## The learned scorer against the best heuristic" in report and "best heuristic: h2o" in report
    headroom = {
        row["statistic"]: row
        for row in json.loads((out / "headroom.json").read_text())
        if row["policy"] == "foresight" and row["token_set"] == "all"
    }
    ratios = rows_of(rows, B)
    golden = ratios["golden"]["loss_ratio"]
    expected = (ratios["h2o"]["loss_ratio"] - learned[0]["loss_ratio"]) / (ratios["h2o"]["loss_ratio"] - golden)
    assert headroom["headroom_share"]["value"] == pytest.approx(expected, rel=1e-9)
    assert (
        headroom["headroom_share"]["low"] <= headroom["headroom_share"]["value"] <= headroom["headroom_share"]["high"]
    )
    per_trace = json.loads((out / "traces.json").read_text())
    assert {(s["policy"], s["budget"]) for s in per_trace} >= {("foresight", B), ("h2o", B), ("golden", B)}
    learned_tokens = {
        t: sum(s["tokens"] for s in per_trace if s["policy"] == "foresight" and s["token_set"] == t)
        for t in ("all", "prompt", "generated")
    }
    assert learned_tokens["all"] == learned[0]["tokens"] == learned_tokens["prompt"] + learned_tokens["generated"]
    assert learned[0]["tokens:generated"] == learned_tokens["generated"]
    # h2o's sweep of two budgets gives the headroom at equal bytes, from the saved per-token losses
    losses, reference = load_token_losses(out / TOKEN_NLL)
    held = {(row["policy"], row["budget"]): row["kv_mib"] for row in rows}
    at_bytes = equal_bytes(losses, reference, held, "foresight", B, ["h2o"])
    assert f"## The learned scorer at equal bytes\n\n{at_bytes.markdown()}" in report
    assert at_bytes.traces == len(
        [s for s in per_trace if (s["policy"], s["budget"], s["token_set"]) == ("h2o", UNLABELLED_B, "all")]
    )


def test_several_scorers_get_the_rows_they_are_named(traces_dir, tmp_path, patched_model, model, capsys):
    """`--scorer NAME=DIR` names a learned scorer's row (the supervised and the reinforced one side by
    side); −R is Σ ΔL² over the damaged tokens / the low-entropy tokens; two rows of one name are refused."""
    folders = []
    for seed, stage in enumerate(("supervised", "reinforcement")):
        folders.append(tmp_path / stage)
        random_scorer(model, B, L, seed=seed, base_model="tiny", stage=stage).save_pretrained(folders[-1])
    out = tmp_path / "eval"
    argv = [
        "eval",
        "--traces",
        str(traces_dir),
        "--policies",
        "h2o",
        "--scorer",
        f"foresight-sl={folders[0]}",
        "--scorer",
        f"foresight-rl={folders[1]}",
        "-B",
        str(B),
        "-L",
        str(L),
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    rows = {row["policy"]: row for row in json.loads((out / "results.json").read_text())}
    assert set(rows) == {"h2o", "foresight-sl", "foresight-rl"}
    assert rows["foresight-sl"]["loss_ratio"] != rows["foresight-rl"]["loss_ratio"]
    for row in rows.values():
        penalty = row["low_entropy_dl2"] * row["damaged_tokens"] / row["low_entropy_tokens"]
        assert row["low_entropy_penalty"] == pytest.approx(penalty, rel=1e-9, abs=1e-12)
    assert "| −R |" in (out / "results.md").read_text()
    capsys.readouterr()
    twice = [*argv[:5], "--scorer", f"h2o={folders[0]}", *argv[7:]]
    assert cli.main(twice) == 2
    error = capsys.readouterr().err.strip()
    assert "two result rows would be named 'h2o'" in error and "\n" not in error


def test_the_report_names_the_sources_a_scorer_was_trained_on_and_those_it_never_saw(
    traces_dir, tmp_path, patched_model, model
):
    evaluated = sorted(TraceStore(traces_dir).sources())
    for trained, unseen in [(["reasoning-gym:lcm"], ", ".join(evaluated)), (evaluated, "none (in distribution)")]:
        scorer = random_scorer(model, B, L, base_model="tiny", training_sources=trained)
        scorer.save_pretrained(tmp_path / "scorer")
        argv = [
            "eval",
            "--traces",
            str(traces_dir),
            "--policies",
            "knorm",
            "--scorer",
            str(tmp_path / "scorer"),
            "--budgets",
            str(UNLABELLED_B),
            "-L",
            str(L),
            "--out",
            str(tmp_path / "eval"),
            "--max-traces",
            "1",
        ]
        assert cli.main(argv) == 0
        report = (tmp_path / "eval" / "results.md").read_text()
        assert f"- foresight trained on: {', '.join(trained)}" in report
        assert f"- sources foresight never saw: {unseen}" in report
        assert "- evaluated traces: 1 traces" in report and f"from {evaluated[0]} (1)" in report


# -- the learned policy sampled (--sampled-seeds) --------------------------------------------------
def spread_scorer(model, folder: Path) -> Path:
    """A random scorer for `model` at (B, L) whose keep scores lie a few units apart, saved to `folder`."""
    random_scorer(model, B, L, spread=4, base_model="tiny").save_pretrained(folder)
    return folder


def test_sampled_row_is_the_mean_of_single_seed_replays(traces_dir, tmp_path, patched_model, model):
    """`--sampled-seeds 3` adds a row `learned-sampled` whose per-trace sums are the means of three sampled
    replays, each trace alone (seeded by seed and trace index) instead of in batches of 3; it is a learned
    row in the headroom comparison, never a heuristic."""
    from foresight.eval.specs import trace_seed

    scorer_dir = spread_scorer(model, tmp_path / "scorer")
    out = tmp_path / "eval"
    argv = [
        "eval",
        "--traces",
        str(traces_dir),
        "--policies",
        "h2o,golden",
        "--scorer",
        f"learned={scorer_dir}",
        "--sampled-seeds",
        "3",
        "--sample-temperature",
        "0.5",
        "-B",
        str(B),
        "-L",
        str(L),
        "--out",
        str(out),
        "--batch-size",
        "3",
    ]
    assert cli.main(argv) == 0
    rows = {row["policy"]: row for row in json.loads((out / "results.json").read_text())}
    assert set(rows) == {"h2o", "golden", "learned", "learned-sampled"}
    traces = list(TraceStore(traces_dir))

    def sampled_with(seed: int):
        return lambda trace: make_policy(
            "foresight",
            scorer=str(scorer_dir),
            mode="sampled",
            temperature=0.5,
            row_seeds=(trace_seed(seed, trace.index),),
        )

    config, store = EvictionConfig(B, L, sinks=0, protect_prompt=False), LabelStore(traces_dir, B, L)
    seeds = [reference_row(model, traces, sampled_with(seed), config, store) for seed in range(3)]
    assert len({round(ratio, 6) for ratio, *_ in seeds}) == 3  # the seeds evict differently
    evicted = [sum(sums[0][t] for *_, sums in seeds) / 3 for t in range(len(traces))]
    full = seeds[0][3][1]
    row = rows["learned-sampled"]
    assert row["loss_ratio"] == pytest.approx(sum(evicted) / sum(full), abs=1e-5)
    assert (row["loss_ratio_low"], row["loss_ratio_high"]) == pytest.approx(bootstrap_interval(evicted, full), abs=1e-5)
    assert row["attn_cosine"] == pytest.approx(sum(cosine for _, cosine, _, _ in seeds) / 3, abs=1e-4)
    assert row["golden_overlap"] == pytest.approx(sum(overlap for _, _, overlap, _ in seeds) / 3, abs=1e-9)
    per_trace = {
        s["index"]: s
        for s in json.loads((out / "traces.json").read_text())
        if s["policy"] == "learned-sampled" and s["token_set"] == "all"
    }
    for trace, expected in zip(traces, evicted):
        assert per_trace[trace.index]["nll_evicted"] == pytest.approx(expected, rel=1e-5)
    headroom = {
        (r["policy"], r["statistic"]): r
        for r in json.loads((out / "headroom.json").read_text())
        if r["token_set"] == "all"
    }
    assert headroom[("learned-sampled", "headroom_share")]["against"] == "h2o"
    assert headroom[("learned", "headroom_share")]["against"] == "h2o"  # the sampled row is no heuristic
    report = (out / "results.md").read_text()
    assert "- sampled rows: mean of 3 replays per trace (seeds 0..2) at temperature τ = 0.5" in report
    assert "- learned trained on: " in report and "learned-sampled trained on" not in report


def test_rl_heldout_compares_both_modes_with_the_replays_of_eval(
    traces_dir, tmp_path, patched_model, model, monkeypatch, capsys
):
    """`foresight bench rl-heldout --sampled-seeds 2` replays the sampled policy as `foresight eval` does:
    each trace's sampled sums equal eval's NAME-sampled row's, in both modes a scorer against itself
    changes nothing, and the report has a table per mode."""
    scorer_dir = spread_scorer(model, tmp_path / "scorer")
    out = tmp_path / "eval"
    assert (
        cli.main(
            [
                "eval",
                "--traces",
                str(traces_dir),
                "--policies",
                "h2o",
                "--scorer",
                f"learned={scorer_dir}",
                "--sampled-seeds",
                "2",
                "--sample-temperature",
                "0.5",
                "-B",
                str(B),
                "-L",
                str(L),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report, results = tmp_path / "bench.md", tmp_path / "heldout.json"
    monkeypatch.setattr("studies.rl_heldout.run.load_model", lambda name, **kw: (model, None))
    assert (
        studies_main(
            [
                "rl-heldout",
                "--traces",
                str(traces_dir),
                "--scorer",
                f"a={scorer_dir}",
                "--scorer",
                f"b={scorer_dir}",
                "--sampled-seeds",
                "2",
                "--sample-temperature",
                "0.5",
                "--resamples",
                "200",
                "--out",
                str(report),
                "--results",
                str(results),
            ]
        )
        == 0
    )
    modes = json.loads(results.read_text())["modes"]
    assert list(modes) == ["deterministic", "sampled (τ = 0.5, mean of 2 seeds)"]
    evaluated = {
        (s["policy"], s["index"]): s for s in json.loads((out / "traces.json").read_text()) if s["token_set"] == "all"
    }
    for mode, policy in zip(modes, ("learned", "learned-sampled")):
        assert modes[mode]["a"] == modes[mode]["b"]
        for row in modes[mode]["a"]:
            assert row["evicted_nll"] == pytest.approx(evaluated[(policy, row["trace"])]["nll_evicted"], rel=1e-4)
    text = report.read_text()
    assert "**deterministic policy**" in text and "**sampled (τ = 0.5, mean of 2 seeds) policy**" in text
    assert text.count("Change of −R, b against a: +0.0% [+0.0%, +0.0%]") == 2
    capsys.readouterr()
    assert (
        studies_main(
            [
                "rl-heldout",
                "--traces",
                str(traces_dir),
                "--scorer",
                f"a={scorer_dir}",
                "--scorer",
                f"b={scorer_dir}",
                "--sampled-seeds",
                "2",
                "--sample-temperature",
                "0",
            ]
        )
        == 2
    )
    assert "--sample-temperature a finite number > 0, got 2 and 0.0" in capsys.readouterr().err


def test_rl_heldout_pools_earlier_runs_as_one_run_over_their_traces(traces_dir, tmp_path, model, monkeypatch, capsys):
    """Two runs over halves of the traces, pooled by --pool, give the point figures of one run over all of
    them; a trace pooled twice, or a file comparing other scorers, is refused by name."""
    torch.manual_seed(0)
    first, second = spread_scorer(model, tmp_path / "first"), tmp_path / "second"
    random_scorer(model, B, L, spread=8, base_model="tiny").save_pretrained(second)
    monkeypatch.setattr("studies.rl_heldout.run.load_model", lambda name, **kw: (model, None))
    scorers = ["--scorer", f"a={first}", "--scorer", f"b={second}", "--resamples", "50"]

    def heldout(name: str, *words: str) -> tuple[int, str]:
        report = tmp_path / f"{name}.md"
        code = studies_main(["rl-heldout", *scorers, "--out", str(report), *words])
        return code, report.read_text() if report.exists() else capsys.readouterr().err

    def points(report: str) -> list[str]:
        rows = [line for line in report.splitlines() if line.startswith(("| a |", "| b |"))]
        return [cell.split(" [")[0] for row in rows for cell in row.split("|")[2:-1]]

    halves = []
    for name, excluded in (("low", "2,3"), ("high", "0,1")):
        results = tmp_path / f"{name}.json"
        code, _ = heldout(name, "--traces", str(traces_dir), "--exclude", excluded, "--results", str(results))
        assert code == 0
        halves.append(str(results))
    code, whole = heldout("whole", "--traces", str(traces_dir))
    code_pooled, pooled = heldout("pooled", "--pool", halves[0], "--pool", halves[1])
    assert code == code_pooled == 0
    assert len(points(whole)) == 6 and points(pooled) == points(whole)
    assert "4 held-out traces (2 of arithmetic.jsonl, 2 of arithmetic.jsonl;" in pooled.replace(
        str(DATA / "arithmetic.jsonl"), "arithmetic.jsonl"
    )
    code, error = heldout("twice", "--pool", halves[0], "--pool", halves[0])
    assert code == 2 and "is in two pooled runs" in error
    swapped = ["--scorer", f"a={second}", "--scorer", f"b={first}"]
    assert studies_main(["rl-heldout", *swapped, "--pool", halves[0], "--out", str(tmp_path / "x.md")]) == 2
    assert f"--pool {halves[0]} compares" in capsys.readouterr().err


def test_rl_heldout_replays_share_the_forwards_before_the_first_eviction(traces_dir, tmp_path, model):
    """Every replay of a batch after the first reuses its recorded prefix: the same figures, fewer forwards."""
    from foresight.scorer.model import load_scorer
    from studies.rl_heldout.run import per_trace

    scorer = load_scorer(spread_scorer(model, tmp_path / "scorer"))
    traces = list(TraceStore(traces_dir))
    calls = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(1), with_kwargs=True)
    try:
        alone = [per_trace(model, scorer, traces, 2, seed, 0.5) for seed in (None, 0, 1)]
        unshared = len(calls)
        prefixes: dict = {}
        shared = [per_trace(model, scorer, traces, 2, seed, 0.5, prefixes) for seed in (None, 0, 1)]
    finally:
        hook.remove()
    assert shared == alone
    assert len(prefixes) == 2 and 0 < len(calls) - unshared < unshared


def test_sampled_rows_at_a_vanishing_temperature_are_the_deterministic_ones(traces_dir, tmp_path, patched_model, model):
    scorer_dir = spread_scorer(model, tmp_path / "scorer")
    out = tmp_path / "eval"
    assert (
        cli.main(
            [
                "eval",
                "--traces",
                str(traces_dir),
                "--policies",
                "knorm",
                "--scorer",
                str(scorer_dir),
                "--sampled-seeds",
                "2",
                "--sample-temperature",
                "1e-6",
                "-B",
                str(B),
                "-L",
                str(L),
                "--out",
                str(out),
                "--max-traces",
                "2",
            ]
        )
        == 0
    )
    rows = {row["policy"]: row for row in json.loads((out / "results.json").read_text())}
    for metric in ("loss_ratio", "low_entropy_damage", "attn_cosine", "golden_overlap"):
        assert rows["foresight-sampled"][metric] == pytest.approx(rows["foresight"][metric], abs=1e-6), metric


def test_sampled_seeds_options_and_errors(traces_dir, tmp_path, patched_model, model, capsys):
    scorer_dir = spread_scorer(model, tmp_path / "scorer")
    base = ["eval", "--traces", str(traces_dir), "-B", str(B), "-L", str(L), "--out", str(tmp_path / "eval")]
    parsed = cli.build_parser().parse_args([*base, "--scorer", str(scorer_dir), "--sampled-seeds"])
    assert (parsed.sampled_seeds, parsed.sample_temperature) == (8, 1.0)  # the flag alone: the recommended 8 seeds
    assert cli.build_parser().parse_args(base).sampled_seeds == 0
    prompts = [
        "eval",
        "--prompts",
        str(DATA / "arithmetic.jsonl"),
        "-B",
        str(B),
        "-L",
        str(L),
        "--out",
        str(tmp_path / "eval"),
    ]
    for argv, message in [
        (
            [*base, "--policies", "knorm", "--sampled-seeds", "2"],
            "--sampled-seeds samples the learned policy's evictions: give --scorer DIR",
        ),
        (
            [*base, "--scorer", str(scorer_dir), "--sampled-seeds", "-1"],
            "--sampled-seeds must be 0 (off) or at least 1, got -1",
        ),
        (
            [*base, "--scorer", str(scorer_dir), "--sampled-seeds", "--sample-temperature", "0"],
            "--sample-temperature: temperature must be a finite number > 0, got 0.0",
        ),
        (
            [*prompts, "--scorer", str(scorer_dir), "--sampled-seeds"],
            "--sampled-seeds averages teacher-forced replays: use it with --traces, not --prompts",
        ),
        (
            [
                *base,
                "--scorer",
                f"foresight-sampled={scorer_dir}",
                "--scorer",
                f"foresight={scorer_dir}",
                "--sampled-seeds",
            ],
            "two result rows would be named 'foresight-sampled'",
        ),
    ]:
        assert cli.main(argv) == 2, message
        error = capsys.readouterr().err.strip()
        assert error.startswith("foresight eval: error: ") and message in error and "\n" not in error, error


def test_saved_token_losses_give_the_published_sums(evaluated):
    """token_nll.pt: every (policy, budget, trace) with its first eviction and every prediction's NLL, whose
    scored part sums to traces.json's; the full cache's NLL per trace is the reference both divide by. Its
    per-trace Σ ΔL² pools to the row's −R (what a paired −R change resamples)."""
    rows, _, out = evaluated
    losses, reference = load_token_losses(out / TOKEN_NLL)
    scores = {
        (s["policy"], s["budget"], s["index"]): s
        for s in json.loads((out / "traces.json").read_text())
        if s["token_set"] == "all"
    }
    assert len(losses) == len(scores)
    for loss in losses:
        score = scores[loss.policy, loss.budget, loss.index]
        assert loss.nll.numel() - loss.first_eviction == score["tokens"]
        assert float(loss.nll[loss.first_eviction :].double().sum()) == pytest.approx(score["nll_evicted"], rel=1e-6)
        assert float(reference[loss.index][loss.first_eviction :].double().sum()) == pytest.approx(
            score["nll_full"], rel=1e-6
        )
    for name, row in rows_of(rows, B).items():
        per_trace = [score for score in scores.values() if score["policy"] == name and score["budget"] == B]
        penalty = sum(s["squared_sum"] for s in per_trace) / sum(s["low_entropy"] for s in per_trace)
        assert penalty == pytest.approx(row["low_entropy_penalty"], rel=1e-9, abs=1e-12)
    golden_cadence = [loss for loss in losses if loss.policy in ("h2o", "snapkv", "golden")]
    assert golden_cadence and all(loss.first_eviction == loss.budget + L for loss in golden_cadence)


@pytest.mark.parametrize("name", ["h2o", "random"])
def test_the_flip_rate_equals_a_token_by_token_reference(evaluated, traces_dir, model, name):
    """The low-entropy flip rate: of the bottom-80%-entropy scored tokens, the share whose top-1 prediction
    under eviction (a one-trace replay fed one token at a time) differs from a plain full-cache forward's."""
    rows, _, _ = evaluated
    flipped = low = 0
    for trace in TraceStore(traces_dir):
        with torch.no_grad():
            full = model(trace.input_ids[None]).logits[0, :-1].argmax(-1)
        engine = EvictionEngine(model, make_policy(name), EvictionConfig(B, L))
        output = engine.replay([trace.input_ids], [min(trace.prompt_length, B + L)], max_chunk=1)
        first = output.first_eviction[0]
        entropy = trace.token_entropy[first:]
        bottom = entropy <= torch.quantile(entropy.double(), 0.8).to(entropy.dtype)
        assert torch.equal(output.greedy[0][:first], full[:first])  # no eviction yet: the full cache's
        flipped += int((bottom & (output.greedy[0][first:] != full[first:])).sum())
        low += int(bottom.sum())
    row = rows_of(rows, B)[name]
    assert row["low_entropy_flip_rate"] == pytest.approx(flipped / low, abs=1e-12)
    assert row["low_entropy_flip_rate_low"] <= row["low_entropy_flip_rate"] <= row["low_entropy_flip_rate_high"]
    assert name != "random" or flipped > 0
    assert rows_of(rows, B)["full"]["low_entropy_flip_rate"] == 0.0


def test_processes_on_one_out_share_its_batches_by_claims(evaluated, traces_dir, tmp_path, model, monkeypatch):
    """While another process holds the claim of the first batch, this one replays the second, then waits; the
    other keeps its replays of the first batch and lets go, and this one reads them instead of replaying: each
    batch is replayed once over the two, and the figures are a single run's."""
    monkeypatch.setattr("foresight.commands.eval.load_model", lambda name, **kw: (model, None))
    args = [*eval_args(traces_dir, tmp_path / "shared", "--policies", "full,snapkv,h2o,golden"), "--batch-size", "3"]
    alone = tmp_path / "alone"
    with contextlib.redirect_stdout(io.StringIO()):
        assert (
            cli.main([*eval_args(traces_dir, alone, "--policies", "full,snapkv,h2o,golden"), "--batch-size", "3"]) == 0
        )
    traces = sorted(TraceStore(traces_dir), key=lambda t: -t.input_ids.numel())
    first, second = traces[:3], traces[3:]
    shared = tmp_path / "shared" / "replays"
    (shared / "claims").mkdir(parents=True)
    replayed, tally_replay = [], replay_module._tally_replay

    def counted(model, spec, batch, *rest):
        replayed.append((spec.name, tuple(t.index for t in batch)))
        return tally_replay(model, spec, batch, *rest)

    monkeypatch.setattr(replay_module, "_tally_replay", counted)
    digest = replay_store_module.batch_digest(first)
    claim = os.open(shared / "claims" / f"B{B}-L{L}-batch-{digest}.claim", os.O_RDWR | os.O_CREAT)
    fcntl.flock(claim, fcntl.LOCK_EX)  # the other process, replaying the first batch

    def other_process_finishes() -> None:
        second_kept = [shared / name / f"B{B}-L{L}" / f"batch-{replay_store_module.batch_digest(second)}.pt"
                       for name in ("snapkv", "h2o", "golden")]  # fmt: skip
        while not all(path.is_file() for path in second_kept):
            time.sleep(0.05)
        for name in ("snapkv", "h2o", "golden"):
            kept = f"{name}/B{B}-L{L}/batch-{digest}.pt"
            shutil.copy(alone / "replays" / kept, shared / kept)
        fcntl.flock(claim, fcntl.LOCK_UN)
        os.close(claim)

    other = threading.Thread(target=other_process_finishes)
    other.start()
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(args) == 0
    other.join()
    assert replayed and {batch for _, batch in replayed} == {tuple(t.index for t in second)}

    def figures(out):
        return {
            row["policy"]: {k: v for k, v in row.items() if k != "seconds"}
            for row in json.loads((out / "results.json").read_text())
        }

    assert figures(tmp_path / "shared") == figures(alone)
