"""The learned scorer under NVIDIA kvpress (`foresight.integrations.kvpress_press`) against our engine with the
same scorer: the positions kept at the prefill and at every decoding step, on every layer and KV head of a tiny
Llama and a tiny Qwen3, the per-entry state carried between steps, the tokens `model.generate` samples, and the
default model's teacher-forced loss on held-out traces. kvpress pins transformers < 5.3, so this runs in its
own virtualenv (scripts/crosscheck.sh, docs/kvpress.md); elsewhere it is skipped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from foresight.data.trace_store import TraceStore
from foresight.models import load_model, tiny_model
from foresight.policies.foresight import Foresight
from foresight.runtime.engine import EvictionConfig, EvictionEngine
from foresight.scorer.model import weights_digest
from tests.kvpress_env import engine_prefill_kept, held_positions, kvpress_kept, teacher_forced
from tests.scorers import random_scorer

# After tests.kvpress_env, which imports kvpress with the suite's attention functions left as they were.
presses = pytest.importorskip("foresight.integrations.kvpress_press")
ForesightPress, ForesightScorerPress = presses.ForesightPress, presses.ForesightScorerPress

BUDGET, INTERVAL = 16, 4
ARCHS = ("llama", "qwen3")
LONG, SHORT = 36, 13  # a prompt the prefill's own step brings to B; one whose first step comes while decoding
NEW_TOKENS = 21  # 20 fed: 5 decoding steps after the long prompt, 4 after the short one


def scorer_for(model):
    return random_scorer(model, budget=BUDGET, interval=INTERVAL, feature_set="standardised")


def prompt(length: int) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(length))


Snapshot = tuple[list[list[list[int]]], list[dict[str, torch.Tensor]]]


def engine_run(model, scorer, ids: torch.Tensor) -> tuple[list[int], list[Snapshot]]:
    """Our engine's greedy tokens and, after each of its eviction steps, every layer's held positions
    [layer][head] and per-entry state. The engine reads the window's queries at the step, as the press does
    (kvpress hands a press the window there); the engine's default, the window streamed into the state, keeps
    the same sets (tests/test_streamed_observation.py) with three more state fields."""
    engine = EvictionEngine(model, Foresight(scorer=scorer, observation="window"), EvictionConfig(BUDGET, INTERVAL))
    steps: list[Snapshot] = []

    def on_token(_: int) -> None:
        if engine.last_stats.evictions > len(steps):
            cache = engine.last_cache
            steps.append(
                (held_positions(cache), [{k: v.clone() for k, v in layer.state.items()} for layer in cache.layers])
            )

    output = engine.generate(ids.tolist(), NEW_TOKENS, on_token=on_token)
    return output.tokens[0], steps


def press_snapshot(press: ForesightPress, layers: int) -> Snapshot:
    entries = [press.base_press.entries(layer) for layer in range(layers)]
    positions = [[sorted(head) for head in layer.positions[0].tolist()] for layer in entries]
    return positions, [layer.state for layer in entries]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_prefill_keeps_the_engines_positions(arch):
    """The press alone compresses a prefill as kvpress's presses do; its kept keys, matched to the prefill's,
    are the engine's kept positions on every layer and KV head, and the press's own bookkeeping agrees."""
    model, ids = tiny_model(arch), prompt(LONG)
    scorer = scorer_for(model)
    ours = engine_prefill_kept(model, Foresight(scorer=scorer), EvictionConfig(BUDGET, INTERVAL), ids)
    press = ForesightScorerPress(scorer=scorer)
    theirs = kvpress_kept(model, press, ids)
    assert theirs == ours
    assert [[sorted(head) for head in press.entries(layer).positions[0].tolist()] for layer in range(2)] == ours


@pytest.mark.parametrize("length", (LONG, SHORT))
@pytest.mark.parametrize("arch", ARCHS)
def test_every_decoding_step_keeps_the_engines_positions_and_state(arch, length):
    """DecodingPress's steps every L tokens fall where the engine's do, after a prompt of T >= B + L (its prefill
    step) or T < B + L (the first step mid-decoding), keep the engine's positions on every layer and KV head and
    carry the same per-entry feature sums; the cache holds the entries the press says (layer 0's keys, which
    depend on their token alone, are the full cache's at those positions)."""
    model, ids = tiny_model(arch), prompt(length)
    scorer = scorer_for(model)
    tokens, ours = engine_run(model, scorer, ids)
    sequence = torch.cat([ids[0], torch.tensor(tokens)])
    press, theirs, layer0 = ForesightPress(scorer=scorer), [], []

    def after_step(cache: DynamicCache) -> None:
        theirs.append(press_snapshot(press, 2))
        layer0.append(cache.layers[0].keys[0].clone())

    teacher_forced(model, press, sequence, length, after_step)
    full = DynamicCache()
    teacher_forced(model, None, sequence, length, cache=full)
    assert len(ours) == (6 if length == LONG else 4)
    assert len(theirs) == len(ours)
    for (our_positions, our_state), (their_positions, their_state), keys in zip(ours, theirs, layer0, strict=True):
        assert their_positions == our_positions
        for mine, engine in zip(their_state, our_state, strict=True):
            for name, value in engine.items():
                torch.testing.assert_close(mine[name], value, rtol=1e-6, atol=1e-7)
        for head, positions in enumerate(their_positions[0]):
            assert torch.equal(keys[head], full.layers[0].keys[0, head, positions])


def test_generate_under_the_press_samples_the_engines_greedy_tokens():
    """The user's path: `model.generate` inside `with press(model)` decodes greedily the engine's tokens."""
    model, ids = tiny_model("llama"), prompt(LONG)
    scorer = scorer_for(model)
    tokens, steps = engine_run(model, scorer, ids)
    with torch.no_grad(), ForesightPress(scorer=scorer)(model):
        generated = model.generate(
            ids, past_key_values=DynamicCache(), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None
        )
    assert len(steps) == 6 and generated[0, LONG:].tolist() == tokens


def test_a_scorer_of_another_model_shape_or_bad_sinks_is_refused_in_one_line():
    scorer = scorer_for(tiny_model("llama"))
    press = ForesightPress(scorer=scorer)
    with pytest.raises(ValueError, match=r"does not fit the model \(layers=3, ") as error:
        with press(tiny_model("llama", num_hidden_layers=3)):
            pass
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"sinks=13 must be an integer between 0 and B - L = 12$"):
        ForesightPress(scorer=scorer, sinks=13)


def test_the_press_takes_a_scorer_folder_or_hub_id_through_load_scorer(tmp_path, monkeypatch):
    """As the runtime's policy does: a folder is read as it is, a Hub id through the Hub's download (here a
    stand-in that serves the folder's files)."""
    scorer = scorer_for(tiny_model("qwen3"))
    scorer.save_pretrained(tmp_path)

    def download(repo_id: str, filename: str, **_) -> str:
        assert repo_id == "someone/tiny-qwen3-scorer"
        return str(tmp_path / filename)

    monkeypatch.setattr("foresight.scorer.model.hf_hub_download", download)
    for source in (tmp_path, "someone/tiny-qwen3-scorer"):
        assert weights_digest(ForesightPress(source).scorer) == weights_digest(scorer)


HELD_OUT_TRACES = 2


@pytest.mark.slow
def test_the_default_scorers_teacher_forced_loss_is_the_engines():
    """checkpoints/default (B = 128, L = 32) on the default model: the press's mean loss over each held-out
    trace's completion is the engine's replay's within 1e-4 relative (the two feed the tokens in other
    forwards, one at a time and in chunks of L, so their float32 sums differ)."""
    model, _ = load_model("default")
    press = ForesightPress("checkpoints/default")
    engine = EvictionEngine(model, Foresight(scorer=press.scorer), EvictionConfig(128, 32))
    for trace in list(TraceStore("data/corpus/gsm-heldout"))[:HELD_OUT_TRACES]:
        prompt_length = trace.prompt_length
        ours = engine.replay([trace.input_ids], [prompt_length]).nll[0][prompt_length - 1 :].mean()
        theirs = teacher_forced(model, press, trace.input_ids, prompt_length)[prompt_length - 1 :].mean()
        assert abs(theirs - ours) <= 1e-4 * ours, (trace.index, ours, theirs)


def docs_example() -> str:
    """The python block of docs/kvpress.md's section on the learned press."""
    section = (Path(__file__).resolve().parents[1] / "docs" / "kvpress.md").read_text()
    section = section.split("## The learned scorer as a kvpress press", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_docs_five_lines_decode_the_engines_greedy_tokens():
    """docs/kvpress.md's example as written, on the default model and a held-out prompt longer than B + L (its
    prefill step, then a step every L tokens): five lines, and the engine's greedy tokens."""
    example = docs_example()
    assert len([line for line in example.splitlines() if line.strip()]) == 5
    model, _ = load_model("default")
    trace = next(trace for trace in TraceStore("data/corpus/gsm-heldout") if trace.prompt_length >= 160)
    input_ids = trace.input_ids[None, : trace.prompt_length]
    scope = {"model": model, "input_ids": input_ids}
    with torch.no_grad():
        exec(compile(example, "docs/kvpress.md", "exec"), scope)
    new_tokens = scope["output"][0, trace.prompt_length :].tolist()
    engine = EvictionEngine(model, Foresight(scorer=scope["press"].scorer), EvictionConfig(128, 32))
    ours = engine.generate(input_ids.tolist(), len(new_tokens), eos_token_id=model.generation_config.eos_token_id)
    assert ours.stats.evictions >= 4
    assert new_tokens == ours.tokens[0]
