"""`foresight export`: a Lightning checkpoint of the supervised stage becomes a complete Hub folder with
a model card; pushing without a token or a network fails in one line and leaves the folder complete."""

from __future__ import annotations

import json

import huggingface_hub
import pytest
import torch
import yaml
from torch.utils.data import DataLoader

from foresight import cli
from foresight.policies import make_policy
from foresight.scorer.model import load_scorer
from tests.scorers import quiet_trainer, scorer_spec, synthetic_traces
from trainers.data import concat_steps
from trainers.export import SCORER_KEY, read_checkpoint
from trainers.supervised import SupervisedScorer

FILES = {"README.md", "config.json", "model.safetensors"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real supervised-stage checkpoint after a few steps on synthetic traces."""
    folder = tmp_path_factory.mktemp("run")
    module = SupervisedScorer(scorer_spec())
    trainer = quiet_trainer(3, folder)
    trainer.fit(
        module,
        DataLoader(synthetic_traces(4, 2), batch_size=2, collate_fn=concat_steps),
        DataLoader(synthetic_traces(2, 2, seed=1), batch_size=2, collate_fn=concat_steps),
    )
    path = folder / "last.ckpt"
    trainer.save_checkpoint(path)
    return path, module


def test_export_writes_a_complete_folder_from_a_checkpoint(checkpoint, tmp_path, capsys):
    path, module = checkpoint
    evaluation = tmp_path / "eval.md"
    evaluation.write_text("| policy | loss ratio |\n|---|---|\n| foresight | 1.0123 |\n")
    out = tmp_path / "export"
    assert cli.main(["export", "--scorer", str(path), "--out", str(out), "--evaluation", str(evaluation)]) == 0
    assert capsys.readouterr().out.strip() == f"{out}: scorer for tiny (B=16, L=4, paper features)"
    assert FILES <= {p.name for p in out.iterdir()}
    scorer = load_scorer(out)
    for name, tensor in module.scorer.state_dict().items():
        torch.testing.assert_close(scorer.state_dict()[name], tensor, rtol=0, atol=0)
    assert scorer.config == module.scorer.config
    card = (out / "README.md").read_text()
    front_matter = yaml.safe_load(card.split("---")[1])
    assert front_matter["library_name"] == "foresightkv" and "kv-cache-eviction" in front_matter["tags"]
    for text in (
        "| budget B | 16 |",
        "| interval L | 4 |",
        "last_8, last_16, last_32, last_L, cumulative, decayed",
        "(2 layers, 4 query heads, 2 KV heads, head dim 16)",
        "optimisation steps: 3",
        "| val/overlap |",
        "| foresight | 1.0123 |",
        'make_policy("foresight", scorer="PATH_OR_REPO_ID")',
        'model, tokenizer = load_model("',  # double quotes: the card passes `ruff format --check`
        "EvictionConfig(budget=16, interval=4)",
    ):
        assert text in card, text
    assert "train/lr" not in card  # the learning rate is not a result


def test_several_checkpoints_export_the_mean_of_their_keep_scores_with_a_shared_record(checkpoint, tmp_path):
    path, module = checkpoint
    other = tmp_path / "other"
    module.scorer.save_pretrained(other)
    with torch.no_grad():  # a second member: the same scorer with other weights, saved as a folder (no record)
        loaded = load_scorer(other)
        loaded.w2.mul_(-1)
        loaded.save_pretrained(other)
    out = tmp_path / "mean"
    assert cli.main(["export", "--scorer", str(path), "--scorer", str(path), "--out", str(out)]) == 0
    card = (out / "README.md").read_text()
    assert "ensemble: the mean keep score of 2 fits of one recipe" in card and "optimisation steps: 3" in card
    assert "| val/overlap |" in card
    assert load_scorer(out).config.hidden == 2 * module.scorer.config.hidden
    assert cli.main(["export", "--scorer", str(path), "--scorer", str(other), "--out", str(tmp_path / "zero")]) == 0
    generator = torch.Generator().manual_seed(0)
    config = module.scorer.config
    inputs = [
        torch.randn(config.num_layers, 1, config.num_kv_heads, 6, width, generator=generator)
        for width in (config.head_dim, config.head_dim, config.feature_width)
    ]
    with torch.no_grad():  # w2 and -w2: the hidden layers cancel, b2 is left
        scores = load_scorer(tmp_path / "zero")(*inputs)
        torch.testing.assert_close(scores, module.scorer.b2[:, None, :, None].expand_as(scores), rtol=0, atol=1e-6)
    assert "No training record" not in (tmp_path / "zero" / "README.md").read_text()


def test_export_reexports_a_scorer_folder(checkpoint, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    assert cli.main(["export", "--scorer", str(checkpoint[0]), "--out", str(first)]) == 0
    assert cli.main(["export", "--scorer", str(first), "--out", str(second)]) == 0
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()


def test_export_writes_the_sums_dtype_the_policy_then_holds(checkpoint, tmp_path, capsys):
    """A scorer exported with --sums-dtype float16 is run with 16-bit sums unless the policy is told otherwise; an
    older scorer's config names none and runs at float32; a dtype that is not a float is refused in one line."""
    folder = tmp_path / "half"
    assert cli.main(["export", "--scorer", str(checkpoint[0]), "--out", str(folder), "--sums-dtype", "float16"]) == 0
    assert json.loads((folder / "config.json").read_text())["sums_dtype"] == "float16"
    dtypes = {field.name: field.dtype for field in make_policy("foresight", scorer=folder).state_fields}
    assert dtypes["decayed"] == torch.float16 and dtypes["cumulative"] == torch.float32
    told = make_policy("foresight", scorer=folder, sums_dtype="float32").state_fields
    assert {field.dtype for field in told} == {torch.float32}
    assert load_scorer(checkpoint_folder(checkpoint, tmp_path)).config.sums_dtype == "float32"
    assert (
        cli.main(["export", "--scorer", str(checkpoint[0]), "--out", str(tmp_path / "x"), "--sums-dtype", "int8"]) == 2
    )
    assert (
        "sums_dtype must name a torch float dtype such as 'float16' or 'float32', got 'int8'" in capsys.readouterr().err
    )


def checkpoint_folder(checkpoint, tmp_path):
    folder = tmp_path / "plain"
    assert cli.main(["export", "--scorer", str(checkpoint[0]), "--out", str(folder)]) == 0
    return folder


def test_push_without_a_token_fails_in_one_line_and_keeps_the_folder(checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr("trainers.export.get_token", lambda: None)
    out = tmp_path / "export"
    args = ["export", "--scorer", str(checkpoint[0]), "--out", str(out), "--push-to-hub", "someone/scorer"]
    assert cli.main(args) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("foresight export: error: cannot push to someone/scorer: no Hugging Face token")
    assert error.endswith(f"the folder {out} is complete; push it later with `hf upload someone/scorer {out}`")
    assert "\n" not in error and FILES <= {p.name for p in out.iterdir()}


def test_push_offline_fails_in_one_line_and_keeps_the_folder(checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr("trainers.export.get_token", lambda: "hf_not_a_real_token")
    out = tmp_path / "export"
    assert (
        cli.main(["export", "--scorer", str(checkpoint[0]), "--out", str(out), "--push-to-hub", "someone/scorer"]) == 2
    )
    error = capsys.readouterr().err.strip()
    assert error.startswith("foresight export: error: cannot push to someone/scorer: ")
    assert "\n" not in error and FILES <= {p.name for p in out.iterdir()}


def test_checkpoints_that_are_not_the_scorers_are_refused(tmp_path, capsys):
    other = tmp_path / "other.ckpt"
    torch.save({"state_dict": {}}, other)
    assert cli.main(["export", "--scorer", str(other), "--out", str(tmp_path / "x")]) == 2
    assert (
        f"{other} is not a checkpoint of a scorer training stage (no {SCORER_KEY!r} entry)" in capsys.readouterr().err
    )
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="garbage.ckpt is not a readable checkpoint"):
        read_checkpoint(garbage)
    assert cli.main(["export", "--scorer", str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "x")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
