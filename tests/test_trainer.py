"""The supervised stage: the pairwise loss and metrics against loops, the training data against a dense
masked reference forward, the LightningModule, the LightningCLI configs, resume, DDP and `foresight fit`."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from torch.utils.data import DataLoader
from torchmetrics.functional import spearman_corrcoef
from transformers import AttentionInterface, Qwen2Config, Qwen3Config

from foresight import cli
from foresight.features import DECAY, FEATURE_NAMES, FeatureSet
from foresight.labels import LabelStore, compute_golden_labels
from foresight.models import describe, tiny_model
from foresight.commands.fit import lightning_args
from foresight.scorer import load_scorer
from foresight.traces import TraceStore, generate_traces
from tests.helpers import CHAT_TEMPLATE, DATA, char_tokenizer, scorer_spec, synthetic_traces
from trainers import data as data_module
from trainers.cli import cli_main
from trainers.data import concat_steps, golden_steps
from trainers.ranking import average_ranks, kept_overlap, pairwise_ranking_loss, spearman
from trainers.supervised import SupervisedScorer

REPO = Path(__file__).resolve().parents[1]
B, L_ = 16, 4
WINDOWS = {"last_8": 8, "last_16": 16, "last_32": 32}


# -- the loss and the metrics ---------------------------------------------------------------------
def loop_pairwise_loss(scores: torch.Tensor, alpha: torch.Tensor, margin: float) -> torch.Tensor:
    """Eq. 6 for one problem by a double loop: mean over pairs with α_i < α_j of max(0, m - (φ_j - φ_i))."""
    terms = [
        torch.clamp(margin - (scores[j] - scores[i]), min=0)
        for i, j in itertools.product(range(len(scores)), repeat=2)
        if alpha[i] < alpha[j]
    ]
    return torch.stack(terms).mean() if terms else scores.sum() * 0


@pytest.mark.parametrize("chunk_size", [1, 3, 256])
def test_pairwise_loss_and_gradient_equal_a_double_loop(chunk_size):
    generator = torch.Generator().manual_seed(0)
    scores = (torch.randn(2, 3, 9, generator=generator) * 0.01).requires_grad_()
    alpha = torch.randint(0, 4, (2, 3, 9), generator=generator).float()  # many ties: tied pairs do not count
    alpha[1, 2] = 1.0  # all equal: no pair
    loss, pairs = pairwise_ranking_loss(scores, alpha, margin=0.01, chunk_size=chunk_size)
    reference_scores = scores.detach().clone().requires_grad_()
    expected = torch.stack([
        torch.stack([loop_pairwise_loss(reference_scores[b, h], alpha[b, h], 0.01) for h in range(3)]) for b in range(2)
    ])
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-7)
    counts = [[sum(int(a < c) for a in alpha[b, h] for c in alpha[b, h]) for h in range(3)] for b in range(2)]
    assert pairs.tolist() == counts and pairs[1, 2] == 0 and loss[1, 2] == 0
    weights = torch.randn(2, 3, generator=generator)
    (loss * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(scores.grad, reference_scores.grad, rtol=0, atol=1e-6)
    assert scores.grad.abs().sum() > 0


def test_pairwise_loss_hand_computed():
    """α = (0, 1, 2): pairs (0,1), (0,2), (1,2). φ = (0, 0.005, 0.1): hinges 0.005, 0, 0 -> mean 0.005/3."""
    loss, pairs = pairwise_ranking_loss(torch.tensor([0.0, 0.005, 0.1]), torch.tensor([0.0, 1.0, 2.0]), margin=0.01)
    assert pairs == 3 and math.isclose(float(loss), 0.005 / 3, rel_tol=1e-6)


def test_kept_overlap_and_spearman_against_sets_and_torchmetrics():
    generator = torch.Generator().manual_seed(1)
    scores, alpha = torch.randn(4, 3, 12, generator=generator), torch.rand(4, 3, 12, generator=generator)
    overlap = kept_overlap(scores, alpha, 5)
    correlation = spearman(scores, alpha)
    for b, h in itertools.product(range(4), range(3)):
        kept = set(scores[b, h].argsort(descending=True)[:5].tolist())
        golden = set(alpha[b, h].argsort(descending=True)[:5].tolist())
        assert math.isclose(float(overlap[b, h]), len(kept & golden) / 5, rel_tol=1e-6)
        assert math.isclose(float(correlation[b, h]), float(spearman_corrcoef(scores[b, h], alpha[b, h])), abs_tol=1e-5)
    assert torch.isnan(spearman(scores, torch.ones_like(alpha))).all()


def test_ties_share_their_mean_rank_and_keep_the_lower_position():
    assert average_ranks(torch.tensor([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]
    # Keep 2 of (0.5, 0.9, 0.5, 0.5): position 1, then the tied 0.5 at the lowest position, 0. Golden
    # sets: {1, 0} by the same tie rule (overlap 1), and {1, 2} (overlap 1/2).
    scores = torch.tensor([0.5, 0.9, 0.5, 0.5])
    assert kept_overlap(scores, torch.tensor([0.0, 1.0, 0.0, 0.0]), 2) == 1.0
    assert kept_overlap(scores, torch.tensor([0.0, 1.0, 0.2, 0.0]), 2) == 0.5


# -- the training data against a dense reference ---------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny Llama and a character tokenizer saved as a model folder, so `load_model(folder)` works."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(folder)
    char_tokenizer(CHAT_TEMPLATE).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def traces_dir(tmp_path_factory, tiny_dir) -> Path:
    """Ten sampled traces of the tiny model (about 60-120 tokens each) with their labels for B=16, L=4."""
    out = tmp_path_factory.mktemp("traces")
    model, tokenizer = tiny_model("llama"), char_tokenizer(CHAT_TEMPLATE)
    generate_traces(model, tokenizer, str(DATA / "arithmetic.jsonl"), out_dir=out, num=10, max_new_tokens=40,
                    temperature=1.0, top_k=0, top_p=1.0, progress=False, model_name=str(tiny_dir))
    return out


def masked_reference(model, input_ids: torch.Tensor, labels) -> dict[int, tuple[torch.Tensor, ...]]:
    """One eager forward of the whole trace in which each query sees exactly the cache the golden
    schedule leaves it: after step t (position p_t = B + tL - 1) the kept set of step t plus the
    positions after p_t - L. Returns per layer (keys [Hkv, T, D], values, attention [Hq, T, T])."""
    total, (layers, kv_heads) = len(input_ids), labels.candidates.shape[1:3]
    budget, interval = labels.budget, labels.interval
    allowed = torch.ones(total, total, dtype=torch.bool).tril().repeat(layers, kv_heads, 1, 1)
    for step in range(1, labels.num_steps + 1):
        newest, kept = budget + step * interval - 1, labels.kept(step).long()
        for query in range(newest + 1, min(newest + interval, total - 1) + 1):
            allowed[:, :, query, :] = False
            allowed[:, :, query, newest - interval + 1 : query + 1] = True
            for layer, head in itertools.product(range(layers), range(kv_heads)):
                allowed[layer, head, query, kept[layer, head]] = True
    captured = {}

    def attend(module, query, key, value, attention_mask, scaling=None, **kwargs):
        group = query.shape[1] // key.shape[1]
        keys, values = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        logits = torch.einsum("bhqd,bhkd->bhqk", query, keys) * scaling
        mask = allowed[module.layer_idx].repeat_interleave(group, 0)
        weights = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)
        captured[module.layer_idx] = (key[0], value[0], weights[0])
        return (weights @ values).transpose(1, 2).contiguous(), None

    AttentionInterface.register("golden-masked-reference", attend)
    model.set_attn_implementation("golden-masked-reference")
    try:
        model(input_ids[None])
    finally:
        model.set_attn_implementation("sdpa")
    return captured


def reference_features(weights: torch.Tensor, candidates: torch.Tensor, step: int, budget: int, interval: int,
                       group: int) -> torch.Tensor:
    """The paper's features of `candidates` [B] for one KV head at `step`, by loops over query heads and
    blocks: window sums of this step's block, cumulative and decayed sums over the blocks so far."""
    per_head = []
    for g in range(group):
        received = [weights[g, budget + j * interval - interval : budget + j * interval, candidates] for j in range(1, step + 1)]
        block = received[-1]  # [L queries, B]
        values = {name: block[-min(size, interval):].sum(0) for name, size in WINDOWS.items()}
        values["last_L"] = block.sum(0)
        values["cumulative"] = sum(r.sum(0) for r in received)
        values["decayed"] = sum(DECAY ** (step - j) * r.sum(0) for j, r in enumerate(received, start=1))
        per_head.append(torch.stack([values[name] for name in FEATURE_NAMES[FeatureSet.PAPER]], -1))
    return torch.log1p(torch.cat(per_head, -1))


def test_examples_equal_a_dense_masked_reference(traces_dir):
    """Keys, values, features and α recorded along the golden schedule, for a batch of traces of
    different lengths, equal a full-sequence forward masked to the golden caches."""
    model = tiny_model("llama")
    by_length = {trace.input_ids.numel(): trace for trace in TraceStore(traces_dir)}
    traces = [by_length[length] for length in sorted(by_length)[-3:]]
    assert len(traces) == 3
    labels = [compute_golden_labels(model, trace.input_ids, B, L_) for trace in traces]
    examples = golden_steps(model, traces, labels, storage_dtype=torch.float32)
    shape = describe(model)
    for trace, label, example in zip(traces, labels, examples):
        reference = masked_reference(model, trace.input_ids, label)
        assert example["alpha"].shape == (label.num_steps, shape.num_layers, shape.num_kv_heads, B)
        torch.testing.assert_close(example["alpha"], label.alpha, rtol=0, atol=0)
        for step, layer, head in itertools.product(range(1, label.num_steps + 1), range(shape.num_layers),
                                                   range(shape.num_kv_heads)):
            keys, values, weights = reference[layer]
            candidates = label.candidates[step - 1, layer, head].long()
            group = shape.group_size
            recorded = {name: example[name][step - 1, layer, head] for name in ("keys", "values", "features")}
            torch.testing.assert_close(recorded["keys"], keys[head, candidates], rtol=0, atol=1e-5)
            torch.testing.assert_close(recorded["values"], values[head, candidates], rtol=0, atol=1e-5)
            expected = reference_features(weights[head * group : (head + 1) * group], candidates, step, B, L_, group)
            torch.testing.assert_close(recorded["features"], expected, rtol=0, atol=1e-5)


def test_making_examples_allocates_no_gradient_for_the_model(traces_dir):
    model = tiny_model("llama").requires_grad_(True)  # even a model left trainable gets no graph
    trace = next(iter(TraceStore(traces_dir)))
    labels = compute_golden_labels(model, trace.input_ids, B, L_)
    with torch.enable_grad():
        (example,) = golden_steps(model, [trace], [labels])
    assert all(not tensor.requires_grad and tensor.grad_fn is None for tensor in example.values())
    assert all(parameter.grad is None for parameter in model.parameters())


# -- the LightningModule ----------------------------------------------------------------------------
def test_training_updates_only_the_scorer_and_learns_a_learnable_ranking(tmp_path):
    module = SupervisedScorer(scorer_spec(), lr=3e-2)
    assert {id(p) for p in module.parameters()} == {id(p) for p in module.scorer.parameters()}
    train = DataLoader(synthetic_traces(8, 4), batch_size=2, shuffle=True, collate_fn=concat_steps)
    val = DataLoader(synthetic_traces(2, 4, seed=1), batch_size=2, collate_fn=concat_steps)
    trainer = L.Trainer(max_steps=80, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    before = trainer.validate(module, val, verbose=False)[0]
    trainer.fit(module, train, val)
    after = trainer.validate(module, val, verbose=False)[0]
    assert after["val/loss"] < 0.5 * before["val/loss"]
    assert after["val/spearman"] > 0.9 > before["val/spearman"] + 0.3
    assert after["val/overlap"] > 0.85
    assert trainer.optimizers[0].param_groups[0]["lr"] < 1e-4  # the cosine schedule ran down to ~0
    assert "val/overlap_cumulative" in after
    batch = next(iter(train))
    group = batch["features"].shape[-1] // 6
    cumulative = torch.stack([batch["features"][..., g * 6 + 4] for g in range(group)], -1).mean(-1)
    torch.testing.assert_close(module.cumulative_attention(batch), cumulative)
    module._loss(module(batch), batch["alpha"]).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())


def test_module_rejects_bad_hyperparameters():
    with pytest.raises(ValueError, match="need lr > 0"):
        SupervisedScorer(scorer_spec(), lr=0.0)


# -- LightningCLI: configs, fit, resume, DDP --------------------------------------------------------
def tiny_config(path: Path, tiny_dir: Path, **data) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 4, "log_every_n_steps": 1,
                    "enable_progress_bar": False, "enable_model_summary": False},
        "model": {"lr": 0.01},
        "data": {"model": str(tiny_dir), "traces_dir": str(path.parent / "unused"), "budget": B, "interval": L_,
                 "batch_size": 2, "holdout": 0.2, **data},
    }
    path.write_text(yaml.safe_dump(config))
    return path


PAPER_MODELS = {
    "qwen3-4b.yaml": ("Qwen/Qwen3-4B", Qwen3Config(num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                                   head_dim=128, hidden_size=2560)),
    "qwen3-1.7b.yaml": ("Qwen/Qwen3-1.7B", Qwen3Config(num_hidden_layers=28, num_attention_heads=16,
                                                       num_key_value_heads=8, head_dim=128, hidden_size=2048)),
    "r1-distill-qwen-7b.yaml": ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
                                Qwen2Config(num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                            hidden_size=3584)),
}


@pytest.mark.parametrize("name", sorted(PAPER_MODELS))
def test_paper_configs_hold_the_papers_settings_and_build(name, monkeypatch):
    model_id, model_config = PAPER_MODELS[name]
    monkeypatch.setattr(data_module, "base_model_config", lambda requested: model_config)  # no hub here
    config = yaml.safe_load((REPO / "configs" / name).read_text())
    assert config["data"]["model"] == model_id
    assert (config["data"]["budget"], config["data"]["interval"]) == (1024, 256)
    assert config["data"]["batch_size"] * config["trainer"].get("accumulate_grad_batches", 1) == 8
    assert config["model"]["lr"] == 1e-2 and config["model"]["margin"] == 0.01
    assert config["trainer"]["max_steps"] == 1000
    built = cli_main(["--config", str(REPO / "configs" / name), "--trainer.accelerator=cpu"], run=False)  # no GPU here
    scorer = built.model.scorer.config
    assert (scorer.budget, scorer.interval, scorer.base_model) == (1024, 256, model_id)
    assert (scorer.num_layers, scorer.num_kv_heads) == (model_config.num_hidden_layers, model_config.num_key_value_heads)


def test_default_config_builds_for_the_default_model(monkeypatch):
    monkeypatch.setattr(data_module, "base_model_config",
                        lambda requested: tiny_model("llama", num_hidden_layers=30, num_attention_heads=9,
                                                     num_key_value_heads=3, head_dim=64, hidden_size=576).config)
    built = cli_main(["--config", str(REPO / "configs" / "default.yaml")], run=False)
    assert built.datamodule.model_name == "default" and built.datamodule.cache_dir is not None
    assert built.model.scorer.config.num_layers == 30


def weights(path: Path) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in torch.load(path, weights_only=True)["state_dict"].items()}


def fit_args(config: Path, out: Path, traces: Path, *overrides: str) -> list[str]:
    return ["fit", "--config", str(config), "--out", str(out), "--traces", str(traces),
            *itertools.chain.from_iterable(("--set", item) for item in overrides)]


class StopAfterFirstEpoch(L.Callback):
    def on_train_epoch_end(self, trainer, module):
        trainer.should_stop = True


def test_fit_trains_exports_and_resumes_from_last(tmp_path, tiny_dir, traces_dir, capsys):
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir)
    two_epochs = ("trainer.max_epochs=2", "trainer.max_steps=-1")
    whole = tmp_path / "whole"
    assert cli.main(fit_args(config, whole, traces_dir, *two_epochs)) == 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert last_line.startswith(f"{whole / 'scorer'}: scorer trained for ")
    assert "train/loss" in last_line and "val/overlap" in last_line and "val/spearman" in last_line
    steps = int(last_line.split("trained for ")[1].split()[0])
    assert steps % 2 == 0 and steps >= 2
    # The exported folder is the final scorer.
    scorer = load_scorer(whole / "scorer")
    final = weights(whole / "checkpoints" / "last.ckpt")
    for name, tensor in scorer.state_dict().items():
        torch.testing.assert_close(tensor, final[f"scorer.{name}"], rtol=0, atol=0)
    assert {"README.md", "config.json", "model.safetensors"} <= {p.name for p in (whole / "scorer").iterdir()}
    # The same run stopped after its first epoch (as if killed), then resumed from last.ckpt: the same weights.
    split = tmp_path / "split"
    args = fit_args(config, split, traces_dir, *two_epochs)
    interrupted = cli_main(lightning_args(cli.build_parser().parse_args(args))[1:], run=False)  # no subcommand
    interrupted.trainer.callbacks.append(StopAfterFirstEpoch())
    interrupted.trainer.fit(interrupted.model, datamodule=interrupted.datamodule)
    assert interrupted.trainer.global_step == steps // 2
    assert cli.main([*args, "--ckpt-path", "last"]) == 0
    checkpoint = torch.load(split / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == steps
    for name, tensor in final.items():
        torch.testing.assert_close(checkpoint["state_dict"][name], tensor, rtol=0, atol=1e-6)
    # One cache file per labelled trace, made once and read by both runs.
    labelled = len(list(LabelStore(traces_dir, B, L_).directory.iterdir()))
    assert len(list((split / "features").rglob("*.safetensors"))) == labelled


def test_fit_without_a_cache_replays_the_traces_each_pass(tmp_path, tiny_dir, traces_dir, capsys):
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir)
    out = tmp_path / "run"
    assert cli.main(fit_args(config, out, traces_dir, "data.cache_dir=null", "trainer.max_steps=3")) == 0
    assert not (out / "features").exists()
    assert "scorer trained for 3 steps" in capsys.readouterr().out
    # The LearningRateMonitor logs the cosine schedule from lr = 0.01 to 0 at every step.
    logged = tensorboard_scalars(out, "train/lr")
    assert sorted(logged) == [0, 1, 2]
    for step, value in logged.items():
        assert math.isclose(value, 0.005 * (1 + math.cos(math.pi * step / 3)), rel_tol=1e-6)


def test_fit_makes_its_traces_from_the_recipe(tmp_path, tiny_dir, capsys):
    recipe = {"prompts": str(DATA / "arithmetic.jsonl"), "num": 4, "max_new_tokens": 30, "temperature": 1.0,
              "top_k": 0, "top_p": 1.0, "batch_size": 4}
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir, generate=recipe, holdout=0.0)
    out = tmp_path / "run"
    assert cli.main(["fit", "--config", str(config), "--out", str(out), "--set", "trainer.max_steps=2"]) == 0
    assert len(TraceStore(out / "traces")) == 4
    assert (out / "traces" / f"labels-B{B}-L{L_}").is_dir() and (out / "scorer" / "model.safetensors").is_file()
    assert "scorer trained for 2 steps" in capsys.readouterr().out


def test_fit_errors_are_one_line(tmp_path, tiny_dir, traces_dir, capsys):
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir)
    assert cli.main(["fit", "--config", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "x")]) == 2
    assert "config" in capsys.readouterr().err
    assert cli.main(fit_args(config, tmp_path / "x", traces_dir, "trainer.max_steps")) == 2
    assert "--set 'trainer.max_steps' must look like KEY=VALUE" in capsys.readouterr().err
    other = tiny_config(tmp_path / "other.yaml", tiny_dir, model=str(tmp_path / "another-model"))
    assert cli.main(fit_args(other, tmp_path / "y", traces_dir)) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "another-model" in error


def tensorboard_scalars(run: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (logs,) = {events.parent for events in run.rglob("events.out.tfevents.*")}  # one run: fit, then validate
    accumulator = EventAccumulator(str(logs))
    accumulator.Reload()
    return {event.step: event.value for event in accumulator.Scalars(tag)}


@pytest.mark.slow
def test_ddp_on_two_processes_matches_one_process_at_the_same_global_batch(tmp_path, tiny_dir, traces_dir):
    """Two gloo processes with 2 traces each per step against one process with 4: the logged losses
    and the trained weights agree (the same shuffled global batches; the loss is normalised by the
    global problem count)."""
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir, holdout=0.0, cache_dir=str(tmp_path / "features"),
                         traces_dir=str(traces_dir))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    runs = {}
    for name, devices, batch in (("one", 1, 4), ("two", 2, 2)):
        out = tmp_path / name
        command = [sys.executable, "-m", "trainers.cli", "fit", f"--config={config}", "--trainer.max_steps=3",
                   f"--trainer.devices={devices}", "--trainer.strategy=ddp" if devices > 1 else "--trainer.strategy=auto",
                   f"--data.batch_size={batch}", f"--trainer.default_root_dir={out}", f"--checkpoint.dirpath={out}/ckpt"]
        subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
        runs[name] = out
    one, two = (tensorboard_scalars(runs[name], "train/loss") for name in ("one", "two"))
    assert sorted(one) == sorted(two) and len(one) == 3
    for step in one:
        assert math.isclose(one[step], two[step], rel_tol=1e-4), (step, one[step], two[step])
    trained = [weights(runs[name] / "ckpt" / "last.ckpt") for name in ("one", "two")]
    for name, tensor in trained[0].items():
        torch.testing.assert_close(trained[1][name], tensor, rtol=1e-4, atol=1e-6)
