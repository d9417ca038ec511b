"""The supervised stage: the pairwise loss and metrics against loops, the LightningModule, the data module
(it reads and makes nothing), the LightningCLI configs, resume, DDP and `foresight fit` (its steps are the
verbs' functions)."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import yaml
from torch.utils.data import DataLoader
from torchmetrics.functional import spearman_corrcoef
from transformers import Qwen2Config, Qwen3Config

from foresight import cli
from foresight.commands import fit
from foresight.data.trace_store import TraceStore
from foresight.labels import LabelStore
from foresight.models import load_model
from foresight.scorer.model import load_scorer
from tests.fit_configs import tiny_config
from tests.prompts import DATA
from tests.scorers import default_shaped_config, quiet_trainer, scorer_spec, synthetic_traces
from trainers import data as data_module
from trainers import data_stage, supervised
from trainers.cli import cli_main
from trainers.data import GoldenDataModule, concat_steps
from trainers.data_stage import FrozenModel, make_labels
from trainers.example_cache import ExampleCache, ExampleKey
from trainers.fitting import MEMBER_LOCK, lightning_args, prepare
from trainers.preparation import make_examples, scorer_trajectory
from trainers.ranking import PairWeight, average_ranks, kept_overlap, pairwise_ranking_loss, spearman
from trainers.supervised import SupervisedScorer

REPO = Path(__file__).resolve().parents[1]
B, L_ = 16, 4


# -- the loss and the metrics ---------------------------------------------------------------------
def loop_pairwise_loss(
    scores: torch.Tensor, alpha: torch.Tensor, margin: float, lowest: int | None = None, gap: bool = False
) -> torch.Tensor:
    """Eq. 6 for one problem by a double loop: mean over pairs with α_i < α_j of max(0, m - (φ_j - φ_i)),
    i restricted to the `lowest` entries a golden step evicts (sorted by α, then newest first); with `gap`,
    the mean weighted by α_j − α_i."""
    rows = range(len(scores))
    if lowest is not None:
        rows = sorted(rows, key=lambda n: (float(alpha[n]), -n))[:lowest]
    pairs = [(i, j) for i, j in itertools.product(rows, range(len(scores))) if alpha[i] < alpha[j]]
    if not pairs:
        return scores.sum() * 0
    terms = torch.stack([torch.clamp(margin - (scores[j] - scores[i]), min=0) for i, j in pairs])
    weights = torch.stack([alpha[j] - alpha[i] if gap else torch.tensor(1.0) for i, j in pairs])
    return (terms * weights).sum() / weights.sum()


@pytest.mark.parametrize("block", [None, 9, 200])  # whole batch; one problem's row chunk; a few problems
@pytest.mark.parametrize("weight", list(PairWeight))
@pytest.mark.parametrize("lowest", [None, 1, 3, 9])
@pytest.mark.parametrize("chunk_size", [1, 3, 256])
def test_pairwise_loss_and_gradient_equal_a_double_loop(chunk_size, lowest, weight, block):
    generator = torch.Generator().manual_seed(0)
    scores = (torch.randn(2, 3, 9, generator=generator) * 0.01).requires_grad_()
    alpha = torch.randint(0, 4, (2, 3, 9), generator=generator).float()  # many ties: tied pairs do not count
    alpha[1, 2] = 1.0  # all equal: no pair
    loss, pairs = pairwise_ranking_loss(
        scores, alpha, margin=0.01, chunk_size=chunk_size, lowest=lowest, weight=weight, block_elements=block
    )
    reference_scores = scores.detach().clone().requires_grad_()
    gap = weight is PairWeight.GAP
    expected = torch.stack(
        [
            torch.stack([loop_pairwise_loss(reference_scores[b, h], alpha[b, h], 0.01, lowest, gap) for h in range(3)])
            for b in range(2)
        ]
    )
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-7)
    if lowest in (None, 9) and gap:  # the total weight: Σ over pairs of α_j − α_i
        sums = [
            [sum(float(c - a) for a in alpha[b, h] for c in alpha[b, h] if a < c) for h in range(3)] for b in range(2)
        ]
        torch.testing.assert_close(pairs, torch.tensor(sums), rtol=1e-6, atol=0)
    elif lowest in (None, 9):  # every entry is some pair's lower member
        counts = [[sum(int(a < c) for a in alpha[b, h] for c in alpha[b, h]) for h in range(3)] for b in range(2)]
        assert pairs.tolist() == counts
    assert pairs[1, 2] == 0 and loss[1, 2] == 0
    weights = torch.randn(2, 3, generator=generator)
    (loss * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(scores.grad, reference_scores.grad, rtol=0, atol=1e-6)
    assert scores.grad.abs().sum() > 0


@pytest.mark.parametrize("shape", [(0, 5), (2, 0, 5), (3, 0)])
def test_pairwise_loss_of_no_problem_or_no_candidate_is_empty_or_zero(shape):
    for weight in PairWeight:
        loss, pairs = pairwise_ranking_loss(torch.zeros(shape), torch.zeros(shape), weight=weight)
        assert loss.shape == pairs.shape == shape[:-1] and not loss.any() and not pairs.any()


def test_pairwise_loss_hand_computed():
    """α = (0, 1, 2): pairs (0,1), (0,2), (1,2). φ = (0, 0.005, 0.1): hinges 0.005, 0, 0 -> mean 0.005/3.
    Only the pairs of the one entry a golden step evicts, entry 0: (0,1), (0,2) -> mean 0.005/2."""
    scores, alpha = torch.tensor([0.0, 0.005, 0.1]), torch.tensor([0.0, 1.0, 2.0])
    loss, pairs = pairwise_ranking_loss(scores, alpha, margin=0.01)
    assert pairs == 3 and math.isclose(float(loss), 0.005 / 3, rel_tol=1e-6)
    loss, pairs = pairwise_ranking_loss(scores, alpha, margin=0.01, lowest=1)
    assert pairs == 2 and math.isclose(float(loss), 0.005 / 2, rel_tol=1e-6)
    # On a tie the golden step evicts the newer entry: α = (1, 1, 2) evicts entry 1, pair (1,2) only.
    loss, pairs = pairwise_ranking_loss(
        torch.tensor([0.0, 0.1, 0.105]), torch.tensor([1.0, 1.0, 2.0]), margin=0.01, lowest=1
    )
    assert pairs == 1 and math.isclose(float(loss), 0.005, rel_tol=1e-6)
    with pytest.raises(ValueError, match="lowest must be in 1..3"):
        pairwise_ranking_loss(scores, alpha, lowest=0)


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


# -- the LightningModule ----------------------------------------------------------------------------
@pytest.mark.parametrize(("pairs", "pair_weight"), [("all", "uniform"), ("evicted", "uniform"), ("all", "gap")])
def test_training_updates_only_the_scorer_and_learns_a_learnable_ranking(tmp_path, pairs, pair_weight):
    """Both pair sets and both weightings learn which entries to keep; only all pairs also order the kept ones."""
    module = SupervisedScorer(scorer_spec(), lr=3e-2, pairs=pairs, pair_weight=pair_weight)
    assert {id(p) for p in module.parameters()} == {id(p) for p in module.scorer.parameters()}
    train = DataLoader(synthetic_traces(8, 4), batch_size=2, shuffle=True, collate_fn=concat_steps)
    val = DataLoader(synthetic_traces(2, 4, seed=1), batch_size=2, collate_fn=concat_steps)
    trainer = quiet_trainer(80, tmp_path)
    before = trainer.validate(module, val, verbose=False)[0]
    trainer.fit(module, train, val)
    after = trainer.validate(module, val, verbose=False)[0]
    assert after["val/loss"] < 0.5 * before["val/loss"]
    if pairs == "all":
        assert after["val/spearman"] > 0.9 > before["val/spearman"] + 0.3
    assert after["val/overlap"] > 0.85 and after["val/overlap"] > before["val/overlap"] + 0.1, (before, after)
    assert trainer.optimizers[0].param_groups[0]["lr"] < 1e-4  # the cosine schedule ran down to ~0
    assert "val/overlap_cumulative" in after
    batch = next(iter(train))
    group = batch["features"].shape[-1] // 6
    cumulative = torch.stack([batch["features"][..., g * 6 + 4] for g in range(group)], -1).mean(-1)
    torch.testing.assert_close(module.cumulative_attention(batch), cumulative)
    if pairs == "all":  # the evicted pairs can all meet the margin by now: no gradient left
        module._loss(module(batch), batch["alpha"]).backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.trained_parameters())
        assert module.scorer.b2.grad is None  # frozen: it ranks nothing


def test_key_values_false_builds_a_features_only_scorer():
    module = SupervisedScorer(scorer_spec(), key_values=False)
    assert module.scorer.config.key_values is False
    assert module.scorer.w1.shape[-2] == module.scorer.config.feature_width


def test_module_rejects_bad_hyperparameters():
    with pytest.raises(ValueError, match="need lr > 0"):
        SupervisedScorer(scorer_spec(), lr=0.0)
    with pytest.raises(ValueError, match="unknown ranking pairs 'some'; allowed: 'all', 'evicted'"):
        SupervisedScorer(scorer_spec(), pairs="some")
    with pytest.raises(ValueError, match="unknown .*'flat'; allowed: 'uniform', 'gap'"):
        SupervisedScorer(scorer_spec(), pair_weight="flat")
    with pytest.raises(ValueError, match="pair_block must be a positive number of pairs or null, got 0"):
        SupervisedScorer(scorer_spec(), pair_block=0)
    with pytest.raises(ValueError, match="pair_chunk must be a positive number of pairs, got -1"):
        SupervisedScorer(scorer_spec(), pair_chunk=-1)


# -- the data module reads; it makes nothing -------------------------------------------------------
def listing(folder: Path) -> set[Path]:
    return set(folder.rglob("*"))


def test_the_data_module_makes_no_labels_and_no_features(fresh_traces, tiny_dir):
    before = listing(fresh_traces.parent)
    replayed = GoldenDataModule(str(fresh_traces), B, L_, model=str(tiny_dir))
    with pytest.raises(ValueError) as error:
        replayed.setup()
    message = str(error.value)
    assert "golden labels of trace" in message and "\n" not in message
    assert f"make them with `foresight labels --traces {fresh_traces} --budget {B} --interval {L_}`" in message
    cached = GoldenDataModule(
        str(fresh_traces), B, L_, model=str(tiny_dir), examples_dir=str(fresh_traces.parent / "f")
    )
    with pytest.raises(ValueError, match="holds no features") as error:
        cached.setup()
    assert cached.examples.remake_command in str(error.value)
    assert listing(fresh_traces.parent) == before  # nothing written: no labels, no cache


def test_cached_batches_come_from_workers_in_the_samplers_order_and_the_storage_dtype(tmp_path, tiny_dir, traces_dir):
    """Worker processes and the storage dtype change how batches travel, not which: the same traces in the
    same order as one process, each epoch; the scorer casts them to float32 on the device."""
    frozen = FrozenModel(str(tiny_dir))
    make_labels(frozen, traces_dir, B, L_, progress=False)
    key = ExampleKey(str(tiny_dir), "float32", B, L_, "paper", "float16")
    make_examples(frozen, ExampleCache(tmp_path / "examples", traces_dir, key), progress=False)
    modules = [
        GoldenDataModule(
            str(traces_dir),
            B,
            L_,
            model=str(tiny_dir),
            examples_dir=str(tmp_path / "examples"),
            batch_size=2,
            num_workers=workers,
        )
        for workers in (None, 0)
    ]
    loaders = []
    for module in modules:
        module.setup("fit")
        loaders.append(module.train_dataloader())
    workers, one_process = loaders
    assert (workers.num_workers, workers.persistent_workers, workers.pin_memory) == (2, True, False)
    assert (one_process.num_workers, one_process.persistent_workers) == (0, False)
    for epoch in (0, 1):
        for loader in loaders:
            loader.sampler.set_epoch(epoch)
        batches = list(workers)
        assert len(batches) == len(list(one_process)) > 1
        for batch, expected in zip(batches, one_process):
            assert batch.keys() == expected.keys() and all(torch.equal(batch[n], expected[n]) for n in batch)
            assert batch["keys"].dtype == torch.float16 and batch["alpha"].dtype == torch.float32
    scorer = supervised.SupervisedScorer(modules[0].scorer_spec)
    cast = {name: tensor.float() for name, tensor in batches[0].items()}
    assert torch.equal(scorer(batches[0]), scorer(cast))  # the half batch is cast inside, exactly
    replayed = GoldenDataModule(str(traces_dir), B, L_, model=str(tiny_dir), pin_memory=None)
    assert replayed._loading() == {"num_workers": 0, "pin_memory": False, "persistent_workers": False}
    replayed.trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    assert replayed._loading()["pin_memory"] is True  # pinned when the trainer runs on CUDA
    with pytest.raises(ValueError, match="num_workers must be at least 0 \\(or null for the default\\), got -1"):
        GoldenDataModule(str(traces_dir), B, L_, model=str(tiny_dir), num_workers=-1)


# -- LightningCLI: configs, fit, resume, DDP --------------------------------------------------------
PAPER_MODELS = {
    "qwen3-4b.yaml": (
        "Qwen/Qwen3-4B",
        Qwen3Config(
            num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=2560
        ),
    ),
    "qwen3-1.7b.yaml": (
        "Qwen/Qwen3-1.7B",
        Qwen3Config(
            num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, hidden_size=2048
        ),
    ),
    "r1-distill-qwen-7b.yaml": (
        "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
        Qwen2Config(num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_size=3584),
    ),
}


@pytest.mark.parametrize("name", sorted(PAPER_MODELS))
def test_paper_configs_hold_the_papers_settings_and_build(name, monkeypatch, tmp_path):
    model_id, model_config = PAPER_MODELS[name]
    monkeypatch.setattr(data_module, "load_config", lambda requested: model_config)  # no hub here
    path = REPO / "configs" / name
    config = yaml.safe_load(path.read_text())
    assert config["data"]["model"] == model_id
    assert (config["data"]["budget"], config["data"]["interval"]) == (1024, 256)
    assert config["data"]["batch_size"] * config["trainer"].get("accumulate_grad_batches", 1) == 8
    assert config["model"]["lr"] == 1e-2 and config["model"]["margin"] == 0.01
    assert config["trainer"]["max_steps"] == 1000
    assert config["traces"]["only_correct"] and config["traces"]["min_tokens"] == 4096
    shipped = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())  # the recipe the project ships
    assert config["data"]["feature_set"] == shipped["data"]["feature_set"]
    assert config["model"]["pair_weight"] == shipped["model"]["pair_weight"]
    assert "--ensemble 5" in path.read_text().split("\nseed_everything")[0]  # the header says why one fit
    built = cli_main(["--config", str(path), "--trainer.accelerator=cpu"], run=False)  # no GPU here
    scorer = built.model.scorer.config
    assert (scorer.budget, scorer.interval, scorer.base_model) == (1024, 256, model_id)
    assert (scorer.num_layers, scorer.num_kv_heads) == (
        model_config.num_hidden_layers,
        model_config.num_key_value_heads,
    )
    assert built.datamodule.examples is None and built.datamodule.frozen.dtype == torch.bfloat16
    # `foresight fit` keeps a replaying config replaying (at B = 1024 a cache would take terabytes).
    args = cli.build_parser().parse_args(["fit", "--config", str(path), "--out", str(tmp_path)])
    assert not any(arg.startswith("--data.examples_dir") for arg in lightning_args(fit.request(args)))


def test_default_config_builds_for_the_default_model(monkeypatch, tmp_path):
    monkeypatch.setattr(
        data_module,
        "load_config",
        lambda requested: default_shaped_config(),
    )
    built = cli_main(["--config", str(REPO / "configs" / "default.yaml")], run=False)
    assert built.datamodule.model_name == "default" and built.model.scorer.config.num_layers == 30
    assert built.datamodule.examples.key == ExampleKey("default", "float32", 128, 32, "standardised", "float16")
    assert built.model.hparams.pair_weight == "gap" and built.trainer.max_steps == 600
    assert built.config_init.traces.prompts == "reasoning-gym:gsm_symbolic" and built.config_init.ensemble.members == 5
    args = cli.build_parser().parse_args(
        ["fit", "--config", str(REPO / "configs" / "default.yaml"), "--out", str(tmp_path), "--set", "traces.num=24"]
    )
    assert f"--data.examples_dir={tmp_path / 'examples'}" in lightning_args(fit.request(args))
    assert "--traces.num=24" in lightning_args(fit.request(args))  # scripts/main.sh's overrides


def weights(path: Path) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in torch.load(path, weights_only=True)["state_dict"].items()}


def fit_args(config: Path, out: Path, traces: Path, *overrides: str) -> list[str]:
    return [
        "fit",
        "--config",
        str(config),
        "--out",
        str(out),
        "--traces",
        str(traces),
        *itertools.chain.from_iterable(("--set", item) for item in overrides),
    ]


class StopAfterFirstEpoch(L.Callback):
    def on_train_epoch_end(self, trainer, module):
        trainer.should_stop = True


def test_fit_trains_exports_and_resumes_from_last(tmp_path, tiny_dir, traces_dir, capsys):
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir)
    two_epochs = ("trainer.max_epochs=2", "trainer.max_steps=-1")
    whole = tmp_path / "whole"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(fit_args(config, whole, traces_dir, *two_epochs)) == 0
    assert not [str(w.message) for w in caught if "LeafSpec" in str(w.message)]  # third-party notices silenced
    printed = capsys.readouterr()
    assert "Tip:" not in printed.err + printed.out
    last_line = printed.out.strip().splitlines()[-1]
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
    card = (whole / "scorer" / "README.md").read_text()
    assert "- ranking loss: hinge with margin 0.01 over every pair with α_i < α_j, each alike (Eq. 6)" in card
    # The same run stopped after its first epoch (as if killed), then resumed from last.ckpt: the same weights.
    split = tmp_path / "split"
    args = fit_args(config, split, traces_dir, *two_epochs)
    interrupted = prepare(fit.request(cli.build_parser().parse_args(args)))
    interrupted.trainer.callbacks.append(StopAfterFirstEpoch())
    interrupted.trainer.fit(interrupted.model, datamodule=interrupted.datamodule)
    assert interrupted.trainer.global_step == steps // 2
    assert cli.main([*args, "--ckpt-path", "last"]) == 0
    checkpoint = torch.load(split / "checkpoints" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == steps
    for name, tensor in final.items():
        torch.testing.assert_close(checkpoint["state_dict"][name], tensor, rtol=0, atol=1e-6)
    # One cache file per labelled trace, made once by the features step of the first run.
    labelled = len(list(LabelStore(traces_dir, B, L_).directory.iterdir()))
    assert len(list((split / "examples").glob("trace-*.safetensors"))) == labelled
    assert (
        f"examples: {split / 'examples'}: made the examples of 0 traces" in capsys.readouterr().err
    )  # a step of the run: a diagnostic


def test_fit_without_a_cache_replays_the_traces_each_pass(tmp_path, tiny_dir, traces_dir, capsys):
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir, examples_dir=None)
    out = tmp_path / "run"
    assert cli.main(fit_args(config, out, traces_dir, "trainer.max_steps=3")) == 0
    assert not (out / "examples").exists()
    printed = capsys.readouterr().out
    assert "features:" not in printed and "scorer trained for 3 steps" in printed
    # The LearningRateMonitor logs the cosine schedule from lr = 0.01 to 0 at every step.
    logged = tensorboard_scalars(out, "train/lr")
    assert sorted(logged) == [0, 1, 2]
    for step, value in logged.items():
        assert math.isclose(value, 0.005 * (1 + math.cos(math.pi * step / 3)), rel_tol=1e-6)


def test_a_distilled_fit_ranks_by_its_teacher_and_logs_the_agreement(
    tmp_path, tiny_dir, traces_dir, start_scorer, capsys
):
    """With model.teacher the loss orders candidates by the teacher's scores: after the fit the student misses at
    most 3/4 of what the same run barely moved (lr 1e-9) misses of the teacher's kept sets (two random scorers of
    the tiny model's features already agree on most); the card names the teacher; a teacher of other inputs, or
    one beside calibration, is refused in one line."""
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir)
    teacher = (f"model.teacher={start_scorer}", "trainer.max_steps=24")

    def agreement(name: str, lr: str) -> float:
        assert cli.main(fit_args(config, tmp_path / name, traces_dir, *teacher, f"model.lr={lr}")) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        return float(last.split("val/teacher_overlap ")[1].split()[0].rstrip(","))

    assert 1 - agreement("student", "0.05") < 0.75 * (1 - agreement("unmoved", "1e-9"))
    assert f"the teacher {start_scorer}" in (tmp_path / "student" / "scorer" / "README.md").read_text()
    for override, message in (
        ("data.budget=24", f"teacher {start_scorer} reads other inputs: budget 16 (this run: 24)"),
        ("model.calibration=0.1", "calibration=0.1 regresses on log α, while a distilled fit"),
    ):
        assert cli.main(fit_args(config, tmp_path / "refused", traces_dir, *teacher, override)) == 2
        error = capsys.readouterr().err.strip()
        assert message in error and "\n" not in error, error


def test_a_residual_fit_exports_a_scorer_that_corrects_its_feature(tmp_path, tiny_dir, traces_dir):
    """model.residual through `foresight fit`: the exported scorer adds the MLP to the group's mean last_1 column,
    and the fit moved the output layer off its zero start."""
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir, feature_set="standardised-heuristic")
    out = tmp_path / "residual"
    assert cli.main(fit_args(config, out, traces_dir, "model.residual=last_1", "trainer.max_steps=3")) == 0
    scorer = load_scorer(out / "scorer")
    assert scorer.config.residual == "last_1" and scorer.config.feature_set.value == "standardised-heuristic"
    assert bool(scorer.w2.abs().sum() > 0)


def test_a_transfer_fit_saves_its_models_output_factors_and_evaluates(tmp_path, tiny_dir, traces_dir):
    """data.feature_set=transfer through `foresight fit`: the exported scorer holds the output factors of the model it
    was fitted with (a fresh scorer set from that model has the same), and `foresight eval` replays with it."""
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir, feature_set="transfer")
    out = tmp_path / "transfer"
    assert cli.main(fit_args(config, out, traces_dir, "trainer.max_steps=3")) == 0
    scorer = load_scorer(out / "scorer")
    assert scorer.config.feature_set.value == "transfer" and not scorer.needs_output_factors
    fresh = type(scorer)(scorer.config)
    fresh.set_output_factors(load_model(str(tiny_dir))[0])
    assert torch.equal(fresh.output_factors, scorer.output_factors)
    run = ["eval", "--traces", str(traces_dir), "--model", str(tiny_dir), "-B", str(B), "-L", str(L_)]
    run += ["--policies", "full,tova", "--scorer", f"transfer={out / 'scorer'}", "--out", str(tmp_path / "eval")]
    assert cli.main(run) == 0
    rows = json.loads((tmp_path / "eval" / "traces.json").read_text())
    assert {row["policy"] for row in rows} >= {"transfer", "tova"}


def test_fit_on_another_label_kind_makes_and_reads_its_own_labels_and_examples(tmp_path, tiny_dir, traces_dir):
    """`data.label_kind: value`: the fit makes the value labels beside α's and an example cache keyed to them."""
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir)
    out = tmp_path / "value"
    assert cli.main(fit_args(config, out, traces_dir, "data.label_kind=value", "trainer.max_steps=2")) == 0
    labelled = sum(trace.input_ids.numel() >= B + L_ for trace in TraceStore(traces_dir))
    assert len(list(LabelStore(traces_dir, B, L_, "value").directory.glob("trace-*.safetensors"))) == labelled > 0
    assert json.loads((out / "examples" / "examples.json").read_text())["label_kind"] == "value"


def test_a_fit_on_the_first_traces_of_each_source_labels_and_caches_only_those(tmp_path, tiny_dir, fresh_traces):
    """`data.per_source: N` (a fold study's training sample): labels, examples and the fit read the first N traces of
    each prompt source, by problem index, and nothing else."""
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir)
    out = tmp_path / "sample"
    assert cli.main(fit_args(config, out, fresh_traces, "data.per_source=3", "trainer.max_steps=2")) == 0
    first = [trace.index for trace in TraceStore(fresh_traces).first_of_each(3) if trace.input_ids.numel() >= B + L_]
    labelled = sorted(LabelStore(fresh_traces, B, L_).directory.glob("trace-*.safetensors"))
    cached = sorted((out / "examples").glob("trace-*.safetensors"))
    assert (
        [path.name for path in labelled]
        == [path.name for path in cached]
        == [f"trace-{index:06d}.safetensors" for index in first]
    )
    assert 0 < len(first) < len(TraceStore(fresh_traces))
    with pytest.raises(ValueError, match=r"per_source must be at least 1 \(or null for every trace\), got 0"):
        GoldenDataModule(str(fresh_traces), B, L_, model=str(tiny_dir), per_source=0)


def test_fit_runs_the_verbs_steps_and_resumes_each(tmp_path, tiny_dir, capsys, monkeypatch):
    """Traces from the recipe, labels, features and training, each step printed; a rerun finds every step
    done (loading no model) and resumes the training; data the verbs made is data fit finds made."""
    loads = []
    monkeypatch.setattr(
        data_stage, "load_model", lambda name, **options: (loads.append(name), load_model(name, **options))[1]
    )
    recipe = {
        "prompts": str(DATA / "arithmetic.jsonl"),
        "num": 4,
        "max_new_tokens": 30,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "batch_size": 4,
    }
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir, traces=recipe, holdout=0.0)
    out = tmp_path / "run"
    args = ["fit", "--config", str(config), "--out", str(out), "--set", "trainer.max_steps=2"]
    assert cli.main(args) == 0
    captured = capsys.readouterr()  # the steps before the fit are diagnostics (stderr), its result is stdout
    lines = captured.out.splitlines()
    reports = [line.split(": ", 1) for line in captured.err.splitlines() if ": " in line]  # progress bars are there too
    steps = [step for step, text in reports if step in ("traces", "labels", "examples") and text.startswith(str(out))]
    assert steps == ["traces", "labels", "examples"]
    assert len(TraceStore(out / "traces")) == 4 and "scorer trained for 2 steps" in lines[-1]
    labelled = len(list(LabelStore(out / "traces", B, L_).directory.iterdir()))
    assert labelled and len(list((out / "examples").glob("trace-*.safetensors"))) == labelled
    assert loads == [str(tiny_dir)]  # one load shared by the three steps
    # The scorer was configured before its traces existed; it still names their source.
    assert load_scorer(out / "scorer").config.training_sources == [str(DATA / "arithmetic.jsonl")]
    assert cli.main([*args, "--set", "trainer.max_steps=3", "--ckpt-path", "last"]) == 0
    printed = "".join(capsys.readouterr())
    assert "0 shard(s) written, 1 already complete" in printed
    assert f"labelled 0 traces, skipped 0 too short (< B + L = {B + L_} tokens), {labelled} already labelled" in printed
    assert (
        f"made the examples of 0 traces, skipped 0 too short (< B + L = {B + L_} tokens), {labelled} already made"
        in printed
    )
    assert "scorer trained for 3 steps" in printed and loads == [str(tiny_dir)]
    # Labels and examples made by the verbs are the ones fit's steps make: found complete.
    verbs = tmp_path / "verbs"
    traces = Path(shutil.copytree(out / "traces", verbs / "traces", ignore=shutil.ignore_patterns("labels-*")))
    assert cli.main(["labels", "--traces", str(traces), "-B", str(B), "-L", str(L_)]) == 0
    assert (
        cli.main(["examples", "--traces", str(traces), "-B", str(B), "-L", str(L_), "--out", str(verbs / "examples")])
        == 0
    )
    assert cli.main(fit_args(config, verbs, traces, "trainer.max_steps=1")) == 0
    printed = "".join(capsys.readouterr())
    assert f"{labelled} already labelled" in printed and f"{labelled} already made" in printed
    assert "scorer trained for 1 steps" in printed


def test_fit_on_policy_rounds_add_the_scorers_own_states_and_resume(tmp_path, tiny_dir, traces_dir, capsys):
    """Two rounds after the golden fit: each records the previous scorer's trajectory on the training
    traces only, trains on golden + every round so far from the previous weights, and exports; the
    last round is --out/scorer. A rerun does nothing; a lost round is made again from its predecessor."""
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir, feature_set="standardised")
    config.write_text(config.read_text() + "on_policy:\n  rounds: 2\n  steps: 3\n")  # the config's rounds
    out = tmp_path / "run"
    args = fit_args(config, out, traces_dir, "trainer.max_steps=2")
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    golden = sorted(path.name for path in (out / "examples").glob("trace-*.safetensors"))
    data = cli_main(
        ["--config", str(config), f"--data.traces_dir={traces_dir}", f"--data.examples_dir={out / 'examples'}"],
        run=False,
    ).datamodule
    data.setup("fit")
    training = sorted(f"trace-{index:06d}.safetensors" for index in data.train_indices)
    assert set(training) < set(golden)  # the held-out traces get no on-policy examples
    for round_ in (1, 2):
        folder = out / f"round-{round_}"
        assert sorted(path.name for path in (folder / "examples").glob("trace-*.safetensors")) == training
        trajectory = json.loads((folder / "examples" / "examples.json").read_text())["trajectory"]
        assert trajectory == scorer_trajectory(load_scorer(out / f"round-{round_ - 1}" / "scorer"))
        assert f"{folder / 'scorer'}: scorer trained for 3 steps" in printed
        record = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=False)
        assert record["hyper_parameters"]["init_scorer"] == str(out / f"round-{round_ - 1}" / "scorer")
    final = load_scorer(out / "scorer").state_dict()
    for name, tensor in load_scorer(out / "round-2" / "scorer").state_dict().items():
        torch.testing.assert_close(final[name], tensor, rtol=0, atol=0)
    assert any(
        (load_scorer(out / "round-1" / "scorer").state_dict()[name] != tensor).any() for name, tensor in final.items()
    )
    # A finished run reruns as a no-op; a lost round 2 is made again from round 1's scorer.
    assert cli.main(args) == 0
    assert "scorer trained" not in capsys.readouterr().out.replace(f"{out / 'scorer'}: the scorer", "")
    shutil.rmtree(out / "round-2")
    assert cli.main(args) == 0
    again = capsys.readouterr().out
    assert (
        f"{out / 'round-2' / 'scorer'}: scorer trained for 3 steps" in again and "round-1/scorer: scorer" not in again
    )
    # --on-policy-rounds 0 overrides the config: the golden fit alone, exported to --out/scorer.
    plain = tmp_path / "plain"
    assert cli.main([*fit_args(config, plain, traces_dir, "trainer.max_steps=2"), "--on-policy-rounds", "0"]) == 0
    assert (plain / "scorer" / "config.json").is_file() and not list(plain.glob("round-*"))


def assert_scores_the_mean(merged, members) -> None:
    """The merged scorer's keep scores of random inputs equal the mean of the members'."""
    generator = torch.Generator().manual_seed(0)
    shape = (merged.config.num_layers, 1, merged.config.num_kv_heads, 5)
    inputs = [
        torch.randn(*shape, width, generator=generator)
        for width in (merged.config.head_dim, merged.config.head_dim, merged.config.feature_width)
    ]
    with torch.no_grad():
        mean = sum(member(*inputs) for member in members) / len(members)
        torch.testing.assert_close(merged(*inputs), mean, rtol=0, atol=1e-6)


def test_fit_ensemble_averages_fits_under_successive_seeds_and_resumes(tmp_path, tiny_dir, traces_dir, capsys):
    """--ensemble 2: member i fits with seed_everything + i in --out/member-i (member 0 is the plain fit of
    the same seed), and --out/scorer scores the mean of the two. A rerun skips the members made."""
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir, feature_set="standardised")
    out, single = tmp_path / "run", tmp_path / "single"
    args = [*fit_args(config, out, traces_dir, "trainer.max_steps=2"), "--ensemble", "2"]
    assert cli.main(args) == 0
    assert f"{out / 'scorer'}: the mean of 2 fits (seed_everything 0 and 1)" in capsys.readouterr().out
    assert cli.main(fit_args(config, single, traces_dir, "trainer.max_steps=2")) == 0
    members = [load_scorer(out / f"member-{member}" / "scorer") for member in (0, 1)]
    for name, tensor in load_scorer(single / "scorer").state_dict().items():
        torch.testing.assert_close(members[0].state_dict()[name], tensor, rtol=0, atol=0)
    assert any((members[1].state_dict()[name] != tensor).any() for name, tensor in members[0].state_dict().items())
    merged = load_scorer(out / "scorer")
    assert merged.config.hidden == 2 * members[0].config.hidden
    assert_scores_the_mean(merged, members)
    assert "ensemble: the mean keep score of 2 fits of one recipe" in (out / "scorer" / "README.md").read_text()
    capsys.readouterr()
    assert cli.main(args) == 0
    assert "scorer trained" not in capsys.readouterr().out
    shutil.rmtree(out / "member-1")  # a lost member is fitted again; the ensemble is written again
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert (
        f"{out / 'member-1' / 'scorer'}: scorer trained for 2 steps" in printed
        and "member-0/scorer: scorer" not in printed
    )
    assert "seeds: 0 and 1" in (out / "scorer" / "README.md").read_text()
    refused = [
        (["--ckpt-path", "x.ckpt"], "resumes each member from its own last checkpoint: --ckpt-path last, not 'x.ckpt'"),
        (
            ["--set", "seed_everything=true"],
            "needs an integer seed_everything to count its members' seeds from, got True",
        ),
    ]
    for extra, message in refused:
        assert cli.main([*args, *extra]) == 2
        assert message in capsys.readouterr().err


def test_fit_ensemble_members_each_run_their_own_on_policy_rounds(tmp_path, tiny_dir, traces_dir, capsys):
    """--ensemble 2 --on-policy-rounds 1: member i fits under seed_everything + i, then replays its own
    golden fit's trajectory in member-i/round-1 and refits from it; --out/scorer is the mean of the
    members' last rounds, and each member's training record is its last round's."""
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir, feature_set="standardised")
    out = tmp_path / "run"
    args = [*fit_args(config, out, traces_dir, "trainer.max_steps=2"), "--ensemble", "2", "--on-policy-rounds", "1"]
    args += ["--round-steps", "3"]
    assert cli.main(args) == 0
    assert f"{out / 'scorer'}: the mean of 2 fits (seed_everything 0 and 1)" in capsys.readouterr().out
    members = [out / f"member-{member}" for member in (0, 1)]
    golden = [load_scorer(member / "round-0" / "scorer").state_dict() for member in members]
    assert any((golden[1][name] != tensor).any() for name, tensor in golden[0].items())  # seeds 0 and 1
    for member in members:
        trajectory = json.loads((member / "round-1" / "examples" / "examples.json").read_text())["trajectory"]
        assert trajectory == scorer_trajectory(load_scorer(member / "round-0" / "scorer"))
        refit = torch.load(member / "round-1" / "checkpoints" / "last.ckpt", weights_only=False)
        assert refit["hyper_parameters"]["init_scorer"] == str(member / "round-0" / "scorer")
        last = load_scorer(member / "round-1" / "scorer").state_dict()
        for name, tensor in load_scorer(member / "scorer").state_dict().items():
            torch.testing.assert_close(last[name], tensor, rtol=0, atol=0)
        assert json.loads((member / "training.json").read_text())["optimisation steps"] == 3  # the round's record
    assert_scores_the_mean(load_scorer(out / "scorer"), [load_scorer(member / "scorer") for member in members])


def test_fit_ensemble_started_twice_shares_out_the_members(tmp_path, tiny_dir, traces_dir, capsys):
    """While another process holds member 0's lock, `foresight fit --ensemble 2` fits member 1 first, then
    waits for member 0 and, the other process having stopped without its scorer, fits it itself."""
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir, feature_set="standardised")
    out = tmp_path / "run"
    (out / "member-0").mkdir(parents=True)
    holder = f"""
import pathlib, time
from filelock import FileLock
lock = FileLock({str(out / "member-0" / MEMBER_LOCK)!r})
lock.acquire()
print("held", flush=True)
deadline = time.monotonic() + 300
while not pathlib.Path({str(out / "member-1" / "scorer" / "config.json")!r}).is_file() and time.monotonic() < deadline:
    time.sleep(0.05)
"""
    other = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:  # the holder goes when member 1 is made; if the fit fails instead, the test fails rather than waits
        assert other.stdout.readline().strip() == "held"
        assert cli.main([*fit_args(config, out, traces_dir, "trainer.max_steps=2"), "--ensemble", "2"]) == 0
    finally:
        other.kill()
        other.wait()
        other.stdout.close()
    printed = capsys.readouterr().out
    first, second = (printed.index(f"{out / f'member-{m}' / 'scorer'}: scorer trained") for m in (1, 0))
    assert first < second and (out / "scorer" / "config.json").is_file()


def test_fit_errors_are_one_line(tmp_path, tiny_dir, traces_dir, capsys):
    config = tiny_config(tmp_path / "tiny.yaml", tiny_dir)
    assert cli.main(["fit", "--config", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "x")]) == 2
    assert "config" in capsys.readouterr().err
    assert cli.main(fit_args(config, tmp_path / "x", traces_dir, "trainer.max_steps")) == 2
    assert "--set 'trainer.max_steps' must look like KEY=VALUE" in capsys.readouterr().err
    for flag, value, message in (
        ("--on-policy-rounds", "11", "on-policy rounds must be between 0 and 10, got 11"),
        ("--round-steps", "0", "round steps must be a positive integer, got 0"),
        ("--ensemble", "0", "ensemble members must be between 1 and 16, got 0"),
    ):
        with pytest.raises(SystemExit) as stopped:  # refused by the parser, before any trace is sampled
            cli.main([*fit_args(config, tmp_path / "x", traces_dir), flag, value])
        assert stopped.value.code == 2 and message in capsys.readouterr().err
    other = tiny_config(tmp_path / "other.yaml", tiny_dir, model=str(tmp_path / "another-model"))
    assert cli.main(fit_args(other, tmp_path / "y", traces_dir)) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "another-model" in error
    assert cli.main(["fit", "--config", str(config), "--out", str(tmp_path / "z")]) == 2  # no recipe, no traces
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and f"{tmp_path / 'z' / 'traces'} is not a trace folder" in error


def tensorboard_scalars(run: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (logs,) = {events.parent for events in run.rglob("events.out.tfevents.*")}  # one run: fit, then validate
    accumulator = EventAccumulator(str(logs))
    accumulator.Reload()
    return {event.step: event.value for event in accumulator.Scalars(tag)}


def test_b2_is_frozen_and_a_run_saved_while_it_was_optimised_resumes():
    """b2 takes no gradient and no optimiser slot; a checkpoint whose optimiser still held it (saved before
    it was frozen) loads into the optimiser of today, with the other parameters' moments kept."""
    module = supervised.SupervisedScorer(scorer_spec())
    assert not module.scorer.b2.requires_grad
    assert [p.shape for p in module.trained_parameters()] == [
        module.scorer.w1.shape,
        module.scorer.b1.shape,
        module.scorer.w2.shape,
    ]
    old = torch.optim.AdamW(module.scorer.parameters(), lr=0.01)  # the optimiser of before: b2 last
    for parameter in module.scorer.parameters():
        parameter.grad = torch.ones_like(parameter)
    old.step()
    checkpoint = {"optimizer_states": [old.state_dict()]}
    module.on_load_checkpoint(checkpoint)
    today = torch.optim.AdamW(module.trained_parameters(), lr=0.01)
    today.load_state_dict(checkpoint["optimizer_states"][0])
    moments = [today.state[p]["exp_avg"] for p in module.trained_parameters()]
    assert all(torch.equal(m, old.state[p]["exp_avg"]) for m, p in zip(moments, module.trained_parameters()))


@pytest.mark.slow
def test_ddp_on_two_processes_matches_one_process_at_the_same_global_batch(tmp_path, tiny_dir, traces_dir):
    """Two gloo processes with 2 traces each per step against one process with 4: the logged losses
    and the trained weights agree (the same shuffled global batches; the loss is normalised by the
    global problem count)."""
    config = tiny_config(
        tmp_path / "tiny.yaml",
        tiny_dir,
        holdout=0.0,
        examples_dir=str(tmp_path / "features"),
        traces_dir=str(traces_dir),
    )
    frozen = FrozenModel(str(tiny_dir))  # `trainers.cli fit` reads only: make its labels and features first
    make_labels(frozen, traces_dir, B, L_, progress=False)
    key = ExampleKey(str(tiny_dir), "float32", B, L_, "paper", "float16")
    make_examples(frozen, ExampleCache(tmp_path / "features", traces_dir, key), progress=False)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    runs = {}
    for name, devices, batch in (("one", 1, 4), ("two", 2, 2)):
        out = tmp_path / name
        command = [
            sys.executable,
            "-m",
            "trainers.cli",
            "fit",
            f"--config={config}",
            "--trainer.max_steps=3",
            f"--trainer.devices={devices}",
            "--trainer.strategy=ddp" if devices > 1 else "--trainer.strategy=auto",
            f"--data.batch_size={batch}",
            f"--trainer.default_root_dir={out}",
            f"--checkpoint.dirpath={out}/ckpt",
        ]
        subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
        runs[name] = out
    one, two = (tensorboard_scalars(runs[name], "train/loss") for name in ("one", "two"))
    assert sorted(one) == sorted(two) and len(one) == 3
    for step in one:
        assert math.isclose(one[step], two[step], rel_tol=1e-4), (step, one[step], two[step])
    trained = [weights(runs[name] / "ckpt" / "last.ckpt") for name in ("one", "two")]
    for name, tensor in trained[0].items():
        torch.testing.assert_close(trained[1][name], tensor, rtol=1e-4, atol=1e-6)


def test_named_third_party_notices_are_silenced_and_no_others(monkeypatch, caplog):
    """Lightning's litlogger tip and checkpoint notice and torch's LeafSpec deprecation (from Lightning's pytree
    helper) are dropped; another notice of the same logger, and another FutureWarning, still show."""
    import logging

    from lightning.pytorch.utilities import rank_zero
    from lightning.pytorch.utilities._pytree import _tree_flatten

    from trainers.process import quiet_third_party_notices

    monkeypatch.delenv("JSONARGPARSE_DEPRECATION_WARNINGS", raising=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_third_party_notices()
        _tree_flatten(torch.zeros(1))  # builds a LeafSpec
        rank_zero.rank_zero_warn(  # Lightning's words (callbacks/model_checkpoint.py) at a manual step's checkpoint
            "Using ModelCheckpoint with manual optimization and every_n_train_steps, but no pre-optimization state"
            " was saved. The checkpoint will contain the model state AFTER optimization."
        )
        warnings.warn("a notice of our own", FutureWarning, stacklevel=2)
    assert [str(w.message) for w in caught] == ["a notice of our own"]
    assert os.environ["JSONARGPARSE_DEPRECATION_WARNINGS"] == "off"
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        rank_zero.rank_zero_info("💡 Tip: For seamless cloud logging, try installing litlogger")
        rank_zero.rank_zero_info("GPU available: False")
    assert [record.getMessage() for record in caplog.records] == ["GPU available: False"]
