"""The two eviction regimes (foresight.cadence.Regime): the decode regime's replay is `foresight generate`'s run
on the same tokens, its golden labels follow the compression step, and a bad regime is named in one line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from foresight.artifacts import ArtifactError
from foresight.cadence import Regime, eviction_steps, regime_shift, step_of, step_position
from foresight.cli import main
from foresight.data.trace_store import Trace, TraceStore
from foresight.eval.replay import Cadence
from foresight.labels import (
    LabelStore,
    compute_golden_labels,
    future_score_table,
    golden_schedule,
    labels_command,
    save_labels,
)
from foresight.models import tiny_model
from foresight.policies import make_policy
from foresight.policies.golden import GoldenEviction
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from tests.scorers import random_scorer
from trainers.example_cache import ExampleCache, ExampleKey
from trainers.reinforcement.branches import BranchSettings, roll_out_branches
from trainers.reinforcement.rollouts import roll_out_together

B, L = 16, 4
PROMPT = 31  # longer than B + L: the decode regime compresses after it


def kept_positions(engine: EvictionEngine) -> list[torch.Tensor]:
    """Every layer's sorted cached positions [Hkv, entries] of row 0 of the engine's last run."""
    return [layer.entry_positions()[0].sort(-1).values for layer in engine.last_cache.layers]


def trace_of(ids: list[int], prompt_length: int) -> Trace:
    zeros = torch.zeros(len(ids) - 1)
    return Trace(0, "src", torch.tensor(ids), prompt_length, zeros, zeros, None, None, "", "")


def test_regime_shift_moves_the_steps_after_a_compression_only():
    assert regime_shift(PROMPT, B, L, "decode") == PROMPT - B
    assert regime_shift(B + L, B, L, "decode") == 0  # no step falls inside a prompt of at most B + L tokens
    assert regime_shift(PROMPT, B, L, "streaming") == 0
    shift = PROMPT - B
    assert step_position(1, B, L, shift) == PROMPT - 1 + L  # step 1: L tokens after the compression
    newest = torch.tensor([PROMPT - 1, PROMPT - 1 + L, PROMPT - 1 + 2 * L, PROMPT + L])
    assert step_of(newest, B, L, shift).tolist() == [0, 1, 2, 0]
    assert eviction_steps(PROMPT + 9, B, L, shift) == 2
    with pytest.raises(ValueError, match="unknown regime 'prefill'; allowed: 'streaming', 'decode'"):
        Regime.parse("prefill")


@pytest.mark.parametrize("policy_name", ["snapkv", "tova", "h2o"])
def test_the_decode_replay_is_the_generation_it_replays(policy_name):
    """Greedy generation from a long prompt, then its tokens replayed with the decode regime's prefill: every
    layer ends holding the same positions, and the replay's loss of each generated token is the generation's.
    The streaming regime's prefill, which skips the compression after the prompt, ends elsewhere."""
    model = tiny_model("llama", seed=0)
    prompt = torch.randint(3, model.config.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    engine = EvictionEngine(model, make_policy(policy_name), EvictionConfig(B, L, sinks=0, protect_prompt=False))
    generated = engine.generate([prompt], max_new_tokens=3 * L + 2, return_logits=True)
    tokens = generated.tokens[0]
    assert generated.stats.evictions == 4  # the compression, then three steps
    after_generation = kept_positions(engine)
    trace = trace_of(prompt + tokens[:-1], PROMPT)  # what the generation fed: its last token never was
    ids = [trace.input_ids]

    decode_prefill = Cadence(B, L, Regime.DECODE).prefill_lengths([trace], protects_prompt=False)
    replayed = engine.replay(ids, decode_prefill)
    for layer, (replay, generation) in enumerate(zip(kept_positions(engine), after_generation)):
        assert torch.equal(replay, generation), f"layer {layer}"
    logits = generated.logits[0, 1 : len(tokens) - 1].float()  # predictions of the fed tokens after the first
    nll = -torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:-1])[:, None])[:, 0]
    assert torch.allclose(replayed.nll[0][PROMPT:], nll, atol=1e-4)

    streaming_prefill = Cadence(B, L, Regime.STREAMING).prefill_lengths([trace], protects_prompt=False)
    assert streaming_prefill == [B + L]
    engine.replay(ids, streaming_prefill)
    assert any(not torch.equal(a, b) for a, b in zip(kept_positions(engine), after_generation))


def test_decode_labels_keep_the_compression_by_its_future_score_and_golden_replays_them():
    """The compression step keeps the B - L of positions 0..P-L-1 with the largest α of the block after the
    prompt; the later steps are the streaming schedule moved by the shift, from that kept set; golden replays
    the labels in the decode regime with its overlap at 1 and refuses the streaming one."""
    model = tiny_model("llama", seed=0)
    ids = torch.randint(3, model.config.vocab_size, (PROMPT + 3 * L + 1,), generator=torch.Generator().manual_seed(2))
    labels = compute_golden_labels(model, ids, B, L, regime="decode", prompt_length=PROMPT)
    shift = PROMPT - B
    assert (labels.regime, labels.shift, labels.num_steps) == (Regime.DECODE, shift, 3)
    table = future_score_table(model, ids, PROMPT - L, L)  # its step 1 is the compression
    older = torch.arange(PROMPT - L)
    for layer in range(table.shape[1]):
        for head in range(table.shape[2]):
            alpha = table[0, layer, head, : PROMPT - L]
            order = sorted(older.tolist(), key=lambda i: (-float(alpha[i]), i))[: B - L]
            assert labels.prefill_kept[layer, head].tolist() == sorted(order)
    flat = table[1:].flatten(1, 2)
    candidates, _ = golden_schedule(flat, B, L, labels.prefill_kept.flatten(0, 1).long(), shift)
    assert torch.equal(candidates.view_as(labels.candidates), labels.candidates.long())
    assert labels.candidates[0, 0, 0, -L:].tolist() == list(range(PROMPT - L, PROMPT))  # the window leaving

    trace = trace_of(ids.tolist(), PROMPT)
    engine = EvictionEngine(model, GoldenEviction(labels=[labels]), EvictionConfig(B, L, sinks=0, protect_prompt=False))
    engine.replay([ids], Cadence(B, L, Regime.DECODE).prefill_lengths([trace], False))
    final = kept_positions(engine)
    expected = labels.kept(3)
    for layer, held in enumerate(final):
        assert set(expected[layer].tolist()[0]) <= set(held[0].tolist())
    with pytest.raises(ValueError, match="golden"):
        engine.replay([ids], Cadence(B, L, Regime.STREAMING).prefill_lengths([trace], False))


def test_eval_in_the_decode_regime_scores_generated_tokens_only(fresh_traces, tmp_path, start_scorer, caplog):
    """`foresight labels --regime decode` then `foresight eval --regime decode`: every prompt of the tiny traces is
    longer than B + L, so every scored prediction is of a generated token, golden replays its own labels (overlap
    1), and a scorer trained for the streaming regime runs with a one-line warning naming both regimes."""
    store = TraceStore(fresh_traces)
    assert all(trace.prompt_length > B + L for trace in store)
    assert main(["labels", "--traces", str(fresh_traces), "-B", str(B), "-L", str(L), "--regime", "decode"]) == 0
    assert (fresh_traces / f"labels-B{B}-L{L}-decode").is_dir()
    out = tmp_path / "eval"
    command = ["eval", "--traces", str(fresh_traces), "--policies", "golden,snapkv,full", "--scorer", str(start_scorer)]
    assert main([*command, "-B", str(B), "-L", str(L), "--regime", "decode", "--out", str(out)]) == 0
    rows = {row["policy"]: row for row in json.loads((out / "results.json").read_text())}
    generated = sum(trace.input_ids.numel() - 1 - trace.prompt_length for trace in store)  # predictions j >= P
    for policy in ("golden", "snapkv", "full", "foresight"):
        assert rows[policy]["tokens"] == rows[policy]["tokens:generated"] == generated, policy
        assert rows[policy]["tokens:prompt"] == 0
    assert rows["golden"]["golden_overlap"] == 1.0
    assert rows["golden"]["loss_ratio:generated"] == rows["golden"]["loss_ratio"]
    warning = "foresight was trained for the streaming regime and runs here in the decode regime"
    assert any(warning in record.getMessage() for record in caplog.records)
    assert warning in (out / "results.md").read_text()


def test_labels_of_one_regime_are_refused_where_the_other_is_read(fresh_traces):
    """A decode labels file where the streaming regime's are read (a folder copied by hand) is named in one line
    with both regimes; a bad regime name is refused before anything runs."""
    ids = TraceStore(fresh_traces)[0]
    model = tiny_model("llama")
    decode = compute_golden_labels(model, ids.input_ids, B, L, regime="decode", prompt_length=ids.prompt_length)
    streaming = LabelStore(fresh_traces, B, L)
    streaming.directory.mkdir(parents=True)
    save_labels(replace(decode, trace_index=ids.index), streaming.path(ids.index))
    with pytest.raises(ArtifactError, match="regime.*'decode'.*'streaming'") as error:
        streaming.load(ids.index, num_tokens=ids.input_ids.numel())
    assert "\n" not in str(error.value)
    assert "--regime" not in labels_command(fresh_traces, B, L) and "--regime decode" in labels_command(
        fresh_traces, B, L, regime="decode"
    )
    with pytest.raises(SystemExit):
        main(["labels", "--traces", str(fresh_traces), "-B", str(B), "-L", str(L), "--regime", "prefill"])


def test_decode_regime_rollouts_sample_the_steps_after_the_compression():
    """A scorer of the decode regime rolls out from its prompt's compression: no draw is recorded there (it is
    taken deterministically), the sampled steps follow it every L tokens, sharing the prefill changes nothing,
    and a branch group never branches at the compression."""
    model = tiny_model("llama")
    scorer = random_scorer(model, B, L)
    scorer.config.regime = Regime.DECODE
    ids = torch.randint(3, 100, (60,), generator=torch.Generator().manual_seed(0))
    trace = trace_of(ids.tolist(), PROMPT)
    shared, alone = (roll_out_together(model, scorer, [trace], [(1, 2)], share_prefix=share)[0] for share in (1, 0))
    assert shared.actions.after.tolist() == list(range(PROMPT - 1 + L, ids.numel() - 2, L))  # 34, 38, ..., 54
    assert shared.eviction_steps == 1 + eviction_steps(ids.numel(), B, L, PROMPT - B)  # the compression, then 7
    torch.testing.assert_close(shared.scores.reward, alone.scores.reward)
    groups = roll_out_branches(model, scorer, trace, BranchSettings(rows=2, chunks=2, steps=7), range(2))
    assert all(int(group.actions.after[0]) >= PROMPT - 1 + L for group in groups)


def test_examples_of_one_regime_are_refused_by_a_fit_of_the_other(tmp_path):
    """A streaming example cache keeps the key it had before the regimes; a decode fit names both regimes when it
    finds it, and the command that remakes its own."""
    key = ExampleKey("tiny", "float32", B, L, "standardised", "float16")
    assert "regime" not in key.metadata()
    ExampleCache(tmp_path, tmp_path, key).claim()
    decode = ExampleCache(tmp_path, tmp_path, replace(key, regime="decode"))
    assert "--regime decode" in decode.remake_command
    with pytest.raises(ValueError, match=r"regime 'streaming' \(asked: 'decode'\)") as error:
        decode.check_key()
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="unknown regime 'prefill'"):
        replace(key, regime="prefill")


def test_fit_takes_the_regime_and_label_kind_as_config_overrides_and_labels_its_old_spelling_is_answered(capsys):
    from foresight.cli import build_parser
    from foresight.commands.fit import request
    from trainers.fitting import lightning_args

    words = ["fit", "--config", "configs/default.yaml", "--out", "o", "--label-kind", "value", "--regime", "decode"]
    overrides = [
        word for word in lightning_args(request(build_parser().parse_args(words))) if word.startswith("--data.")
    ]
    assert overrides[-2:] == ["--data.regime=decode", "--data.label_kind=value"]
    with pytest.raises(SystemExit) as exit_status:
        main(["labels", "--traces", "x", "-B", "16", "-L", "4", "--kind", "value"])
    assert exit_status.value.code == 2 and "--kind is spelled --label-kind now" in capsys.readouterr().err


def test_golden_replays_a_batch_whose_rows_evict_apart():
    """Decode-regime rows of other prompt lengths evict at other steps (a compression, or none): golden serves the
    rows each step evicts, and the row that never pads ends holding what it holds replayed alone."""
    model = tiny_model("llama", seed=0)
    generator = torch.Generator().manual_seed(2)
    ids = [torch.randint(3, model.config.vocab_size, (n,), generator=generator) for n in (49, 57, 40)]
    prompts = [PROMPT, B + 2, B + L + 3]  # a compression, none (P <= B + L), a compression after a shorter prompt
    labels = [compute_golden_labels(model, i, B, L, regime="decode", prompt_length=p) for i, p in zip(ids, prompts)]
    config = EvictionConfig(B, L, sinks=0, protect_prompt=False)
    together = EvictionEngine(model, GoldenEviction(labels=labels), config)
    together.replay(ids, prompts)
    alone = EvictionEngine(model, GoldenEviction(labels=labels[1:2]), config)
    alone.replay(ids[1:2], prompts[1:2])
    for layer, (batch, single) in enumerate(zip(together.last_cache.layers, alone.last_cache.layers)):
        held, expected = batch.entry_positions()[1], single.entry_positions()[0]
        for head in range(held.shape[0]):
            assert sorted(p for p in held[head].tolist() if p >= 0) == sorted(
                p for p in expected[head].tolist() if p >= 0
            ), f"layer {layer}, head {head}"


def test_decode_examples_record_each_rows_labelled_steps_in_a_ragged_batch():
    """The supervised examples of decode labels, rows evicting apart: every row records exactly its labels' steps
    (the compression is driven, not recorded), each step's targets its labels' α."""
    from trainers.examples import golden_steps

    model = tiny_model("llama", seed=0)
    generator = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, model.config.vocab_size, (n,), generator=generator) for n in (49, 57)]
    prompts = [PROMPT, B + 2]
    labels = [compute_golden_labels(model, i, B, L, regime="decode", prompt_length=p) for i, p in zip(ids, prompts)]
    traces = [replace(trace_of(i.tolist(), p), index=row) for row, (i, p) in enumerate(zip(ids, prompts))]
    examples = golden_steps(model, traces, labels, "standardised", storage_dtype=torch.float32)
    for example, label in zip(examples, labels, strict=True):
        assert example["alpha"].shape[0] == label.num_steps
        torch.testing.assert_close(example["alpha"], label.alpha)


def test_a_step_beside_another_rows_compression_reads_its_own_candidates():
    """Decode regime, a prompt of exactly B + L (its step 1 at the prefill) beside a longer one (its compression at the
    same prefill): the step's candidate slots widen to the longer prompt's, the shorter row's B come last. Golden
    replays the batch, and each row's supervised examples are those of its trace replayed alone."""
    from trainers.examples import golden_steps

    model = tiny_model("llama", seed=0)
    generator = torch.Generator().manual_seed(2)
    ids = [torch.randint(3, model.config.vocab_size, (n,), generator=generator) for n in (52, 55)]
    prompts = [B + L, PROMPT]
    labels = [compute_golden_labels(model, i, B, L, regime="decode", prompt_length=p) for i, p in zip(ids, prompts)]
    traces = [replace(trace_of(i.tolist(), p), index=row) for row, (i, p) in enumerate(zip(ids, prompts))]
    together = golden_steps(model, traces, labels, "standardised", storage_dtype=torch.float32)
    for row, example in enumerate(together):
        (alone,) = golden_steps(model, traces[row : row + 1], labels[row : row + 1], "standardised", torch.float32)
        assert example["alpha"].shape[0] == labels[row].num_steps > 0
        torch.testing.assert_close(example["alpha"], alone["alpha"], rtol=0, atol=0)  # looked up by position
        for name in ("keys", "values"):  # the padded forward's float32 rounding
            torch.testing.assert_close(example[name], alone[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(example["features"], alone["features"], rtol=0, atol=1e-4)
